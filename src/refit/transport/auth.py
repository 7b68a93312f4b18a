"""The job's secret: who may steer a refit through its control plane.

Every process of one refit job holds the same secret (at least 16 bytes). Whoever
creates the job makes it (``new_secret``) or takes the user's (``REFIT_SECRET``: the
secret itself, or ``REFIT_SECRET_FILE``: a file holding it, readable by its owner
only), and hands it to every process it starts (an argument or the child's
environment, never the network in clear) and to engines through their init info.

With it, every control value refit acts on carries a tag (``tag``: HMAC-SHA256 over the
store key and the payload; the key names the job, version and attempt, so a value
cannot be replayed under another key), and payloads that grant access (CUDA IPC
handles) are sealed (``seal``: AES-GCM from the maintained ``cryptography``
package, key derived from the secret, the store key as associated data): a stranger
who reads the store learns nothing usable, and a value without a valid tag is
ignored, never acted on.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import os
import secrets
import stat

from refit.errors import ConfigError

SECRET_ENV = "REFIT_SECRET"
SECRET_FILE_ENV = "REFIT_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096  # a secret file larger than this is refused before it is read
TAG_BYTES = 32  # HMAC-SHA256


def new_secret() -> bytes:
    """A fresh random secret: 32 bytes from the OS's CSPRNG, as 64 hex characters (so it travels as text)."""
    return secrets.token_hex(32).encode()


def _checked(secret: bytes, source: str) -> bytes:
    """``secret`` if it is usable as the job's: ``MIN_SECRET_BYTES`` to ``MAX_SECRET_BYTES`` of printable
    text without surrounding whitespace (it travels as text to children and engines); ``ConfigError``
    naming ``source`` (never the secret) otherwise. Checked where the job is created, before any child."""
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ConfigError(
            f"the job secret from {source} has {len(secret)} bytes; "
            f"at least {MIN_SECRET_BYTES} (and at most {MAX_SECRET_BYTES}) are required"
        )
    try:
        text = secret.decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"the job secret from {source} is not UTF-8 text (byte {e.start})") from None
    if text != text.strip():
        raise ConfigError(f"the job secret from {source} has surrounding whitespace; remove it")
    bad = next((i for i, c in enumerate(text) if not c.isprintable()), None)
    if bad is not None:
        raise ConfigError(f"the job secret from {source} has a control character at position {bad}; use printable text")
    return secret


def _from_file(path: str) -> bytes:
    """The secret in ``path``: opened without following a final symlink and without blocking (a FIFO),
    then checked on the open file (``fstat``: the file read, not whatever the path names a moment later):
    a regular file, private to its owner, at most ``MAX_SECRET_BYTES``; a bounded prefix is read. One
    trailing newline (as editors write) is dropped."""
    source = f"{SECRET_FILE_ENV}={path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        why = "it is a symbolic link; name the file itself" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise ConfigError(f"{source} cannot be read: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{source} is not a regular file (a FIFO, device or directory); name a private file")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{source} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); make it private first: chmod 600"
            )
        if st.st_size > MAX_SECRET_BYTES + 2:
            raise ConfigError(f"{source} has {st.st_size:,} bytes; a secret file holds at most {MAX_SECRET_BYTES}")
        data = os.read(fd, MAX_SECRET_BYTES + 3)
    except OSError as e:
        raise ConfigError(f"{source} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return _checked(data.removesuffix(b"\n").removesuffix(b"\r"), source)


def secret_from_env() -> bytes | None:
    """The secret the user gave this process (``REFIT_SECRET``, else ``REFIT_SECRET_FILE``), or None."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return _checked(value.encode(), SECRET_ENV)
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return _from_file(path)
    return None


def job_secret() -> bytes:
    """The secret of the job this process belongs to; ``ConfigError`` if none was handed to it."""
    secret = secret_from_env()
    if secret is None:
        raise ConfigError(
            f"no job secret: every process of a refit needs the same one in {SECRET_ENV} (or a private file "
            f"named by {SECRET_FILE_ENV}); refit's launchers make one, a job started by hand must set it"
        )
    return secret


def secret_or_new() -> bytes:
    """For the process that creates a job: the user's secret if one is set, else a fresh one."""
    return secret_from_env() or new_secret()


def as_text(secret: bytes) -> str:
    """The secret as the text ``REFIT_SECRET`` and init infos carry (``as_text(s).encode() == s``)."""
    try:
        text = secret.decode()
    except UnicodeDecodeError:
        text = "\n"
    if not text.isprintable() or text != text.strip():
        raise ConfigError("the job secret must be printable text without surrounding whitespace")
    return text


def child_env(secret: bytes) -> dict[str, str]:
    """What a launcher puts in a child's environment so that ``job_secret()`` finds ``secret`` there."""
    return {SECRET_ENV: as_text(secret)}


@functools.lru_cache(maxsize=8)
def _mac_base(secret: bytes) -> hmac.HMAC:
    """HMAC-SHA256 keyed with ``secret`` after the domain prefix: made once per secret, copied per tag (the
    key's pads and the prefix are not hashed again for every value)."""
    return hmac.new(secret, b"refit.v1\0", hashlib.sha256)


def tag(secret: bytes, key: str, payload: bytes) -> bytes:
    """HMAC-SHA256 over ``key`` and ``payload`` (domain-separated), 32 bytes."""
    mac = _mac_base(secret).copy()
    mac.update(key.encode() + b"\0" + payload)
    return mac.digest()


def verify(secret: bytes, key: str, payload: bytes, mac: bytes) -> bool:
    """Whether ``mac`` is ``payload``'s tag under ``key`` (constant-time compare)."""
    return hmac.compare_digest(tag(secret, key, payload), mac)


@functools.lru_cache(maxsize=8)
def _aead(secret: bytes):
    """AES-GCM keyed from ``secret`` (derived once per secret; the cipher object holds no per-call state)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(hashlib.sha256(b"refit.seal.v1\0" + secret).digest())


def seal(secret: bytes, key: str, plaintext: bytes) -> bytes:
    """``plaintext`` encrypted and authenticated for ``key`` (nonce || ciphertext || tag)."""
    nonce = os.urandom(12)
    return nonce + _aead(secret).encrypt(nonce, plaintext, key.encode())


def unseal(secret: bytes, key: str, blob: bytes) -> bytes | None:
    """The plaintext ``seal`` made for ``key``, or None if ``blob`` is not one (forged, another key or job)."""
    from cryptography.exceptions import InvalidTag

    if len(blob) < 12 + 16:
        return None
    try:
        return _aead(secret).decrypt(blob[:12], blob[12:], key.encode())
    except InvalidTag:
        return None
