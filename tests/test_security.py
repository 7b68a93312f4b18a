"""refit tried as a stranger on the same network would: through the store and the ports of a live refit.

The stranger (a thread of the test process, without the job secret) connects to the store that
process 0 of a running ``run_local`` job hosts, plants pickle payloads and forged control values
(abort, commit votes, pre-flight errors) under every key refit reads, keeps forging aborts while the
refit runs, and sends junk bytes to every port the job's processes listen on. The refit must complete
bit for bit, nothing may be unpickled (a sentinel file would appear), and every listener must be on
loopback.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.errors import ConfigError, PlanError
from refit.transport import auth
from refit.transport.ipc_handles import check_handle_fields, import_handles
from refit.transport.store import SignedStore

SECRET = b"security-test-secret-0123456789"


class _Sentinel:
    """Unpickling this creates the file ``path``: proof that refit ran a stranger's code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _store() -> SignedStore:
    return SignedStore(dist.HashStore(), SECRET)


# -- the signed store -----------------------------------------------------------------------------


def test_a_value_without_a_valid_tag_is_ignored_and_counted():
    s = _store()
    s.raw.set("k", pickle.dumps({"x": 1}))
    assert s.peek("k") is None
    forged = b"refit1." + b"00" * 32 + b'.{"abort": "forged"}'
    s.raw.set("k", forged)
    assert s.peek("k") is None
    assert s.rejected["k"] == 2
    s.put("k", {"x": 1})
    assert s.peek("k") == {"x": 1}


def test_a_valid_value_moved_to_another_key_or_job_is_rejected():
    s = _store()
    s.put("run/v1.0/ok/1", {"version": 1})
    s.raw.set("run/v2.0/ok/1", s.raw.get("run/v1.0/ok/1"))  # replayed under the next version's key
    assert s.peek("run/v2.0/ok/1") is None
    other = SignedStore(s.raw, b"another-job-secret-0123456789")
    assert other.peek("run/v1.0/ok/1") is None
    job_a, job_b = SignedStore(s.raw, SECRET, "job-a"), SignedStore(s.raw, SECRET, "job-b")
    job_a.put("run/v1.0/abort", {"abort": "from job a"})  # the same secret, reused for another job
    assert job_b.peek("run/v1.0/abort") is None and job_a.peek("run/v1.0/abort") == {"abort": "from job a"}


def test_first_writer_displaces_a_forgery_but_not_a_real_value():
    s = _store()
    s.raw.set("abort", b"forged abort")
    assert s.first("abort", {"abort": "real"}) == {"abort": "real"}
    assert s.first("abort", {"abort": "second"}) == {"abort": "real"}


def test_first_ends_when_a_forgery_vanishes_under_it():
    s = _store()
    raw, calls = s.raw, []

    class Vanishing:  # the stranger's value is deleted between our read and our compare-and-set
        def compare_set(self, key, expected, desired):
            calls.append(expected)
            if len(calls) == 1:
                return b"junk"
            return raw.compare_set(key, expected, desired)

    s.raw = Vanishing()
    assert s.first("abort", {"abort": "real"}, timeout_s=5.0) == {"abort": "real"}
    assert len(calls) <= 3


def test_waiting_for_every_member_ignores_keys_that_merely_exist():
    s = _store()
    keys = [f"status/{m}" for m in range(3)]
    for k in keys:
        s.raw.set(k, b"forged ok")  # a stranger's values: the keys exist
    s.put(keys[0], "ok")
    assert s.wait_all(keys, 0.2) == {keys[0]: "ok"}  # not "everyone posted", not "1 and 2 are dead" early


def test_get_times_out_with_timeout_error_naming_the_key():
    s = SignedStore(dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False), SECRET)
    for _ in range(5):
        with pytest.raises(TimeoutError, match="'absent'"):
            s.get("absent", 0.01)
    s.raw.set("forged", b"x")
    with pytest.raises(TimeoutError, match="same secret"):
        s.get("forged", 0.05)


def test_a_deleted_commit_vote_comes_back():
    from refit.transport.control import AbortChannel

    s = _store()
    a, b = AbortChannel(s, "j", 0, 2), AbortChannel(SignedStore(s.raw, SECRET), "j", 1, 2)
    s.put("j/v1.0/ok/1", {"version": 1})  # process 1 voted ...
    s.raw.delete_key("j/v1.0/ok/1")  # ... and a stranger deleted the vote
    done = threading.Thread(target=b.vote, args=(1, 0, time.monotonic() + 10, [0, 1]))
    done.start()
    a.vote(1, 0, time.monotonic() + 10, [0, 1])  # returns: 1's vote is re-written while it waits
    done.join(timeout=10)
    assert not done.is_alive() and s.peek("j/v1.0/commit") == {"version": 1}


def test_get_waits_past_a_forgery_for_the_real_value():
    s = _store()
    s.raw.set("k", b"junk")

    def later():
        time.sleep(0.2)
        s.put("k", [1, 2])

    t = threading.Thread(target=later)
    t.start()
    assert s.get("k", 10.0) == [1, 2]
    t.join()
    with pytest.raises(TimeoutError, match="'nothing'"):
        s.get("nothing", 0.05)


def test_get_with_under_a_millisecond_left_times_out_instead_of_waiting_forever():
    """c10d stores take waits in whole milliseconds and read 0 as no timeout: a get whose time left
    rounds down to 0 ms once waited forever (a CI run hung in the test above). It must time out."""
    from refit.transport.store import _wait_span

    assert _wait_span(0.0004) == timedelta(milliseconds=1) and _wait_span(0.0101) == timedelta(milliseconds=11)
    s, errors = _store(), []

    def get():
        for timeout_s in (0.0004, 0.001, 0.0015):
            try:
                s.get("nothing", timeout_s)
            except TimeoutError as e:
                errors.append(e)

    t = threading.Thread(target=get, daemon=True)  # a hang would block in C++, beyond pytest-timeout's reach
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and len(errors) == 3


def test_a_sealed_value_is_useless_without_the_secret():
    s = _store()
    handle = b"\x01cuda-ipc-handle-bytes\x02" * 3
    s.put_sealed("ipc/0", handle)
    raw = s.raw.get("ipc/0")
    assert handle not in raw and base64.b64encode(handle) not in raw
    assert s.get_sealed("ipc/0", 1.0) == handle
    with pytest.raises(TimeoutError):  # another secret: the tag is not valid, so there is no value at all
        SignedStore(s.raw, b"another-job-secret-0123456789").get_sealed("ipc/0", 0.05)
    blob = base64.b64decode(json.loads(raw.split(b".", 2)[2])["sealed"])
    assert auth.unseal(b"another-job-secret-0123456789", "ipc/0", blob) is None
    assert auth.unseal(SECRET, "ipc/1", blob) is None  # sealed for another key


def test_ipc_handles_under_a_pickle_payload_run_nothing(tmp_path):
    sentinel = tmp_path / "pwned"
    s = _store()
    s.raw.set("ipc/0", pickle.dumps(_Sentinel(str(sentinel))))
    with pytest.raises(TimeoutError):
        import_handles(s, "ipc/0", 0.1)
    s.put("ipc/0", {"sealed": base64.b64encode(pickle.dumps(_Sentinel(str(sentinel)))).decode()})
    with pytest.raises(ConfigError, match="not sealed"):
        import_handles(s, "ipc/0", 0.1)
    s.put_sealed("ipc/0", pickle.dumps(_Sentinel(str(sentinel))))  # even sealed with the secret: JSON only
    with pytest.raises(ValueError):
        import_handles(s, "ipc/0", 0.1)
    assert not sentinel.exists()


def _good_fields() -> dict:
    b64 = base64.b64encode(b"h" * 64).decode()
    return {
        "size": [4, 8], "stride": [8, 1], "offset": 0, "dtype": "bfloat16", "device": 0, "handle": b64,
        "storage_bytes": 64, "storage_offset": 0, "ref_handle": b64, "ref_offset": 0, "event_handle": None,
        "event_sync": True,
    }  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        ({"extra": 1}, "keys"),
        ({"size": [4, "8"]}, "size"),
        ({"stride": [8]}, "size"),
        ({"dtype": "object"}, "dtype"),
        ({"offset": -1}, "negative"),
        ({"offset": True}, "offset"),
        ({"size": [4, 9]}, "past its 64-byte storage"),
        ({"handle": 5}, "handle"),
    ],
)
def test_ipc_handle_records_are_validated_field_by_field(change, match):
    assert check_handle_fields(_good_fields()) == _good_fields()
    with pytest.raises(PlanError, match=match):
        check_handle_fields({**_good_fields(), **change})


def test_a_secret_file_readable_by_others_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "secret"
    f.write_text("x" * 40)
    f.chmod(0o644)
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(f))
    with pytest.raises(ConfigError, match="chmod 600"):
        auth.job_secret()
    f.chmod(0o600)
    assert auth.job_secret() == b"x" * 40
    monkeypatch.delenv(auth.SECRET_FILE_ENV)
    with pytest.raises(ConfigError, match="no job secret"):
        auth.job_secret()
    monkeypatch.setenv(auth.SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16"):
        auth.job_secret()


# -- a live refit under attack ---------------------------------------------------------------------

NAME = "sec"
VERSIONS = (1, 2)


def _keys_refit_reads(n_procs: int) -> list[str]:
    """Every key a CPU refit of ``n_procs`` processes reads (pre-flight, aborts, commit votes)."""
    keys = []
    for p in range(n_procs):
        keys += [f"{NAME}/preflight/{p}", f"{NAME}/preflight/{p}/plan"]
        keys += [f"{NAME}/run/v{v}.0/ok/{p}" for v in VERSIONS]
    keys += [f"{NAME}/run/v{v}.0/{what}" for v in VERSIONS for what in ("abort", "commit")]
    return keys


def _attacked_worker(world, workdir: str):
    import psutil

    from refit import layout_from_spec, parse_spec
    from refit.layout.models import param_shapes
    from refit.plan import ProcessMap
    from refit.tools.verify import holds, reference_shards
    from refit.transfer import Peer

    work = Path(workdir)
    (work / f"pid{world.rank}").write_text(str(os.getpid()))
    if world.rank == 0:  # tell the stranger where the store is (a stranger would scan for it)
        world.store.raw.set("probe", "x")
        (work / "port").write_text(str(dist.distributed_c10d._get_default_store().underlying_store.port))
    while not (work / "ready").exists():  # the stranger has planted its values
        time.sleep(0.01)
    shapes = param_shapes("tiny-llama")
    src = layout_from_spec(shapes, parse_spec("tp=2", "src"))
    dst = layout_from_spec(shapes, parse_spec("tp=2", "dst"))
    procs = ProcessMap.disjoint(2, 2)
    config = TransferConfig(name=NAME, commit="staged", checksums=True, deadline_s=60, preflight_timeout_s=60)
    is_src = world.src_rank is not None
    rank = world.src_rank if is_src else world.dst_rank
    tensors = reference_shards(src if is_src else dst, rank, seed=1)
    store = world.store
    peer = Peer(
        src,
        dst,
        world.rank,
        src_tensors=tensors if is_src else None,
        dst_tensors=None if is_src else {n: torch.zeros_like(t) for n, t in tensors.items()},
        procs=procs,
        config=config,
        store=store,
    )
    exact = []
    for v in VERSIONS:
        if is_src:
            for n, t in reference_shards(src, rank, seed=v).items():
                tensors[n].copy_(t)
        peer.run(v)
        exact.append(True if is_src else holds(peer.live, dst, rank, seed=v))
    listening = [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections("tcp") if c.status == "LISTEN"]
    peer.close()
    rejected = sum(store.rejected.values()) + sum(peer.channel.store.rejected.values())
    secret = hashlib.sha256(os.environ["REFIT_SECRET"].encode()).hexdigest()
    return {"exact": exact, "listening": listening, "rejected": rejected, "secret": secret}


class _Stranger(threading.Thread):
    """No secret: plants pickles and forgeries, keeps forging aborts, sprays junk at every port."""

    def __init__(self, work: Path, n_procs: int) -> None:
        super().__init__(daemon=True)
        self.work, self.n_procs, self.stop, self.error = work, n_procs, threading.Event(), None
        self.ports_hit: set[int] = set()
        self.planted: list[str] = []
        self.keys_seen: set[str] = set()

    def run(self) -> None:
        try:
            self._attack()
        except (RuntimeError, OSError):  # the store went away: the job is over
            pass
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def _attack(self) -> None:
        while not (self.work / "port").exists():
            if self.stop.wait(0.01):
                return
        store = dist.TCPStore("127.0.0.1", int((self.work / "port").read_text()), None, False, timedelta(seconds=30))
        prefix = next(k for k in store.list_keys() if k.endswith("probe"))[: -len("probe")]
        pickled = pickle.dumps(_Sentinel(str(self.work / "pwned")))
        for key in _keys_refit_reads(self.n_procs):
            store.set(prefix + key, pickled)
            self.planted.append(prefix + key)
        for p in range(self.n_procs):  # forged pre-flight errors and votes, shaped like refit's
            store.set(f"{prefix}{NAME}/preflight/{p}", b"refit1." + b"ab" * 32 + b'.{"error": "forged"}')
        (self.work / "ready").write_text("1")
        forged_abort = b"refit1." + b"cd" * 32 + b'.{"abort": "forged abort by a stranger"}'
        while not self.stop.is_set():
            for v in VERSIONS:
                key = f"{prefix}{NAME}/run/v{v}.0/abort"
                if store.check([key]) and store.get(key).startswith(b"refit1." + b"cd"):
                    continue
                store.compare_set(key, "", forged_abort)  # only where no real abort stands
                store.compare_set(key, pickled, forged_abort)
            for v in VERSIONS:
                for p in range(self.n_procs):
                    store.compare_set(f"{prefix}{NAME}/run/v{v}.0/ok/{p}", pickled, forged_abort)
            self._junk()
            self.keys_seen |= set(store.list_keys())
            time.sleep(0.02)

    def _junk(self) -> None:
        import psutil

        for f in self.work.glob("pid*"):
            try:
                conns = psutil.Process(int(f.read_text())).net_connections("tcp")
            except (psutil.Error, ValueError):
                continue
            for c in conns:
                if c.status != "LISTEN" or c.laddr.port in self.ports_hit:
                    continue
                try:
                    with socket.create_connection((c.laddr.ip, c.laddr.port), timeout=1) as s:
                        s.sendall(os.urandom(4096))
                    self.ports_hit.add(c.laddr.port)
                except OSError:
                    pass


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_stranger_on_the_store_and_ports_cannot_steer_a_live_refit(tmp_path):
    from refit.tools.launch import run_local

    stranger = _Stranger(tmp_path, 4)
    stranger.start()
    try:
        out = run_local(_attacked_worker, 2, 2, str(tmp_path), backend="gloo", timeout_s=200)
    finally:
        stranger.stop.set()
        stranger.join(timeout=30)
    assert stranger.error is None, stranger.error
    assert not (tmp_path / "pwned").exists()  # (a) nothing unpickled
    assert all(row["exact"] == [True, True] for row in out)  # (b) forgeries ignored, refit exact
    assert sum(row["rejected"] for row in out) > 0  # ... and they were seen
    refit_keys = {k for k in stranger.keys_seen if f"{NAME}/" in k}
    assert refit_keys <= set(stranger.planted)  # every key refit used had a pickle planted first
    assert len(stranger.ports_hit) >= 5  # (d) junk reached the store and the gloo listeners
    assert all(ip == "127.0.0.1" for row in out for ip in row["listening"])  # bound where told


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_the_launcher_makes_one_fresh_secret_for_its_job(tmp_path, monkeypatch):
    from refit.tools.launch import run_local

    before = hashlib.sha256(os.environ.get(auth.SECRET_ENV, "").encode()).hexdigest()
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    (tmp_path / "ready").write_text("1")  # no stranger here
    out = run_local(_attacked_worker, 2, 2, str(tmp_path), backend="gloo", timeout_s=150)
    assert all(row["exact"] == [True, True] for row in out)
    assert len({row["secret"] for row in out}) == 1  # every process of the job holds the same one
    assert out[0]["secret"] != before  # a fresh one, not whatever this process had


def test_bind_address_defaults_to_loopback(monkeypatch):
    from refit.transport.store import BIND_ENV, bind_address, open_store

    monkeypatch.delenv(BIND_ENV, raising=False)
    assert bind_address() == "127.0.0.1"
    store = open_store(bind_address(), 0, 1, True, 10.0)
    import psutil

    mine = [c for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == store.port]
    assert [c.laddr.ip for c in mine] == ["127.0.0.1"]
    del store


def _ipc_export_import(world):
    from refit.transport.ipc_handles import handle_fields, import_handles

    store = world.store
    if world.rank == 0:
        t = torch.arange(4096, dtype=torch.float32, device="cuda:0").reshape(64, 64)
        fields = {"w": handle_fields(t), "view": handle_fields(t[8:16, 4:36])}  # what export_handles seals
        store.put_sealed("sec/ipc/0", json.dumps(fields).encode())
        raw_handle = base64.b64decode(fields["w"]["handle"])
        torch.distributed.barrier()  # the receiver has mapped and checked
        torch.distributed.barrier()  # ... and released its mapping
        return raw_handle not in store.raw.get("sec/ipc/0")
    stranger = SignedStore(store.raw, b"stranger-without-the-secret-000")
    try:
        stranger.get_sealed("sec/ipc/0", 2.0)
        stolen = True
    except TimeoutError:
        stolen = False
    got = import_handles(store, "sec/ipc/0", 30.0)
    want = torch.arange(4096, dtype=torch.float32, device="cuda:0").reshape(64, 64)
    ok = torch.equal(got["w"], want) and torch.equal(got["view"], want[8:16, 4:36])
    torch.distributed.barrier()
    del got
    torch.cuda.ipc_collect()
    torch.distributed.barrier()
    return {"stolen": stolen, "ok": ok}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_handles_map_with_the_secret_and_not_without():
    from refit.tools.launch import run_local

    out = run_local(_ipc_export_import, 1, 1, backend="gloo", devices=["cuda:0", "cuda:0"], timeout_s=120)
    assert out[0] is True  # the store holds no raw handle bytes
    assert out[1] == {"stolen": False, "ok": True}
