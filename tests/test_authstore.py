"""The job's store (``refit.transport.authstore``): correct ops, bounded calls, and every connection that does
not prove the job's secret for the job's scope refused while the server goes on serving the job."""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from refit.transport import authstore
from refit.transport.authstore import AuthStore, StoreLost, StoreTimeout
from refit.transport.store import SignedStore, gloo_group, open_store

SECRET = b"s3cret-of-this-job-0123456789abcdef"
SCOPE = "job-1"


@pytest.fixture(scope="module")
def hosted():
    store = open_store("127.0.0.1", 0, None, True, 30.0, secret=SECRET, scope=SCOPE)
    yield store
    store.close()


def _client(hosted: AuthStore, timeout_s: float = 30.0, secret: bytes = SECRET, scope: str = SCOPE) -> AuthStore:
    return open_store("127.0.0.1", hosted.port, None, False, timeout_s, secret=secret, scope=scope)


def _raw(hosted: AuthStore) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", hosted.port), timeout=10)
    return s


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset; waits up to the socket's timeout)."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    sock.close()
    return True


def test_ops_through_a_prefix_store_match_torchs_store_semantics(hosted):
    c = dist.PrefixStore("ops", _client(hosted))
    c.set("a", b"1")
    assert c.get("a") == b"1" and hosted.get("ops/a") == b"1"  # another client of the same data
    assert c.compare_set("a", b"1", b"2") == b"2" and c.get("a") == b"2"
    assert c.compare_set("a", b"1", b"3") == b"2"  # expected differs: what stands, unchanged
    assert c.compare_set("new", b"", b"x") == b"x"  # absent and expected empty: written
    assert c.compare_set("absent", b"e", b"x") == b"e" and not c.check(["absent"])
    assert c.add("n", 3) == 3 and c.add("n", -1) == 2 and c.get("n") == b"2"
    assert c.check(["a", "n"]) and not c.check(["a", "zz"])
    c.wait(["a", "n"], timedelta(seconds=1))
    c.append("a", b"+")
    assert c.multi_get(["a", "new"]) == [b"2+", b"x"]
    c.multi_set(["m1", "m2"], [b"v1", b""])
    assert c.get("m2") == b"" and c.delete_key("m1") and not c.delete_key("m1")
    assert hosted.num_keys() >= 4
    twin = hosted.clone()  # torch clones a store for some groups: a client of the same data, not hosting
    assert twin.server is None and twin.get("ops/new") == b"x" and "ops/new" in twin.list_keys()
    big = os.urandom(1 << 20)
    c.set("big", big)
    assert c.get("big") == big


def test_a_wait_wakes_when_another_client_writes_and_a_timeout_names_key_address_and_seconds(hosted):
    waiter, writer = _client(hosted), _client(hosted)
    done = threading.Event()

    def wait() -> None:
        waiter.wait(["late"], timedelta(seconds=20))
        done.set()

    t = threading.Thread(target=wait)
    t.start()
    writer.set("late", b"1")
    t.join(20)
    assert done.is_set()
    with pytest.raises(StoreTimeout, match=rf"'absent'.*127\.0\.0\.1:{hosted.port}|{hosted.port}.*'absent'") as e:
        waiter.wait(["absent"], timedelta(milliseconds=50))
    assert isinstance(e.value, dist.DistStoreError) and "0.1s" in str(e.value)
    short = _client(hosted, timeout_s=0.05)  # get has no timeout of its own: the store's bounds it
    with pytest.raises(StoreTimeout, match="'absent-too'"):
        short.get("absent-too")
    signed = SignedStore(dist.PrefixStore("signed", short), SECRET)
    with pytest.raises(TimeoutError, match="'absent'"):
        signed.get("absent", 0.05)
    signed.put("k", {"v": 1})
    assert signed.get("k", 1.0) == {"v": 1}


def test_wait_values_reads_the_keys_once_they_all_exist_and_a_forged_value_reads_as_none(hosted, monkeypatch):
    direct = _client(hosted)

    def no_wait(*_a, **_k):
        raise AssertionError("an AuthStore waits inside its read: no separate wait")

    monkeypatch.setattr(direct, "wait", no_wait)
    for raw in (direct, dist.PrefixStore("wv", _client(hosted))):  # one GET that waits; else wait, then read
        store = SignedStore(raw, SECRET)
        keys = [f"wv/{type(raw).__name__}/{k}" for k in ("a", "b")]
        assert store.wait_values(keys, 0.05) is None  # nothing there: None once the wait is over
        store.put(keys[0], 1)
        assert store.wait_values(keys, 0.05) is None  # one still missing
        raw.set(keys[1], b"refit1." + b"ab" * 32 + b".2")  # a stranger's value: read, as None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert store.wait_values(keys, 0.05) == {keys[0]: 1, keys[1]: None} and store.rejected[keys[1]] == 1
        later = threading.Timer(0.05, store.put, (keys[1] + "-late", {"v": 2}))  # written during the wait
        later.start()
        assert store.wait_values([keys[0], keys[1] + "-late"], 5.0) == {keys[0]: 1, keys[1] + "-late": {"v": 2}}
        later.join()


def test_a_process_without_the_jobs_secret_or_scope_is_refused_and_the_job_goes_on(hosted):
    before = hosted.server.refused["handshake"]
    with pytest.raises(StoreLost, match="refused this process"):
        _client(hosted, secret=b"another-secret-0123456789abcdef")
    with pytest.raises(StoreLost, match="refused this process"):
        _client(hosted, scope="another-job")  # the same secret, another job id
    junk = _raw(hosted)
    junk.recv(64)
    junk.sendall(os.urandom(64))
    assert _closed(junk)
    assert hosted.server.refused["handshake"] == before + 3
    c = _client(hosted)
    c.set("still", b"served")
    assert hosted.get("still") == b"served"


def test_a_client_retrying_a_port_nobody_listens_on_never_connects_to_itself(monkeypatch):
    """TCP self-connect: a client retrying a port nobody listens on yet (every free port is in the ephemeral
    range) can be given that very port as its source and connect to itself, then wait for a greeting from
    itself and hold the port its host is about to bind. Here the kernel's first choice of a source port is made
    to be the store's port, both where a socket binds port 0 and where connect picks the port itself."""
    from refit.transport.control import free_port

    port, bind, connect, chosen = free_port(), socket.socket.bind, socket.socket.connect, []

    def bind_first_to_the_port(sock, address):
        if address[1] == 0 and not chosen:
            chosen.append("bind")
            address = (address[0], port)
        return bind(sock, address)

    def connect_first_from_the_port(sock, address):
        if sock.getsockname()[1] == 0 and not chosen:
            chosen.append("connect")
            bind(sock, ("127.0.0.1", port))
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "bind", bind_first_to_the_port)
    monkeypatch.setattr(socket.socket, "connect", connect_first_from_the_port)
    host: list[AuthStore] = []
    start = threading.Timer(
        0.5, lambda: host.append(open_store("127.0.0.1", port, None, True, 30.0, secret=SECRET, scope=SCOPE))
    )
    start.start()
    try:
        client = open_store("127.0.0.1", port, None, False, 20.0, secret=SECRET, scope=SCOPE)
        client.set("after", b"the host bound its port")
        start.join()
        assert chosen and host[0].get("after") == b"the host bound its port"
    finally:
        start.join()
        for store in host:
            store.close()


def test_a_recorded_handshake_or_frame_does_not_verify_on_another_connection(hosted):
    key = authstore.access_key(SECRET, SCOPE)
    s1 = _raw(hosted)
    hello = s1.recv(len(authstore._HELLO) + authstore._NONCE)
    mine = os.urandom(authstore._NONCE)
    answer = mine + authstore._proof(key, b"client", hello[len(authstore._HELLO) :], mine)
    s1.sendall(answer)
    chan = authstore.Channel(s1, authstore._proof(key, b"session", hello[len(authstore._HELLO) :], mine), False)
    assert s1.recv(32)  # the server's proof: this transcript was valid once
    frame = _framed(chan, authstore.SET, [b"replayed", b"x"])
    s1.sendall(frame)
    assert chan.recv() == (authstore.OK, [])
    before = dict(hosted.server.refused)
    s2 = _raw(hosted)
    s2.recv(64)
    s2.sendall(answer)  # the same bytes against a fresh server nonce
    assert _closed(s2)
    s1.sendall(frame)  # the same frame again on its own connection: the counter has moved on
    assert _closed(s1)
    assert hosted.server.refused["handshake"] == before.get("handshake", 0) + 1
    assert hosted.server.refused["frame"] == before.get("frame", 0) + 1


def _framed(chan: authstore.Channel, op: int, items: list[bytes]) -> bytes:
    """The bytes ``chan.send`` would write (captured through a socket pair)."""
    a, b = socket.socketpair()
    real, chan.sock = chan.sock, a
    try:
        chan.send(op, items)
        return b.recv(1 << 20)
    finally:
        chan.sock = real
        chan.sent -= 1  # sent again by the caller, under the same counter
        a.close()
        b.close()


def test_garbage_oversized_and_unknown_frames_close_the_connection_without_allocating(hosted):
    c = _client(hosted)
    before = hosted.server.refused["frame"]
    chan = c._take(time.monotonic() + 10, "")
    chan.sock.sendall(authstore._LEN.pack(authstore.MAX_FRAME + 1))  # a length past the bound: closed at once
    assert _closed(chan.sock)
    chan = c._connect(time.monotonic() + 10, "")
    chan.send(99, [b"x"])  # a valid MAC, an op that does not exist
    assert _closed(chan.sock)
    chan = c._connect(time.monotonic() + 10, "")
    chan.sock.sendall(authstore._LEN.pack(40) + os.urandom(40 + authstore._MAC))  # a frame without a valid MAC
    assert _closed(chan.sock)
    chan = c._connect(time.monotonic() + 10, "")
    chan.send(authstore.SET, [b"k" * (authstore.MAX_KEY + 1), b"v"])  # a key past its bound
    assert _closed(chan.sock)
    assert hosted.server.refused["frame"] == before + 4
    c.set("after", b"1")  # a fresh connection of the same client: served
    assert c.get("after") == b"1"


def test_a_connection_silent_past_the_handshake_bound_is_closed(hosted, monkeypatch):
    monkeypatch.setattr(authstore, "HANDSHAKE_S", 0.05)
    before = hosted.server.refused["handshake"]
    silent = _raw(hosted)
    assert _closed(silent)
    assert hosted.server.refused["handshake"] == before + 1


def test_a_gloo_group_forms_over_the_store_and_a_lost_store_is_an_error_naming_it(hosted):
    out: dict[int, torch.Tensor] = {}

    def member(rank: int, store: AuthStore) -> None:
        group = gloo_group(dist.PrefixStore("pg", store), rank, 2, 30.0, "127.0.0.1")
        x = torch.full((4,), float(rank + 1))
        group.allreduce([x]).wait()
        out[rank] = x

    threads = [threading.Thread(target=member, args=(r, s)) for r, s in ((0, hosted), (1, _client(hosted)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [out[r].tolist() for r in (0, 1)] == [[3.0] * 4] * 2
    lone = open_store("127.0.0.1", 0, None, True, 5.0, secret=SECRET, scope=SCOPE)
    joined = _client(lone)
    lone.close()
    with pytest.raises(StoreLost, match=rf"127\.0\.0\.1:{lone.port}.*'gone'"):
        joined.set("gone", b"1")


def test_calls_inside_a_refits_deadline_end_by_it_not_by_the_stores_timeout(hosted, monkeypatch):
    monkeypatch.setattr(authstore, "AFTER_DEADLINE_S", 0.05)
    c = _client(hosted)  # the store's own bound: 30 s
    with authstore.calls_within(time.monotonic() - 1.0):  # past the deadline: publishing an abort, say
        with pytest.raises(StoreTimeout, match=r"'never' within 0\.1s"):
            c.wait(["never"], timedelta(seconds=20))
        with pytest.raises(StoreTimeout, match="'never-either'"):
            c.get("never-either")
        c.set("still", b"answered")  # a live store answers well inside the bound
    with pytest.raises(StoreTimeout, match=r"within 0\.1s"):  # outside the block: the wait's own timeout
        c.wait(["never"], timedelta(milliseconds=60))
