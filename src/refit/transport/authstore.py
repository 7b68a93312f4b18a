"""The rendezvous store's server and client: a key-value store only the job's processes can reach.

``StoreServer`` listens on the socket it is given (bound by the caller to the address the user chose) and
serves a connection only once it has proved it holds the job's secret for this job's scope: the server
sends a fresh nonce, the client answers with its own nonce and an HMAC over both (under a key derived from
the secret and the scope), the server answers with its own proof, and both derive a per-connection key
from the two nonces. A connection that fails, or does not finish, the handshake within ``HANDSHAKE_S`` is
closed and counted (``refused``); so is one that sends a frame whose MAC, counter, length or op code is
wrong. A recorded handshake does not verify again (the server's nonce is new each time), nor in another
job (the scope is in the key). Every frame after the handshake carries a MAC over its direction, its
counter and its bytes, so a frame injected, replayed, dropped or reordered on the link closes the
connection. Frames are length-prefixed plain bytes (no pickle): every length is checked against its bound
(``MAX_KEY``, ``MAX_VALUE``, ``MAX_ITEMS``, ``MAX_KEYS`` in the store) before anything is allocated.

``AuthStore`` is the client, a ``torch.distributed.Store`` (so ``PrefixStore``, gloo's and NCCL's
rendezvous and ``init_process_group`` use it). Connections are kept (a pool: each call takes one, so a
thread waiting on a key never holds up another thread's call) and every call is bounded: by its own
timeout where it has one (``wait``), else by the store's (``set_timeout``); past it the call raises
``StoreTimeout`` (a ``DistStoreError``) naming the key, the store's address and the seconds, and a lost
store raises ``StoreLost`` (a ``DistNetworkError``). A call never waits on a link that has gone quiet for
longer than its bound.

The process that hosts the store leaves last: at its exit (``atexit``) it first closes its own clients, then
serves on until every other client has said goodbye (closed its connections: ``AuthStore.close``, or its
process ended), at most ``REFIT_STORE_LINGER_S`` (default ``LINGER_S``). So a program whose process 0 finishes
first does not take the store from a process still using it (an engine reading the last refit's outcome);
a client that never closes delays that exit by the bound, and is then named on stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch.distributed as dist

HANDSHAKE_S = 5.0  # a connection that has not proved the secret by then is closed
MAX_PENDING = 64  # connections in their handshake at once; more are closed at once (counted)
MAX_KEY = 4096  # bytes
MAX_VALUE = 64 << 20  # bytes
MAX_ITEMS = 1 << 16  # keys (or values) in one frame
MAX_KEYS = 1 << 22  # keys in the store
MAX_FRAME = MAX_VALUE + 2 * MAX_KEY + 64 * MAX_ITEMS  # a frame's body, bounded before it is read
_HELLO = b"refitKV1"
_NONCE = 32
_MAC = 16  # a frame's MAC: HMAC-SHA256 truncated
_LEN = struct.Struct("!I")
_I64 = struct.Struct("!q")
_CONNECT_RETRY_S = 0.02
LINGER_ENV = "REFIT_STORE_LINGER_S"
LINGER_S = 30.0  # how long the store's host waits at exit, at most, for its clients to say goodbye
LINGER_NOTE_S = 1.0  # a wait longer than this is said on stderr

# op codes (requests) and statuses (replies)
SET, GET, WAIT, CHECK, CAS, ADD, APPEND, DELETE, NUM, LIST = range(1, 11)
OK, TIMEOUT, REFUSED = 0, 1, 2


_LIVE: dict[int, AuthStore] = {}
"""Every open client, until ``close``: torch holds a store (in a ``PrefixStore``, a process group) by its C++
part alone, and a Python store whose object was collected would lose its methods there."""

_SERVING: set[StoreServer] = set()
"""Every server this process hosts, until ``close``: served on at exit until their clients leave (``leave``)."""


class StoreTimeout(dist.DistStoreError):
    """A store call that did not finish within its bound (the key absent, or the store not answering)."""


class StoreLost(dist.DistNetworkError):
    """The store's connection failed: the server is gone, refused this process, or the link broke."""


class ProtocolError(Exception):
    """A frame or handshake that breaks the protocol (the connection is closed)."""


def access_key(secret: bytes, scope: str) -> bytes:
    """The key a connection proves for the job ``scope`` whose secret is ``secret``: derived one way (it
    does not yield the secret, nor the tags and seals made with it), different for every scope."""
    return hmac.digest(secret, b"refit.store.v1\0" + scope.encode(), hashlib.sha256)


def _proof(key: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, label + server_nonce + client_nonce, hashlib.sha256)  # 32 bytes: BLAKE2s's key size


def _b(value: str | bytes | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def pack(items: Sequence[bytes]) -> bytes:
    """``items`` as one body: each a 4-byte length and its bytes."""
    return b"".join(_LEN.pack(len(x)) + x for x in items)


def unpack(body: memoryview) -> list[bytes]:
    """The items ``pack`` made; ``ProtocolError`` on any length past the body's end or past ``MAX_ITEMS``."""
    out, at, end = [], 0, len(body)
    while at < end:
        if at + 4 > end or len(out) >= MAX_ITEMS:
            raise ProtocolError(f"malformed frame: {len(out)} items, {end - at} bytes left")
        (n,) = _LEN.unpack_from(body, at)
        if n > end - at - 4:
            raise ProtocolError(f"item {len(out)} claims {n} bytes, {end - at - 4} remain")
        out.append(bytes(body[at + 4 : at + 4 + n]))
        at += 4 + n
    return out


class Channel:
    """One authenticated connection: frames of ``[length][op or status][items][MAC]`` each way, the MAC
    (keyed BLAKE2s, 16 bytes) over (direction, counter, length, body) under the connection's key. Reads
    go through one buffer: a frame that arrived whole costs one ``recv``."""

    def __init__(self, sock: socket.socket, key: bytes, server: bool) -> None:
        self.sock, self.key = sock, key
        self.buf = bytearray()
        self.out_label, self.in_label = (b"S", b"C") if server else (b"C", b"S")
        self.sent = self.received = 0

    def _mac(self, label: bytes, counter: int, head: bytes, body: bytes | memoryview) -> bytes:
        return hashlib.blake2s(label + _I64.pack(counter) + head + body, key=self.key, digest_size=_MAC).digest()

    def send(self, code: int, items: Sequence[bytes]) -> None:
        body = bytes((code,)) + pack(items)
        head = _LEN.pack(len(body))
        self.sock.sendall(head + body + self._mac(self.out_label, self.sent, head, body))
        self.sent += 1

    def recv(self) -> tuple[int, list[bytes]]:
        self._fill(4)
        head = bytes(self.buf[:4])
        (n,) = _LEN.unpack(head)
        if not 1 <= n <= MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes (at most {MAX_FRAME})")
        self._fill(4 + n + _MAC)
        frame = memoryview(self.buf)[: 4 + n + _MAC]
        body, mac = frame[4 : 4 + n], frame[4 + n :]
        try:
            if not hmac.compare_digest(self._mac(self.in_label, self.received, head, body), mac):
                raise ProtocolError(f"frame {self.received} has an invalid MAC")
            self.received += 1
            code, items = body[0], unpack(body[1:])
        finally:
            frame.release()
            body.release()
            mac.release()
        del self.buf[: 4 + n + _MAC]
        return code, items

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            got = self.sock.recv(max(1 << 16, n - len(self.buf)))
            if not got:
                raise EOFError(f"connection closed after {len(self.buf)} of {n} bytes")
            self.buf += got

    def close(self) -> None:
        for closing in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                closing()
            except OSError:
                pass


def server_handshake(sock: socket.socket, key: bytes) -> Channel:
    """The server's side: ``ProtocolError`` / ``OSError`` unless the peer proves ``key`` (the job's)."""
    nonce = os.urandom(_NONCE)
    sock.sendall(_HELLO + nonce)
    got = _read_exactly(sock, 2 * _NONCE)
    theirs, proof = got[:_NONCE], got[_NONCE:]
    if not hmac.compare_digest(proof, _proof(key, b"client", nonce, theirs)):
        raise ProtocolError("the client's proof does not verify (another secret, another job, or a replay)")
    sock.sendall(_proof(key, b"server", nonce, theirs))
    return Channel(sock, _proof(key, b"session", nonce, theirs), server=True)


def client_handshake(sock: socket.socket, key: bytes) -> Channel:
    hello = _read_exactly(sock, len(_HELLO) + _NONCE)
    if not hello.startswith(_HELLO):
        raise ProtocolError("the peer is not a refit store")
    nonce, mine = hello[len(_HELLO) :], os.urandom(_NONCE)
    sock.sendall(mine + _proof(key, b"client", nonce, mine))
    if not hmac.compare_digest(_read_exactly(sock, 32), _proof(key, b"server", nonce, mine)):
        raise ProtocolError("the store's proof does not verify")
    return Channel(sock, _proof(key, b"session", nonce, mine), server=False)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += got
    return data


def dial(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to ``host:port`` from a source port that is not ``port``. Left to ``connect``, the kernel
    may give a client that retries a port nobody listens on yet (every free port is in the ephemeral range) that
    very port as its source: the socket connects to itself, waits for a greeting from itself, and holds the port
    the store's host is about to bind. Bound first, the source port is known before anything is sent."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    for _ in range(16):
        sock = socket.socket(family, kind, proto)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        if sock.getsockname()[1] != port:
            break
        sock.close()
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


class StoreServer:
    """The store's data and the thread that accepts connections on ``sock`` (bound and listening).

    ``refused`` counts the connections closed before or while serving them, by reason (``handshake``: no
    valid proof in time; ``frame``: a frame that broke the protocol; ``busy``: too many handshakes at once)."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock, self._key = sock, key
        self.address = sock.getsockname()[:2]
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()
        self.refused: Counter[str] = Counter()
        self._pending = 0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._gone = threading.Condition(self._lock)  # notified whenever a connection ends
        self._closed = False
        self._servers: set[threading.Thread] = set()  # one per connection, until it ends
        self._acceptor = threading.Thread(target=self._accept, name=f"refit-store:{self.address[1]}", daemon=True)
        self._acceptor.start()
        _SERVING.add(self)

    def connected(self) -> int:
        """How many connections are open now (clients that have not said goodbye, and handshakes)."""
        with self._lock:
            return len(self._conns)

    def linger(self, seconds: float) -> int:
        """Serve on until every connection has closed (each client closed it, or its process ended) or
        ``seconds`` pass; the number still open. New connections are served meanwhile."""
        end = time.monotonic() + seconds
        with self._gone:
            while self._conns and end - time.monotonic() > 0:
                self._gone.wait(end - time.monotonic())
            return len(self._conns)

    def close(self) -> None:
        """Stop listening (the accepting thread joined) and close every connection (their clients see the store
        lost)."""
        _SERVING.discard(self)
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for s in [self.sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        with self._lock:
            threads = [self._acceptor, *self._servers]
        for t in threads:  # each ends once its socket is closed
            if t is not threading.current_thread():
                t.join(timeout=5.0)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if self._pending >= MAX_PENDING:
                    self.refused["busy"] += 1
                    conn.close()
                    continue
                self._pending += 1
                self._conns.add(conn)
                server = threading.Thread(target=self._serve, args=(conn,), name="refit-store-conn", daemon=True)
                self._servers.add(server)
            server.start()

    def _serve(self, conn: socket.socket) -> None:
        chan = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_S)
            chan = server_handshake(conn, self._key)
        except (OSError, EOFError, ProtocolError):
            self.refused["handshake"] += 1
        finally:
            with self._lock:
                self._pending -= 1
        try:
            if chan is not None:
                conn.settimeout(None)
                self._loop(chan)
        except (OSError, EOFError):
            pass  # the client went away
        except ProtocolError:
            self.refused["frame"] += 1
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._servers.discard(threading.current_thread())
                self._gone.notify_all()
            (chan.close if chan is not None else conn.close)()

    def _loop(self, chan: Channel) -> None:
        while True:
            op, items = chan.recv()
            handler = _HANDLERS.get(op)
            if handler is None:
                raise ProtocolError(f"unknown op {op}")
            code, reply = handler(self, items)
            chan.send(code, reply)

    # -- ops: each takes the request's items, returns (status, reply items) ---------------------------
    def _set(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        _need(len(items) % 2 == 0 and items, "SET takes key, value pairs")
        with self.cond:
            for k, v in zip(items[::2], items[1::2]):
                self._put(k, v)
            self.cond.notify_all()
        return OK, []

    def _put(self, key: bytes, value: bytes) -> None:
        _need(len(key) <= MAX_KEY and len(value) <= MAX_VALUE, f"key of {len(key)} or value of {len(value)} bytes")
        if key not in self.data and len(self.data) >= MAX_KEYS:
            raise ProtocolError(f"the store holds {MAX_KEYS} keys already")
        self.data[key] = value

    def _waited(self, items: list[bytes]) -> list[bytes] | None:
        """Wait (``items``: timeout in ms, then the keys) until every key exists; the missing one if not."""
        _need(len(items) >= 2 and len(items[0]) == 8, "a wait takes a timeout and keys")
        end = time.monotonic() + _I64.unpack(items[0])[0] / 1000
        keys = items[1:]
        with self.cond:
            while True:
                missing = next((k for k in keys if k not in self.data), None)
                left = end - time.monotonic()
                if missing is None or left <= 0:
                    return None if missing is None else [missing]
                self.cond.wait(left)

    def _get(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        missing = self._waited(items)
        if missing is not None:
            return TIMEOUT, missing
        with self.cond:
            got = [self.data.get(k) for k in items[1:]]
        if any(v is None for v in got):  # deleted between the wait and the read
            return TIMEOUT, [items[1 + got.index(None)]]
        return OK, got

    def _wait(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        missing = self._waited(items)
        return (OK, []) if missing is None else (TIMEOUT, missing)

    def _check(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self.cond:
            return OK, [b"\1" if all(k in self.data for k in items) else b"\0"]

    def _cas(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        _need(len(items) == 3, "CAS takes key, expected, desired")
        key, expected, desired = items
        with self.cond:
            cur = self.data.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self._put(key, desired)
                self.cond.notify_all()
                return OK, [desired]
            return OK, [expected if cur is None else cur]

    def _add(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        _need(len(items) == 2 and len(items[1]) == 8, "ADD takes key, amount")
        with self.cond:
            try:
                n = int(self.data.get(items[0], b"0")) + _I64.unpack(items[1])[0]
            except ValueError:
                return REFUSED, [b"the value under the key is not an integer"]
            self._put(items[0], str(n).encode())
            self.cond.notify_all()
        return OK, [_I64.pack(n)]

    def _append(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        _need(len(items) == 2, "APPEND takes key, value")
        with self.cond:
            self._put(items[0], self.data.get(items[0], b"") + items[1])
            self.cond.notify_all()
        return OK, []

    def _delete(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        _need(len(items) == 1, "DELETE takes a key")
        with self.cond:
            return OK, [b"\1" if self.data.pop(items[0], None) is not None else b"\0"]

    def _num(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self.cond:
            return OK, [_I64.pack(len(self.data))]

    def _list(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self.cond:
            if len(self.data) > MAX_ITEMS:
                return REFUSED, [f"{len(self.data)} keys: more than one answer lists ({MAX_ITEMS})".encode()]
            return OK, list(self.data)


def _need(ok: object, what: str) -> None:
    if not ok:
        raise ProtocolError(f"malformed request: {what}")


_HANDLERS = {
    SET: StoreServer._set,
    GET: StoreServer._get,
    WAIT: StoreServer._wait,
    CHECK: StoreServer._check,
    CAS: StoreServer._cas,
    ADD: StoreServer._add,
    APPEND: StoreServer._append,
    DELETE: StoreServer._delete,
    NUM: StoreServer._num,
    LIST: StoreServer._list,
}


class AuthStore(dist.Store):
    """A client of the store at ``host:port`` that proves ``key`` (``access_key`` of the job's secret and
    scope); with ``server``, the store this process hosts (closed with ``close``). ``timeout_s`` bounds
    every call that has no timeout of its own (``set_timeout`` changes it); connecting retries until it
    (the host may start later)."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float, server: StoreServer | None = None) -> None:
        super().__init__()
        self.host, self.port, self.server = host, port, server
        self._key = key
        self._idle: list[Channel] = []
        self._lock = threading.Lock()
        self.set_timeout(timedelta(seconds=timeout_s))
        if server is None:
            self._put_back(self._connect(time.monotonic() + timeout_s, "connect"))  # fail here, naming the address
        _LIVE[id(self)] = self

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Close this client's connections, and the server if this process hosts it."""
        _LIVE.pop(id(self), None)
        with self._lock:
            idle, self._idle = self._idle, []
        for chan in idle:
            chan.close()
        if self.server is not None:
            self.server.close()

    # -- torch.distributed.Store ---------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call(SET, [_b(key), _b(value)], key)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call(SET, [x for k, v in zip(keys, values, strict=True) for x in (_b(k), _b(v))], keys[0] if keys else "")

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str], timeout: timedelta | None = None) -> list[bytes]:
        seconds = _within((timeout or self.timeout).total_seconds())
        return self._call(GET, [_ms(seconds), *map(_b, keys)], ", ".join(keys), seconds)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = _within((timeout or self.timeout).total_seconds())
        self._call(WAIT, [_ms(seconds), *map(_b, keys)], ", ".join(keys), seconds)

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [_b(k) for k in keys], ", ".join(keys))[0] == b"\1"

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call(CAS, [_b(key), _b(expected), _b(desired)], key)[0]

    def add(self, key: str, amount: int) -> int:
        return _I64.unpack(self._call(ADD, [_b(key), _I64.pack(amount)], key)[0])[0]

    def append(self, key: str, value: str | bytes) -> None:
        self._call(APPEND, [_b(key), _b(value)], key)

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [_b(key)], key)[0] == b"\1"

    def num_keys(self) -> int:
        return _I64.unpack(self._call(NUM, [], "")[0])[0]

    def list_keys(self) -> list[str]:
        return [k.decode(errors="replace") for k in self._call(LIST, [], "")]

    deleteKey = delete_key  # noqa: N815 - the names torch's C++ side calls
    getNumKeys = num_keys  # noqa: N815

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> AuthStore:
        """Another client of the same store (the same secret, scope and timeout), not hosting it."""
        other = AuthStore.__new__(AuthStore)
        dist.Store.__init__(other)
        other.host, other.port, other.server, other._key = self.host, self.port, None, self._key
        other._idle, other._lock = [], threading.Lock()
        other.set_timeout(self.timeout)
        _LIVE[id(other)] = other
        return other

    # -- the wire ------------------------------------------------------------------------------------
    def _call(self, op: int, items: list[bytes], key: str, wait_s: float = 0.0) -> list[bytes]:
        """One request and its reply within the bound: ``wait_s`` for a wait (the server answers by then),
        else the store's timeout. ``StoreTimeout`` / ``StoreLost`` name the key, the address, the seconds.
        The process that hosts the store calls its server directly (no socket, no thread hop)."""
        bound = wait_s if op in (GET, WAIT) else _within(self.timeout.total_seconds())
        if self.server is not None:
            try:
                code, reply = _HANDLERS[op](self.server, items)
            except ProtocolError as e:
                raise dist.DistStoreError(f"refit store {self.where}: refused the request on {key!r}: {e}") from None
        else:
            code, reply = self._remote(op, items, key, bound)
        if code == TIMEOUT:
            raise StoreTimeout(
                f"refit store {self.where}: no key {reply[0].decode(errors='replace')!r} within {bound:.1f}s"
            )
        if code != OK:
            raise dist.DistStoreError(f"refit store {self.where}: refused the request on {key!r}: {reply[0].decode()}")
        return reply

    def _remote(self, op: int, items: list[bytes], key: str, bound: float) -> tuple[int, list[bytes]]:
        deadline = time.monotonic() + bound
        chan = self._take(deadline, key)
        try:
            chan.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            chan.send(op, items)
            got = chan.recv()
        except TimeoutError:
            chan.close()
            raise StoreTimeout(f"refit store {self.where}: no answer for {key!r} within {bound:.1f}s") from None
        except (OSError, EOFError, ProtocolError) as e:
            chan.close()
            raise StoreLost(f"refit store {self.where}: the connection failed during {key!r}: {e}") from None
        self._put_back(chan)
        return got

    def _take(self, deadline: float, key: str) -> Channel:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect(deadline, key)

    def _put_back(self, chan: Channel) -> None:
        with self._lock:
            self._idle.append(chan)

    def _connect(self, deadline: float, key: str) -> Channel:
        """A new authenticated connection; retries a refused connect (the host not up yet) until ``deadline``."""
        while True:
            left = deadline - time.monotonic()
            try:
                sock = dial(self.host, self.port, max(left, 1e-3))
            except (ConnectionRefusedError, TimeoutError) as e:
                if time.monotonic() + _CONNECT_RETRY_S >= deadline:
                    raise StoreTimeout(f"refit store {self.where}: cannot connect for {key!r}: {e}") from None
                time.sleep(_CONNECT_RETRY_S)
                continue
            except OSError as e:
                raise StoreLost(f"refit store {self.where}: cannot connect for {key!r}: {e.strerror or e}") from None
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(bound := min(max(left, 1e-3), HANDSHAKE_S))
                return client_handshake(sock, self._key)
            except TimeoutError:  # no answer in time (a loaded store, or a bound of milliseconds): not a refusal
                sock.close()
                raise StoreTimeout(f"refit store {self.where}: no handshake reply for {key!r}, {bound:.2g}s") from None
            except (OSError, EOFError, ProtocolError) as e:
                sock.close()
                raise StoreLost(
                    f"refit store {self.where}: the store refused this process ({e}): it holds another job "
                    "secret or job id (REFIT_SECRET / REFIT_JOB_ID), or is not a refit store"
                ) from None


_BOUND = threading.local()
AFTER_DEADLINE_S = 1.0  # a call made at or after the deadline (publishing an abort) still gets this long


@contextlib.contextmanager
def calls_within(deadline: float) -> Iterator[None]:
    """Bound every store call this thread makes inside the block by ``deadline`` (``time.monotonic()``), and
    one made after it by ``AFTER_DEADLINE_S``: a process cut off from the store's host ends with
    ``StoreTimeout`` at its refit's deadline instead of at the store's timeout. Blocks nest (the inner
    deadline holds inside it)."""
    outer = getattr(_BOUND, "deadline", None)
    _BOUND.deadline = deadline
    try:
        yield
    finally:
        _BOUND.deadline = outer


def _within(seconds: float) -> float:
    """``seconds``, cut to what ``calls_within`` leaves this thread (at least ``AFTER_DEADLINE_S``)."""
    deadline = getattr(_BOUND, "deadline", None)
    if deadline is None:
        return seconds
    return min(seconds, max(deadline - time.monotonic(), AFTER_DEADLINE_S))


def _ms(seconds: float) -> bytes:
    """A wait of ``seconds`` as the server's timeout: a little shorter (a tenth, at most 10 ms), so that its
    answer arrives within the client's bound on a live link."""
    return _I64.pack(max(1, int(seconds * 1000 - min(10.0, seconds * 100))))


def linger_seconds() -> float:
    """``REFIT_STORE_LINGER_S`` (seconds, >= 0), else ``LINGER_S``; ``ValueError`` naming it if malformed."""
    raw = os.environ.get(LINGER_ENV, "").strip()
    if not raw:
        return LINGER_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{LINGER_ENV} must be a number of seconds >= 0, got {raw!r}")
    return seconds


def leave() -> None:
    """What this process does at exit (``atexit``; call it before ``os._exit``): its own clients close (it is
    leaving), then each server it hosts serves on until its other clients have said goodbye, at most
    ``linger_seconds()``; a wait past ``LINGER_NOTE_S`` and the clients left behind are said on stderr."""
    for client in list(_LIVE.values()):
        if client.server is None:
            client.close()
    servers = list(_SERVING)
    if not servers:
        return
    bound = linger_seconds()
    for server in servers:
        where = f"{server.address[0]}:{server.address[1]}"
        left = server.linger(min(LINGER_NOTE_S, bound))
        if left and bound > LINGER_NOTE_S:
            print(
                f"refit: this process hosts the job's store ({where}) and is leaving: waiting for {left} client(s)"
                f" still connected, at most {bound - LINGER_NOTE_S:.0f}s more ({LINGER_ENV})",
                file=sys.stderr,
                flush=True,
            )
            left = server.linger(bound - LINGER_NOTE_S)
        if left:
            print(
                f"refit: the job's store ({where}) leaves with its host with {left} client(s) still connected after"
                f" {bound:.0f}s ({LINGER_ENV}): their next call fails (StoreLost)",
                file=sys.stderr,
                flush=True,
            )


atexit.register(leave)


def host(sock: socket.socket, key: bytes, timeout_s: float) -> AuthStore:
    """Serve the store on ``sock`` (bound, listening) to connections that prove ``key``; a client of it."""
    server = StoreServer(sock, key)
    address, port = server.address
    return AuthStore(address, port, key, timeout_s, server=server)
