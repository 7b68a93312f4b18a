"""The rendezvous store, bound where told, and the signed plain-data values refit keeps in it.

``open_store(address, port, ...)`` hosts (or joins) torch's ``TCPStore`` with its
listener bound to ``address`` only (torch's own listener takes every interface, so
the socket is made and bound here and handed over); ``bind_address()`` is the
address the user chose (``REFIT_BIND_ADDRESS``, default loopback) and
``pin_interfaces(address)`` makes gloo and NCCL listen on that address's interface.

``SignedStore`` wraps a store with the job's secret (``refit.transport.auth``).
Every value is JSON, written as ``refit1.<hex tag>.<payload>``; a reader acts on a
value only if its tag is valid for that key, and otherwise ignores it (counted in
``rejected``, warned once per key) as if the key were absent. Nothing read is ever
unpickled or evaluated. ``put_sealed`` / ``get_sealed`` encrypt a payload that
grants access (CUDA IPC handles). A stranger who can reach the store can still
overwrite or delete keys (the store has no access control): that can delay a
refit until its deadline, never steer it.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit.errors import ConfigError
from refit.transport import auth

BIND_ENV = "REFIT_BIND_ADDRESS"
LOOPBACK = "127.0.0.1"
_MAGIC = b"refit1."
_POLL_S = 0.002


def bind_address(address: str | None = None) -> str:
    """The address refit's listeners bind to: ``address`` if given, else ``REFIT_BIND_ADDRESS``, else
    loopback (one host). Never every interface: ``0.0.0.0`` / ``::`` must be asked for by name."""
    return address or os.environ.get(BIND_ENV) or LOOPBACK


def interface_of(address: str) -> str:
    """The network interface that holds ``address`` (``lo`` for loopback); ``ConfigError`` if none does."""
    if address in ("127.0.0.1", "localhost", "::1"):
        return "lo"
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    raise ConfigError(f"{BIND_ENV}={address!r} is not an address of any interface of this host")


def pin_interfaces(address: str) -> None:
    """Make gloo and NCCL (bootstrap and sockets) listen on ``address``'s interface only, unless the user
    chose interfaces already (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``). Call before any group."""
    if address in ("0.0.0.0", "::"):
        return
    name = interface_of(address)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def _listener(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {address}:{port}: {e.strerror or e}") from None
    sock.listen(1024)
    return sock


def open_store(address: str, port: int, world_size: int | None, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Host (``is_master``) or join the TCP store at ``address:port``; the host's listener is bound to
    ``address`` alone (``port`` 0: any free port, read back from ``store.port``)."""
    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(address, port, world_size, False, timeout=timeout)
    sock = _listener(address, port)
    fd = sock.detach()  # the store owns the listening socket from here on
    return dist.TCPStore(
        address, sock_port(fd), world_size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
    )


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float, address: str) -> dist.ProcessGroup:
    """A standalone gloo group whose listeners bind to ``address`` (not the host name's address)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, opts)


def sock_port(fd: int) -> int:
    """The port of a bound socket given by its file descriptor."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        return s.getsockname()[1]
    finally:
        s.close()


class SignedStore:
    """A store whose values carry the job secret's tag; readers act only on values whose tag is valid.

    Values are JSON-able plain data (``put``/``get``/``peek``/``first``); ``raw`` is the wrapped
    store (for torch's own rendezvous, e.g. a process group). Every process of a job wraps the
    same store with the same secret. Reads that wait take an explicit timeout (never the store's
    global one) and raise ``TimeoutError`` naming the key. ``rejected`` counts, per key, the
    distinct invalid values seen (forged, corrupt, or from another job).
    """

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        self.raw = store
        self._secret = secret
        self.rejected: Counter[str] = Counter()
        self._bad: dict[str, bytes] = {}

    # -- encoding ---------------------------------------------------------------------------
    def _encode(self, key: str, value: Any) -> bytes:
        payload = json.dumps(value, separators=(",", ":")).encode()
        return _MAGIC + auth.tag(self._secret, key, payload).hex().encode() + b"." + payload

    def _decode(self, key: str, raw: bytes) -> tuple[bool, Any]:
        """(True, value) for a validly tagged JSON value of ``key``; (False, None) otherwise (counted)."""
        if raw.startswith(_MAGIC) and len(raw) > len(_MAGIC) + 2 * auth.TAG_BYTES:
            head, payload = raw[len(_MAGIC) : len(_MAGIC) + 2 * auth.TAG_BYTES], raw[len(_MAGIC) + 2 * auth.TAG_BYTES :]
            try:
                mac = bytes.fromhex(head.decode())
            except ValueError:
                mac = b""
            if payload[:1] == b"." and auth.verify(self._secret, key, payload[1:], mac):
                return True, json.loads(payload[1:])
        self._reject(key, raw)
        return False, None

    def _reject(self, key: str, raw: bytes) -> None:
        if self._bad.get(key) == raw:
            return
        self._bad[key] = raw
        self.rejected[key] += 1
        if self.rejected[key] == 1:
            warnings.warn(
                f"refit: ignored a value under {key!r} without a valid job-secret tag "
                f"({len(raw)} bytes): another process on the network wrote it",
                stacklevel=3,
            )

    # -- plain values -----------------------------------------------------------------------
    def put(self, key: str, value: Any) -> None:
        """Write ``value`` (JSON-able) under ``key``, tagged."""
        self.raw.set(key, self._encode(key, value))

    def peek(self, key: str) -> Any:
        """The valid value under ``key`` now, or None (absent, or not validly tagged)."""
        if not self.raw.check([key]):
            return None
        ok, value = self._decode(key, self.raw.get(key))
        return value if ok else None

    def has(self, key: str) -> bool:
        """Whether a validly tagged value is under ``key`` now."""
        return self.peek(key) is not None

    def get(self, key: str, timeout_s: float) -> Any:
        """The valid value under ``key``, waiting up to ``timeout_s`` for one; ``TimeoutError`` naming the key."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no valid value under {key!r} within {timeout_s:.0f}s")
            try:
                self.raw.wait([key], timedelta(seconds=left))
            except (RuntimeError, OSError) as e:
                if time.monotonic() < deadline:
                    raise
                raise TimeoutError(f"no valid value under {key!r} within {timeout_s:.0f}s") from e
            ok, value = self._decode(key, self.raw.get(key))
            if ok:
                return value
            time.sleep(_POLL_S)

    def get_all(self, keys: Iterable[str]) -> dict[str, Any]:
        """The keys of ``keys`` that hold a valid value now, with their values (one round trip)."""
        keys = list(keys)
        present = [k for k in keys if self.raw.check([k])]
        if not present:
            return {}
        values = self.raw.multi_get(present)
        out = {}
        for k, raw in zip(present, values):
            ok, value = self._decode(k, bytes(raw))
            if ok:
                out[k] = value
        return out

    def first(self, key: str, value: Any) -> Any:
        """Write ``value`` under ``key`` unless a valid value is there already; return the one that stands.
        An invalid value in the way is displaced (compare-and-set), so a forgery cannot block the first
        real writer."""
        mine = self._encode(key, value)
        expected = b""
        while True:
            cur = bytes(self.raw.compare_set(key, expected, mine))
            if cur == mine:
                return value
            ok, theirs = self._decode(key, cur)
            if ok:
                return theirs
            expected = cur

    # -- sealed values (grant access: IPC handles) -------------------------------------------
    def put_sealed(self, key: str, plaintext: bytes) -> None:
        """Write ``plaintext`` encrypted and tagged under ``key``: useless to whoever lacks the secret."""
        self.put(key, {"sealed": base64.b64encode(auth.seal(self._secret, key, plaintext)).decode()})

    def get_sealed(self, key: str, timeout_s: float) -> bytes:
        """The plaintext ``put_sealed`` wrote under ``key`` (waits like ``get``)."""
        value = self.get(key, timeout_s)
        blob = value.get("sealed") if isinstance(value, dict) else None
        plain = auth.unseal(self._secret, key, base64.b64decode(blob)) if isinstance(blob, str) else None
        if plain is None:
            raise ConfigError(f"the value under {key!r} is not sealed with this job's secret")
        return plain


def signed(store: dist.Store | SignedStore | None, secret: bytes | None = None) -> SignedStore | None:
    """``store`` as a ``SignedStore`` (with ``secret``, else the job's: ``auth.job_secret()``); None stays None."""
    if store is None or isinstance(store, SignedStore):
        return store
    return SignedStore(store, secret if secret is not None else auth.job_secret())
