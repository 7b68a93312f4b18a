"""The rendezvous store, bound where told, and the signed plain-data values refit keeps in it.

``open_store(address, port, ..., secret=, scope=)`` hosts (or joins) the job's store
(``refit.transport.authstore``): a key-value server that serves only connections proving the job's
secret for the job's scope (a challenge-response handshake, then a MAC on every frame), its listener
bound to ``address`` only, every call bounded in time (an error naming the key, the address and the
seconds). ``bind_address()`` is the address the user chose (``REFIT_BIND_ADDRESS``, default loopback) and
``pin_interfaces(address)`` makes gloo and NCCL listen on that address's interface. When this
module is imported (``import refit``) with ``REFIT_BIND_ADDRESS`` set to an address of this host,
it pins them already (``pin_from_env``), so a default group made afterwards by hand or by torchrun
connects across hosts (torch's gloo would otherwise take the host name's address, often 127.0.0.1).

``SignedStore`` wraps a store with the job's secret (``refit.transport.auth``).
Every value is JSON, written as ``refit1.<hex tag>.<payload>``; a reader acts on a
value only if its tag is valid for that key, and otherwise ignores it as if the key were
absent (counted in ``rejected``; warnings rate-limited to one line per interval, with the count). Nothing read is ever
unpickled or evaluated. ``put_sealed`` / ``get_sealed`` encrypt a payload that
grants access (CUDA IPC handles). The tags are a second line behind the store's handshake: they keep a
process that can write into the store (one holding the secret in another job or session) from steering
this one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import socket
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit.errors import ConfigError
from refit.transport import auth, authstore
from refit.transport.authstore import AuthStore

BIND_ENV = "REFIT_BIND_ADDRESS"
JOB_ENV = "REFIT_JOB_ID"  # a per-job scope bound into every tag (replays between jobs fail)
LOOPBACK = "127.0.0.1"
_MAGIC = b"refit1."
_POLL_S = 0.002
WARN_INTERVAL_S = 60.0  # at most one warning about ignored values per interval per job store


def _wait_span(seconds: float) -> timedelta:
    """A store wait of ``seconds``, rounded up to whole milliseconds and at least one: c10d stores take
    milliseconds, and 0 means no timeout at all (a wait with 0.4 ms left would never end)."""
    return timedelta(milliseconds=max(1, math.ceil(seconds * 1000)))


_ABSENT = b"\0refit-absent\0"  # never written: compare_set(key, _ABSENT, _ABSENT) is a non-blocking read


def bind_address(address: str | None = None) -> str:
    """The address refit's listeners bind to: ``address`` if given, else ``REFIT_BIND_ADDRESS``, else
    loopback (one host). Never every interface: ``0.0.0.0`` / ``::`` must be asked for by name."""
    return address or os.environ.get(BIND_ENV) or LOOPBACK


def interface_of(address: str) -> str:
    """The network interface that holds ``address`` (``lo`` for loopback); ``ConfigError`` if none does."""
    if address.startswith("127.") or address in ("localhost", "::1"):
        return "lo"
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    raise ConfigError(f"{BIND_ENV}={address!r} is not an address of any interface of this host")


def local_address_for(peer_host: str, port: int = 9) -> str:
    """This host's address on the route to ``peer_host`` (loopback for a loopback peer): what a listener
    that peer must reach binds to. Asks the kernel's routing table (a UDP socket connected, nothing sent)."""
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, port))
        except OSError as e:
            raise ConfigError(f"no route from this host to {peer_host!r}: {e.strerror or e}") from None
        return s.getsockname()[0]


def pin_interfaces(address: str) -> None:
    """Make gloo and NCCL (bootstrap and sockets) listen on ``address``'s interface only, unless the user
    chose interfaces already (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``). Call before any group."""
    if address in ("0.0.0.0", "::"):
        return
    name = interface_of(address)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", f"={name}")  # "=": this interface exactly, not a prefix


def pin_from_env() -> str | None:
    """``pin_interfaces(REFIT_BIND_ADDRESS)`` where that is set to a non-loopback address of this host
    (called when this module is imported); returns the interface pinned, or None. An address no interface
    holds pins nothing and warns (refit's own listeners then fail on it, naming it)."""
    address = os.environ.get(BIND_ENV)
    if not address or address in ("0.0.0.0", "::"):
        return None
    try:
        if interface_of(address) == "lo":
            return None  # one host: nothing to find
        pin_interfaces(address)
    except ConfigError as e:
        warnings.warn(f"refit: gloo and NCCL not pinned to an interface: {e}", stacklevel=2)
        return None
    return os.environ.get("GLOO_SOCKET_IFNAME")


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


def open_store(
    address: str,
    port: int,
    world_size: int | None,
    is_master: bool,
    timeout_s: float,
    *,
    secret: bytes | None = None,
    scope: str | None = None,
) -> AuthStore:
    """Host (``is_master``) or join the job's store at ``address:port``: ``refit.transport.authstore``, which
    serves only connections that prove the job's ``secret`` (default ``auth.job_secret()``) for ``scope``
    (default ``REFIT_JOB_ID``). The host's listener is bound to ``address`` alone (``port`` 0: any free port,
    read back from ``store.port``). ``timeout_s`` bounds every store call without a timeout of its own;
    ``world_size`` is not needed (any process holding the secret may join)."""
    del world_size
    secret = auth.job_secret() if secret is None else secret
    scope = os.environ.get(JOB_ENV, "") if scope is None else scope
    key = authstore.access_key(secret, scope)
    if not is_master:
        return AuthStore(address, port, key, timeout_s)
    return authstore.host(_listener(address, port), key, timeout_s)


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float, address: str) -> dist.ProcessGroup:
    """A standalone gloo group whose listeners bind to ``address`` (not the host name's address)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = _wait_span(timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, opts)


class Rejections:
    """Invalid values seen under each key (``counts``: distinct values, forged, corrupt, replayed from
    another job or session). Warnings are rate-limited per process and job secret, across every store
    of it (one per Peer): at most one per ``WARN_INTERVAL_S``, naming how many values were ignored since
    the last one, so one forged key per refit does not log a line per refit per process."""

    _lock = threading.Lock()
    _clock: dict[bytes, tuple[float, int]] = {}  # per job (the secret's digest): last warning, ignored since

    def __init__(self, job: bytes = b"") -> None:
        self.counts: Counter[str] = Counter()
        self._last: dict[str, bytes] = {}
        self._job = job

    def add(self, key: str, raw: bytes) -> None:
        """Count ``raw`` under ``key`` unless it is the value seen there last; warn if the interval passed."""
        if self._last.get(key) == raw[:256]:
            return
        self._last[key] = raw[:256]
        self.counts[key] += 1
        now = time.monotonic()
        with Rejections._lock:
            at, pending = Rejections._clock.get(self._job, (-math.inf, 0))
            if now - at < WARN_INTERVAL_S:
                Rejections._clock[self._job] = (at, pending + 1)
                return
            Rejections._clock[self._job] = (now, 0)
        warnings.warn(
            f"refit: ignored {pending + 1} value(s) without a valid job-secret tag (the latest under {key!r}, "
            f"{len(raw)} bytes): written by another process on the network, replayed from another job or "
            f"session, or by a process holding another secret; next such warning in {WARN_INTERVAL_S:.0f}s "
            "at the earliest",
            stacklevel=4,
        )


class SignedStore:
    """A store whose values carry the job secret's tag; readers act only on values whose tag is valid.

    Values are JSON-able plain data (``put``/``get``/``peek``/``get_all``/``first``); ``raw`` is the
    wrapped store (for torch's own rendezvous, e.g. a process group). Every process of a job wraps the
    same store with the same secret and ``scope``; the tag covers scope, key and payload, so a value
    cannot be replayed under another key, nor into another job whose scope differs (refit's launchers
    give every job a fresh scope: ``REFIT_JOB_ID``). ``scoped(extra)`` narrows the scope further: a
    ``Peer`` binds its aborts, votes and commit records to nonces every member drew at pre-flight
    (``refit.transfer.preflight``), so even a job started by hand with a reused secret and no job id
    gets a scope no earlier job used. Reads that wait take an explicit timeout (never the store's
    global one) and raise ``TimeoutError`` naming the key (and how many invalid values were seen
    there). ``rejected`` counts, per key, the distinct invalid values seen (shared with scoped stores).
    """

    def __init__(self, store: dist.Store, secret: bytes, scope: str = "", seen: Rejections | None = None) -> None:
        self.raw = store
        self._secret = secret
        self.scope = scope
        self.seen = seen if seen is not None else Rejections(hashlib.sha256(b"refit.warn\0" + secret).digest())

    @property
    def rejected(self) -> Counter[str]:
        """Per key, the distinct invalid values seen (forged, corrupt, from another job or session)."""
        return self.seen.counts

    def scoped(self, extra: str) -> SignedStore:
        """The same store with ``extra`` bound into every tag as well (a value tagged in the wider scope,
        or in another ``extra``, does not verify here); counts and warnings shared with this one."""
        return SignedStore(self.raw, self._secret, f"{self.scope}\0{extra}", self.seen)

    # -- encoding ---------------------------------------------------------------------------
    def _mac_key(self, key: str) -> str:
        return f"{self.scope}\0{key}"

    def _encode(self, key: str, value: Any) -> bytes:
        payload = json.dumps(value, separators=(",", ":")).encode()
        return _MAGIC + auth.tag(self._secret, self._mac_key(key), payload).hex().encode() + b"." + payload

    def _decode(self, key: str, raw: bytes) -> tuple[bool, Any]:
        """(True, value) for a validly tagged JSON value of ``key``; (False, None) otherwise (counted)."""
        head = len(_MAGIC) + 2 * auth.TAG_BYTES
        if raw.startswith(_MAGIC) and raw[head : head + 1] == b".":
            try:
                mac = bytes.fromhex(raw[len(_MAGIC) : head].decode())
            except (ValueError, UnicodeDecodeError):
                mac = b""
            if auth.verify(self._secret, self._mac_key(key), raw[head + 1 :], mac):
                return True, json.loads(raw[head + 1 :])
        self.seen.add(key, raw)
        return False, None

    def _read(self, key: str) -> bytes | None:
        """The raw value under ``key`` now, or None; one round trip, never blocking (a compare-and-set
        whose expected value no writer uses: it never writes, and returns what stands or the sentinel)."""
        got = bytes(self.raw.compare_set(key, _ABSENT, _ABSENT))
        return None if got == _ABSENT else got

    def _timeout(self, key: str, timeout_s: float) -> TimeoutError:
        seen = self.rejected[key]
        hint = (
            f" ({seen} value(s) with invalid tags were there: forged by another process, replayed from another "
            "job or session, or tagged by a process that does not hold the same secret)"
        )
        return TimeoutError(f"no valid value under {key!r} within {timeout_s:.0f}s" + (hint if seen else ""))

    # -- plain values -----------------------------------------------------------------------
    def put(self, key: str, value: Any) -> None:
        """Write ``value`` (JSON-able) under ``key``, tagged."""
        self.raw.set(key, self._encode(key, value))

    def put_many(self, values: dict[str, Any]) -> None:
        """``put`` of every item of ``values`` in one store call, in order (the store applies them at once: a reader
        woken by the last key finds the others)."""
        self.put_signed({k: self._encode(k, v) for k, v in values.items()})

    def put_signed(self, signed: dict[str, bytes]) -> None:
        """Write values ``sign`` made (each for its key) in one store call, in order (``put_many``'s)."""
        if signed:
            self.raw.multi_set(list(signed), list(signed.values()))

    def peek(self, key: str) -> Any:
        """The valid value under ``key`` now, or None (absent, or not validly tagged)."""
        raw = self._read(key)
        if raw is None:
            return None
        ok, value = self._decode(key, raw)
        return value if ok else None

    def wait_values(self, keys: list[str], timeout_s: float) -> dict[str, Any] | None:
        """Once every key of ``keys`` exists (waiting up to ``timeout_s`` on the store's side, no polling), the
        value under each: key -> its valid value, or None (not validly tagged); None where some key does not exist
        by then. One store call where the store waits inside its read (``AuthStore``), else ``wait_keys`` first."""
        try:
            if isinstance(self.raw, AuthStore):
                raws = self.raw.multi_get(keys, _wait_span(timeout_s))
            elif self.wait_keys(keys, timeout_s):
                raws = self.raw.multi_get(keys)
            else:
                return None
        except dist.DistStoreError:  # the store's wait timed out (a lost store raises another error)
            return None
        out = {}
        for key, raw in zip(keys, raws):
            ok, value = self._decode(key, bytes(raw))
            out[key] = value if ok else None
        return out

    def sign(self, key: str, value: Any) -> bytes:
        """``value`` (JSON-able) tagged for ``key`` as ``put`` writes it, to carry it another way too (a NIXL
        notification); ``verified`` reads it."""
        return self._encode(key, value)

    def verified(self, key: str, raw: bytes) -> Any:
        """The value ``sign`` made for ``key`` from ``raw``, or None where it is not validly tagged for ``key``
        (counted as ``peek`` counts it)."""
        ok, value = self._decode(key, raw)
        return value if ok else None

    def has(self, key: str) -> bool:
        """Whether a validly tagged value is under ``key`` now."""
        return self.peek(key) is not None

    def get(self, key: str, timeout_s: float) -> Any:
        """The valid value under ``key``, waiting up to ``timeout_s`` for one; ``TimeoutError`` naming the key.
        One round trip when the value is there already; otherwise the store wakes the wait when it is written."""
        deadline = time.monotonic() + timeout_s
        try:
            value = self.peek(key)
            present = False
            while value is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout(key, timeout_s)
                if present:  # the key holds an invalid value: poll until a valid one replaces it
                    time.sleep(_POLL_S)
                present = self.wait_keys([key], left)
                value = self.peek(key) if present else None
        except dist.DistStoreError as e:  # a store call ran past its own bound (a slow, loaded or unreachable store)
            raise TimeoutError(f"{self._timeout(key, timeout_s)}: the store did not answer in time ({e})") from e
        return value

    def wait_keys(self, keys: list[str], timeout_s: float) -> bool:
        """Block (on the store's side, no polling) until every key of ``keys`` exists, at most ``timeout_s``;
        whether they all do. A key that exists may hold an invalid value: callers read and check it."""
        try:
            self.raw.wait(keys, _wait_span(timeout_s))
        except dist.DistStoreError:  # the store's wait timed out (a lost store raises another error)
            return False
        return True

    def get_all(self, keys: Iterable[str]) -> dict[str, Any]:
        """The keys of ``keys`` that hold a valid value now, with their values."""
        out = {}
        for k in keys:
            value = self.peek(k)
            if value is not None:
                out[k] = value
        return out

    def wait_all(self, keys: Iterable[str], timeout_s: float) -> dict[str, Any]:
        """``get_all`` once every key holds a valid value, or when ``timeout_s`` has passed (then the
        valid ones so far). A key that merely exists (a forgery) does not end the wait. Between reads the
        store wakes the wait when the missing keys are written (``wait_keys``)."""
        keys, deadline = list(keys), time.monotonic() + timeout_s
        present = False
        while True:
            got = self.get_all(keys)
            missing = [k for k in keys if k not in got]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                return got
            if present:  # they exist but hold invalid values: poll until valid ones replace them
                time.sleep(_POLL_S)
            present = self.wait_keys(missing, left)

    def first(self, key: str, value: Any, timeout_s: float = 60.0) -> Any:
        """Write ``value`` under ``key`` unless a valid value is there already; return the one that stands.
        An invalid value in the way is displaced (compare-and-set), so a forgery cannot block the first
        real writer; ``TimeoutError`` if a stranger keeps the key contested for ``timeout_s``."""
        mine = self._encode(key, value)
        expected, deadline = b"", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cur = bytes(self.raw.compare_set(key, expected, mine))
            if cur == mine:
                return value
            if cur == expected:  # the key vanished after we read it: compare-and-set wrote nothing
                expected = b""
                continue
            ok, theirs = self._decode(key, cur)
            if ok:
                return theirs
            expected = cur
        raise self._timeout(key, timeout_s)

    def put_absent(self, key: str, value: Any) -> None:
        """Write ``value`` under ``key`` only if the key holds nothing (one compare-and-set; never replaces
        a value, valid or not)."""
        self.raw.compare_set(key, b"", self._encode(key, value))

    # -- sealed values (grant access: IPC handles) -------------------------------------------
    def put_sealed(self, key: str, plaintext: bytes) -> None:
        """Write ``plaintext`` encrypted and tagged under ``key``: useless to whoever lacks the secret."""
        self.put(key, self.sealed(key, plaintext))

    def sealed(self, key: str, plaintext: bytes) -> dict:
        """The value ``put_sealed`` writes under ``key`` (for ``put_many``)."""
        return {"sealed": base64.b64encode(auth.seal(self._secret, self._mac_key(key), plaintext)).decode()}

    def get_sealed(self, key: str, timeout_s: float) -> bytes:
        """The plaintext ``put_sealed`` wrote under ``key`` (waits like ``get``)."""
        return self.unseal(key, self.get(key, timeout_s))

    def peek_sealed(self, key: str) -> bytes | None:
        """The plaintext ``put_sealed`` wrote under ``key`` now, or None (absent or not validly tagged)."""
        value = self.peek(key)
        return None if value is None else self.unseal(key, value)

    def unseal(self, key: str, value: Any) -> bytes:
        """The plaintext of ``value`` (a valid value read under ``key``, e.g. by ``wait_values``) that ``put_sealed``
        wrote; ``ConfigError`` where it is not sealed with this job's secret for ``key``."""
        blob = value.get("sealed") if isinstance(value, dict) else None
        plain = auth.unseal(self._secret, self._mac_key(key), base64.b64decode(blob)) if isinstance(blob, str) else None
        if plain is None:
            raise ConfigError(f"the value under {key!r} is not sealed with this job's secret")
        return plain


def signed(store: dist.Store | SignedStore | None, secret: bytes | None = None) -> SignedStore | None:
    """``store`` as a ``SignedStore`` (with ``secret``, else the job's: ``auth.job_secret()``; scope
    ``REFIT_JOB_ID``, which refit's launchers set fresh per job); None stays None."""
    if store is None or isinstance(store, SignedStore):
        return store
    return SignedStore(store, secret if secret is not None else auth.job_secret(), os.environ.get(JOB_ENV, ""))


pin_from_env()
