"""The layout of a CUDA IPC source's delta staging for one receiver (``refit.transport.ipc_delta``): a header of
int64 words at its start, then the payloads of the messages sent as words, one after another in plan order.

Header: ``[MAGIC, base version (-1: none), version, n, c_0 .. c_{n-1}]``, one count per message the source sends
that receiver over the link between their two GPUs (plan order): ``DENSE`` (-1) where the message goes dense (the
receiver copies it from the source's tensors), else its changed 64-bit words ``k`` (its payload: ``k`` int32 indices
padded to 8 bytes, then the ``k`` words: ``refit.delta.wire.wire_sizes``). The payloads' offsets follow from the
counts (``offsets``), so the header holds no address: a receiver checks the counts (``read_header``) and computes
where each payload lies inside the staging it mapped. Pure numpy: the source writes what ``pack_header`` returns,
the receiver checks what it read.
"""

from __future__ import annotations

import numpy as np

from refit.delta.wire import DeltaError, wire_sizes

MAGIC = 0x5246_4950_4344_4C54  # the first word of a header: a staging that was never written does not pass
DENSE = -1  # a message's count where it goes dense
FIELDS = 4  # the header's words before the counts


def header_bytes(n: int) -> int:
    """Bytes of the header of ``n`` messages (where the first payload starts)."""
    return 8 * (FIELDS + n)


def pack_header(base: int | None, version: int, counts: np.ndarray) -> np.ndarray:
    """The header (int64) of a staging holding deltas on ``base`` (None: the source holds no base, every count
    ``DENSE``) for refit ``version``, one count per message."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.concatenate([np.array([MAGIC, -1 if base is None else base, version, len(counts)]), counts])


def payload_sizes(counts: np.ndarray) -> np.ndarray:
    """Bytes of each message's payload in the staging (0 for a dense one)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.where(counts >= 0, wire_sizes(np.maximum(counts, 0)), 0)


def offsets(counts: np.ndarray) -> np.ndarray:
    """Each message's byte offset in the staging: after the header, the payloads one after another in order (a
    dense message's is where the next payload starts; it holds nothing)."""
    sizes = payload_sizes(counts)
    return header_bytes(len(sizes)) + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def used_bytes(counts: np.ndarray) -> int:
    """The staging's bytes that the header and the payloads take."""
    return header_bytes(len(counts)) + int(payload_sizes(counts).sum())


def read_header(raw: np.ndarray, version: int, nwords: np.ndarray, cap: int, who: str) -> tuple[int | None, np.ndarray]:
    """``(base version or None, counts)`` of a header read from a staging of ``cap`` bytes for refit ``version``,
    whose messages have ``nwords`` 64-bit words each (-1 where a message has none: it can only go dense), checked:
    the magic word, this refit's version, one count per message, each ``DENSE`` or within its message's words, a
    base where some count is not dense, and the payloads inside the staging. ``DeltaError`` naming ``who`` (the
    source) and what is wrong."""
    nwords = np.asarray(nwords, dtype=np.int64)
    raw = np.asarray(raw, dtype=np.int64)
    n = len(nwords)
    if len(raw) != FIELDS + n or raw[0] != MAGIC or raw[3] != n:
        got = raw[:FIELDS].tolist()
        raise DeltaError(f"the CUDA IPC delta staging of {who} holds no header of {n} messages (it starts {got})")
    base, sent, counts = int(raw[1]), int(raw[2]), raw[FIELDS:]
    if sent != version:
        raise DeltaError(f"the CUDA IPC delta staging of {who} holds version {sent}, this refit is version {version}")
    bad = np.flatnonzero((counts < DENSE) | (counts > nwords))
    if len(bad):
        j = int(bad[0])
        raise DeltaError(
            f"the CUDA IPC delta header of {who} claims {int(counts[j])} changed words in message {j} of "
            f"{max(0, int(nwords[j]))} words"
        )
    if base < -1 or (base == -1 and (counts >= 0).any()):
        raise DeltaError(f"the CUDA IPC delta header of {who} sends deltas on base version {base}")
    if used_bytes(counts) > cap:
        raise DeltaError(
            f"the CUDA IPC delta header of {who} claims {used_bytes(counts)} bytes of payload and header in a staging "
            f"of {cap} bytes"
        )
    return (None if base == -1 else base), counts
