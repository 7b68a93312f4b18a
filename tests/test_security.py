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


def _store_ref() -> str:
    """What a worker of the job hosting the store writes for the test's strangers: its port and the store's
    access key (``authstore.access_key``: it proves a connection to the store, and does not yield the job
    secret that tags and seals values). The strangers below forge, replay and read values *on* the store:
    they test the value tags that stand behind the store's handshake."""
    store = dist.distributed_c10d._get_default_store().underlying_store
    return f"{store.port} {store._key.hex()}"


def _store_access(path: Path, timeout_s: float = 60.0):
    """A client of the store ``_store_ref`` wrote to ``path``, after checking that a connection without its
    access key is refused."""
    from refit.transport.authstore import AuthStore, StoreLost

    while len(text := path.read_text().split()) != 2:  # created, not yet written
        time.sleep(0.01)
    port, key = int(text[0]), bytes.fromhex(text[1])
    with pytest.raises(StoreLost, match="refused this process"):
        AuthStore("127.0.0.1", port, os.urandom(32), timeout_s)
    return AuthStore("127.0.0.1", port, key, timeout_s)


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


def test_an_abort_wakes_a_voter_blocked_on_the_store_and_a_timeout_decides_for_every_voter():
    """A voter blocks on the store until the late votes' keys exist: an abort writes its message under every
    key that holds no vote, so the voter returns with the abort long before its deadline. A voter whose
    deadline passes records a timeout as the version's one outcome: a process that votes afterwards and finds
    every vote raises too, it never commits alone."""
    from refit.errors import RefitAborted
    from refit.transport.control import AbortChannel

    s = _store()
    a, b, c = (AbortChannel(SignedStore(s.raw, SECRET), "j", p, 3) for p in range(3))
    raised: list[BaseException] = []

    def vote() -> None:
        try:
            a.vote(1, 0, time.monotonic() + 60, [0, 1, 2])
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    voter = threading.Thread(target=vote)
    voter.start()
    s.put("j/v1.0/ok/1", {"version": 1})  # process 1 voted, process 2 fails:
    assert c.abort(1, 0, "process 2 failed") == "process 2 failed"
    voter.join(timeout=30)  # the deadline is 60 s away: only the abort's wake-up ends the wait this early
    assert not voter.is_alive() and isinstance(raised[0], RefitAborted) and "process 2 failed" in str(raised[0])
    assert s.peek("j/v1.0/ok/1") == {"version": 1}  # a vote is never replaced by the wake-up

    with pytest.raises(TimeoutError, match="version 2 was not finished before the deadline by process 1"):
        a.vote(2, 0, time.monotonic() + 0.05, [0, 1])
    with pytest.raises(TimeoutError, match="by process 1"):  # every vote is there, but the timeout stands
        b.vote(2, 0, time.monotonic() + 5, [0, 1])
    assert s.peek("j/v2.0/commit") == {"timeout": "version 2 was not finished before the deadline by process 1"}


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


def _secret_file(tmp_path: Path, monkeypatch, data: bytes = b"x" * 40, mode: int = 0o600) -> Path:
    f = tmp_path / "secret"
    f.write_bytes(data)
    f.chmod(mode)
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(f))
    return f


@pytest.mark.timeout(60)
def test_a_secret_file_that_is_a_fifo_a_symlink_a_folder_or_huge_is_refused_before_it_is_read(tmp_path, monkeypatch):
    f = _secret_file(tmp_path, monkeypatch)
    assert auth.job_secret() == b"x" * 40
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # private, but nobody writes: reading it would block forever
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(fifo))
    with pytest.raises(ConfigError, match="is not a regular file"):
        auth.job_secret()
    link = tmp_path / "link"
    link.symlink_to(f)  # a link planted where the secret should be
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(link))
    with pytest.raises(ConfigError, match="symbolic link"):
        auth.job_secret()
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="not a regular file"):
        auth.job_secret()
    _secret_file(tmp_path, monkeypatch, b"y" * (64 << 20))  # 64 MiB: refused from its size, not read
    with pytest.raises(ConfigError, match=f"67,108,864 bytes; a secret file holds at most {auth.MAX_SECRET_BYTES}"):
        auth.job_secret()


@pytest.mark.parametrize(
    "secret, match",
    [
        (" padded-secret-0123456789", "surrounding whitespace"),
        ("padded-secret-0123456789\t", "surrounding whitespace"),
        ("a-secret-with\x1b[2Ja-control-character", "control character at position 13"),
        ("a-secret-with\na-newline-inside", "control character at position 13"),
    ],
)
def test_a_secret_with_surrounding_whitespace_or_a_control_character_is_refused(secret, match, monkeypatch):
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(auth.SECRET_ENV, secret)
    with pytest.raises(ConfigError, match=match):
        auth.job_secret()


def test_a_secret_file_with_a_control_character_is_refused_and_one_trailing_newline_is_not(tmp_path, monkeypatch):
    _secret_file(tmp_path, monkeypatch, b"a-secret-with\x00-a-nul-0123456789")
    with pytest.raises(ConfigError, match="control character at position 13"):
        auth.job_secret()
    _secret_file(tmp_path, monkeypatch, b"a-secret-from-an-editor-0123456789\n")
    assert auth.job_secret() == b"a-secret-from-an-editor-0123456789"


def _never_runs(world):
    raise AssertionError("a process started with a bad secret")


@pytest.mark.timeout(120)
def test_a_bad_secret_is_refused_before_any_process_starts(monkeypatch):
    from refit.tools.launch import run_local

    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(auth.SECRET_ENV, "a-secret-0123456789 ")
    with pytest.raises(ConfigError, match="surrounding whitespace"):  # not a WorkerError from the children
        run_local(_never_runs, 1, 1, timeout_s=60)


def test_warnings_about_ignored_values_are_rate_limited_across_stores():
    """One forged key per refit: each refit's store (a Peer's) sees it once; the process warns once."""
    import warnings

    secret = b"rate-limit-test-secret-0123456789"
    raw = dist.HashStore()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for v in range(50):  # 50 refits, a store each, a forged vote each
            raw.set(f"run/v{v}.0/ok/1", b"refit1." + b"ab" * 32 + b'.{"version": 1}')
            s = SignedStore(raw, secret)
            assert s.peek(f"run/v{v}.0/ok/1") is None and s.rejected[f"run/v{v}.0/ok/1"] == 1
    lines = [w for w in seen if "without a valid job-secret tag" in str(w.message)]
    assert len(lines) == 1, [str(w.message) for w in lines]
    assert "ignored 1 value(s)" in str(lines[0].message)


def test_a_forged_preflight_record_times_out_naming_what_was_seen():
    from refit.layout import Mesh, ModelLayout, TensorLayout
    from refit.plan import ProcessMap, build_plan
    from refit.transfer import preflight

    one = TensorLayout("w", (4,), torch.float32, Mesh((1,), ("tp",), (0,)), (torch.distributed.tensor.Replicate(),))
    plan = build_plan(ModelLayout((one,), 1), ModelLayout((one,), 1), ProcessMap.disjoint(1, 1))
    s = _store()
    s.raw.set("refit/preflight/1", b"refit1." + b"ab" * 32 + b'.{"error": "forged"}')
    with pytest.raises(PlanError, match=r"process 1 did not publish .*1 value\(s\) with invalid tags .*forged"):
        preflight(plan, 0, s, 0.3)


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
        (work / "port").write_text(_store_ref())
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
        store = _store_access(self.work / "port")
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


# -- a replay from an earlier job, started by hand with a reused secret and no job id -----------------

REPLAY = "replay"
REPLAY_SECRET = "a-secret-reused-across-jobs-0123456789"


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


def _hand_started_worker(world, workdir: str, job: str):
    """A job as torchrun would start it: the same REFIT_SECRET as the job before, no REFIT_JOB_ID.
    Job "a" commits versions 1 and 2; job "b" commits 1, waits while the stranger replays job a's
    version-2 votes and commit record into its store, then its process 2 fails version 2 before voting."""
    from refit import layout_from_spec, parse_spec
    from refit.errors import RefitAborted
    from refit.layout.models import param_shapes
    from refit.plan import ProcessMap
    from refit.tools.verify import holds, reference_shards
    from refit.transfer import Peer

    os.environ.pop("REFIT_JOB_ID", None)
    work = Path(workdir)
    store = world.store
    if world.rank == 0:
        store.raw.set("probe", "x")
        (work / f"{job}-port").write_text(_store_ref())
    shapes = param_shapes("tiny-llama")
    src, dst = layout_from_spec(shapes, parse_spec("tp=1", "src")), layout_from_spec(shapes, parse_spec("tp=2", "dst"))
    is_src = world.src_rank is not None
    rank = world.src_rank if is_src else world.dst_rank
    tensors = reference_shards(src if is_src else dst, rank, seed=1)
    config = TransferConfig(name=REPLAY, commit="staged", deadline_s=60, preflight_timeout_s=60)
    peer = Peer(
        src,
        dst,
        world.rank,
        src_tensors=tensors if is_src else None,
        dst_tensors=None if is_src else {n: torch.zeros_like(t) for n, t in tensors.items()},
        procs=ProcessMap.disjoint(1, 2),
        config=config,
        store=store,
    )
    error = None
    for v in (1, 2):
        if is_src:
            for n, t in reference_shards(src, rank, seed=v).items():
                tensors[n].copy_(t)
        if job == "b" and v == 2:
            _wait_for(work / "replayed")

        def fail(where: str, info: dict) -> None:
            if where == "received":
                raise RuntimeError("injected: process 2 fails version 2 after its bytes arrived, before voting")

        try:
            peer.run(v, fault_hook=fail if job == "b" and v == 2 and world.rank == 2 else None)
        except RefitAborted as e:
            error = str(e)
    if job == "a":
        (work / f"a-done{world.rank}").write_text("1")
        _wait_for(work / "recorded")  # the store (hosted by process 0) stays up while the stranger reads it
    held = None if is_src else [s for s in (1, 2) if holds(peer.live, dst, rank, seed=s)]
    return {"version": peer.version, "held": held, "rejected": sum(peer.store.rejected.values()), "error": error}


class _Recorder(threading.Thread):
    """A stranger who reads job a's store (values are not secret, only tagged), keeps every value of
    its version 2, and writes them into job b's store (on the same port) before job b votes."""

    def __init__(self, work: Path) -> None:
        super().__init__(daemon=True)
        self.work, self.error, self.copied = work, None, 0

    def _connect(self, job: str):
        _wait_for(self.work / f"{job}-port", 180)
        store = _store_access(self.work / f"{job}-port")
        port = store.port
        return store, next(k for k in store.list_keys() if k.endswith("probe"))[: -len("probe")], port

    def run(self) -> None:
        try:
            store, prefix, port_a = self._connect("a")
            for r in range(3):
                _wait_for(self.work / f"a-done{r}")
            recorded = {
                k[len(prefix) :]: store.get(k) for k in store.list_keys() if k.startswith(f"{prefix}{REPLAY}/run/v2.")
            }
            (self.work / "recorded").write_text("1")
            del store
            store, prefix, port_b = self._connect("b")
            assert port_a == port_b, (port_a, port_b)
            for key, raw in recorded.items():
                store.set(prefix + key, raw)
            self.copied = len(recorded)
            (self.work / "replayed").write_text("1")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            (self.work / "recorded").write_text("1")
            (self.work / "replayed").write_text("1")


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_an_earlier_jobs_votes_replayed_into_a_hand_started_job_are_rejected(tmp_path, monkeypatch):
    """Two jobs on one store port, the same secret, no job id: job a's signed version-2 votes and commit
    record, copied into job b's store, must not commit version 2 anywhere in job b (whose process 2
    fails before voting); they are rejected and counted."""
    from refit.tools import launch
    from refit.transport.control import free_port

    monkeypatch.setenv(auth.SECRET_ENV, REPLAY_SECRET)
    monkeypatch.delenv("REFIT_JOB_ID", raising=False)
    port = free_port()
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": port)  # job b's store after job a's
    stranger = _Recorder(tmp_path)
    stranger.start()
    a = launch.run_local(_hand_started_worker, 1, 2, str(tmp_path), "a", backend="gloo", timeout_s=200)
    b = launch.run_local(_hand_started_worker, 1, 2, str(tmp_path), "b", backend="gloo", timeout_s=200)
    stranger.join(timeout=30)
    assert stranger.error is None, stranger.error
    assert stranger.copied >= 4  # three votes and the commit record of job a's version 2
    assert [row["version"] for row in a] == [2, 2, 2] and [row["held"] for row in a[1:]] == [[2], [2]]
    assert all(row["error"] is not None for row in b)  # every process of job b saw the abort
    assert [row["version"] for row in b] == [1, 1, 1]  # version 2 committed nowhere ...
    assert [row["held"] for row in b[1:]] == [[1], [1]]  # ... the live weights are version 1, bit for bit
    assert sum(row["rejected"] for row in b) > 0  # the replayed values were seen and refused
