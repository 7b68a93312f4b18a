"""What a delta puts on the wire: the encodings and the byte layout of one piece in each.

* ``dense``: every element, as the plain P2P path sends it (not encoded here).
* ``sparse``: ``k`` int32 indices (flat, row-major), then the ``k`` values; each segment 8-byte aligned.
* ``bitmask``: one bit per element (bit ``i`` of byte ``i // 8``), then the ``k`` values; each segment 8-byte
  aligned.
* ``words``: ``k`` int32 indices of changed 64-bit words, padded to 8 bytes, then the ``k`` words
  (``refit.delta.words`` finds and scatters them).

``wire_bytes`` and ``wire_sizes`` size a piece, ``encode`` and ``decode`` write and read one. Pure torch and
numpy: the cost rule (``refit.delta.rule``) and the cluster cost model size messages with it.
"""

from __future__ import annotations

import torch

from refit.errors import ConfigError, TransferError

ENCODINGS = ("dense", "sparse", "bitmask", "words")
INDEX_BYTES = 4  # indices travel as int32 (a piece of 2**31 elements or words or more cannot be sparse or words)
WORD = 8  # bytes per word


class DeltaError(TransferError):
    """A delta cannot apply: wrong base version, malformed header or indices out of range."""


def wire_bytes(encoding: str, n: int, k: int, itemsize: int) -> int:
    """Bytes on the wire of ``k`` changed elements out of ``n`` of ``itemsize`` bytes (8-byte aligned
    segments, as ``encode`` lays them out)."""
    if encoding == "dense":
        return n * itemsize
    if encoding == "sparse":
        return _align(k * INDEX_BYTES) + _align(k * itemsize)
    if encoding == "bitmask":
        return _align((n + 7) // 8) + _align(k * itemsize)
    if encoding == "words":  # k counts changed 64-bit words
        return wire_sizes(k)
    raise ConfigError(f"delta encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")


def piece_wire(kind: str, view: torch.Tensor, k: int) -> int:
    """``wire_bytes`` of one piece ``view`` with ``k`` changes (elements, or words for ``"words"``)."""
    return wire_bytes(kind, view.numel(), k, view.element_size())


def index_bytes(k):
    """Bytes of ``k`` int32 word indices padded to 8 (an int or a numpy array): where the words start."""
    return (k * INDEX_BYTES + 7) // 8 * 8


def wire_sizes(k):
    """Bytes on the wire of ``k`` changed words (an int or a numpy array of them): indices, padding, words."""
    return index_bytes(k) + k * WORD


def _align(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def encode(encoding: str, n: int, indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """Write one piece's changes as ``encoding`` into ``out`` (uint8, ``wire_bytes`` long): sparse: int32
    indices, then values; bitmask: bit i of byte i // 8 set for every changed element, then values (each
    segment 8-byte aligned). ``dense`` is not encoded here (the piece travels as it lies)."""
    k, size = indices.numel(), values.element_size()
    if encoding == "sparse":
        head = _align(k * INDEX_BYTES)
        out[: k * INDEX_BYTES].view(torch.int32).copy_(indices)
    elif encoding == "bitmask":
        head = _align((n + 7) // 8)
        mask = torch.zeros(head * 8, dtype=torch.bool, device=out.device)
        mask[indices] = True
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=out.device)
        out[:head].copy_((mask.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8))
    else:
        raise ValueError(f"encode: {encoding!r} is not a delta encoding")
    out[head : head + k * size].view(values.dtype).copy_(values)


def decode(
    encoding: str, n: int, k: int, payload: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``encode``: ``(indices, values)`` of one piece from its ``wire_bytes`` payload."""
    size = torch.empty(0, dtype=dtype).element_size()
    if encoding == "sparse":
        head = _align(k * INDEX_BYTES)
        indices = payload[: k * INDEX_BYTES].view(torch.int32)
    elif encoding == "bitmask":
        head = _align((n + 7) // 8)
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        mask = ((payload[:head, None] >> shifts) & 1).view(-1)[:n]
        indices = mask.nonzero().squeeze(1)
        if indices.numel() != k:
            raise DeltaError(f"a bitmask delta marks {indices.numel()} elements, its header says {k}")
    elif encoding == "words":  # k 64-bit words (``refit.delta.words``)
        head = index_bytes(k)
        return payload[: k * INDEX_BYTES].view(torch.int32), payload[head : head + k * 8].view(torch.int64)
    else:
        raise ValueError(f"decode: {encoding!r} is not a delta encoding")
    return indices, payload[head : head + k * size].view(dtype)
