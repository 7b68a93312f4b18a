"""Position-sensitive checksums of bytes on the device: what a receiver compares with what its sender saw.

**Definition.** A piece's bytes, in row-major order of its view, are read as little-endian 64-bit
words ``x_0 .. x_{n8-1}`` (``n8 = nbytes // 8``); a last partial word, if any, is its tail bytes
zero-padded (``x_{n8}``). With ``base`` (0 unless a caller places the piece at a word offset inside
a larger message)::

    sum = sum_i M(x_i XOR K(base + i)) + M(nbytes XOR LEN_KEY)        (wrapping, mod 2**64)
    K(j) = (j + 1) * KEY                                               (mod 2**64)
    M(z) = the splitmix64 finalizer: z ^= z >> 30; z *= MUL1; z ^= z >> 27; z *= MUL2; z ^= z >> 31

(logical shifts; stored as a signed int64). ``checksum(t)`` returns ``[sum, nbytes]``.

**Why this catches what the plain word sum did not.** ``M`` is a bijection on 64-bit words (each
xor-shift and each multiplication by an odd constant is invertible), so a change confined to one
word (any flipped bit) changes exactly one term, and the sum, always. ``K`` is a bijection of the
position (``KEY`` is odd) and never 0 at a real position, so the same word value at two positions
enters ``M`` as two different inputs: exchanging two words or blocks (``x_a``, ``x_b`` with
``x_a != x_b``) replaces ``M(x_a^K_a) + M(x_b^K_b)`` by ``M(x_b^K_a) + M(x_a^K_b)``, and a zeroed
word contributes ``M(K_i)`` instead of ``M(x_i^K_i)``. ``M`` mixes every input bit into every
output bit (full avalanche), so for any change to more than one word the difference of the two
sums behaves as a uniform 64-bit value: a change slips through with probability about ``2**-64``.
The length term separates pieces that differ only by trailing zero bytes. The constants are the
splitmix64 ones (Steele, Lea, Flood 2014; ``KEY`` is the 64-bit golden ratio), chosen for their
studied avalanche, nothing else.

**What it is not.** Not cryptographic: anyone who knows the function can forge a collision. It is
for corruption and plan bugs (bytes flipped, lost, zeroed, or put at the wrong place), not for
adversaries, so a keyed MAC (and its cost) is not needed. A maintained CRC32C package
(``google-crc32c``, ``crc32c``) was considered for the CPU: it has 32 bits (random multi-word
changes slip through with ``2**-32``), and a GPU twin at HBM speed would need carry-less
multiplication Triton does not offer; one definition, computed the same way on both device types,
was preferred. Every (CPU, CUDA) x (torch, Triton) path gives the same value for the same bytes.

**Two implementations, bit for bit equal.** ``reference_sum`` in plain torch ops (int64 tensors;
``>>`` on int64 is arithmetic, so logical shifts are masked), in chunks to bound its temporaries:
the CPU path, and the CUDA path without Triton. ``refit.transport.checksum_triton``: one kernel
that reads each byte once (and optionally copies it), for many pieces in one launch.
``PieceSums`` picks per piece. Sums stay on the device: nothing here syncs the host.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KEY = 0x9E3779B97F4A7C15  # odd: j -> (j + 1) * KEY is a bijection of the word position
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
LEN_KEY = 0xD6E8FEB86659FD93  # the byte count enters M as its own term
_MASK64 = (1 << 64) - 1
_CHUNK_WORDS = {"cpu": 1 << 18, "cuda": 1 << 25}  # reference temporaries: 2 MiB on the CPU, 256 MiB on a GPU


def signed64(v: int) -> int:
    """``v`` mod 2**64 as the int64 that stores the same bits."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def mix64(z: int) -> int:
    """``M(z)`` on a Python int (the splitmix64 finalizer), unsigned result."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * MUL2) & _MASK64
    return z ^ (z >> 31)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """``M`` in place on an int64 tensor (logical shifts: arithmetic shift, then mask the sign copies)."""
    for shift, mul in ((30, MUL1), (27, MUL2), (31, None)):
        z.bitwise_xor_(torch.bitwise_right_shift(z, shift).bitwise_and_((1 << (64 - shift)) - 1))
        if mul is not None:
            z.mul_(signed64(mul))
    return z


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order, 1-D uint8, 8-byte aligned (a copy where ``t`` is strided or not)."""
    t = t.detach()
    b = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
    return b.clone() if b.data_ptr() % 8 else b


def reference_sum(t: torch.Tensor, base: int = 0) -> torch.Tensor:
    """The module's ``sum`` of ``t``'s bytes (word positions from ``base``) as a 0-d int64 tensor on
    ``t``'s device, in plain torch ops; enqueued, no host sync."""
    b = _bytes(t)
    n = b.numel()
    n8 = n // 8
    words = b[: n8 * 8].view(torch.int64)
    total = torch.full((), signed64(mix64(n ^ LEN_KEY)), dtype=torch.int64, device=b.device)
    step = _CHUNK_WORDS.get(b.device.type, 1 << 20)
    for start in range(0, n8, step):
        w = words[start : start + step]
        first = base + start + 1
        z = torch.arange(first, first + w.numel(), dtype=torch.int64, device=b.device)
        total += _mix_(z.mul_(signed64(KEY)).bitwise_xor_(w)).sum()
    if n % 8:
        tail = b[n8 * 8 :].to(torch.int64)
        word = (tail << torch.arange(0, 8 * tail.numel(), 8, dtype=torch.int64, device=b.device)).sum()
        total += _mix_((word ^ signed64((base + n8 + 1) * KEY)).reshape(1))[0]
    return total


def triton_enabled() -> bool:
    """Triton importable and not switched off (``REFIT_SUM_TRITON=0`` forces the torch path)."""
    if os.environ.get("REFIT_SUM_TRITON", "1") == "0":
        return False
    from refit.transport import checksum_triton

    return checksum_triton.AVAILABLE


def fusable(p: Piece) -> bool:
    """Whether ``PieceSums`` does ``p`` in its Triton kernel (CUDA, Triton on, a layout it addresses)."""
    if not (p.src.is_cuda and triton_enabled()):
        return False
    from refit.transport.checksum_triton import kernel_row

    return kernel_row(p.src, p.dst, p.base, p.slot) is not None


def checksum(t: torch.Tensor) -> torch.Tensor:
    """``[sum, nbytes]`` (int64, on ``t``'s device) of ``t``'s bytes; no host sync."""
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    out[1] = t.numel() * t.element_size()
    PieceSums([Piece(t, 0)], out).run()
    return out


@dataclass(frozen=True)
class Piece:
    """One entry of a batched checksum: the bytes of ``src`` (row-major; word positions from ``base``)
    are added into ``out[slot]``; with ``dst`` (same shape and dtype), they are also copied there."""

    src: torch.Tensor
    slot: int
    dst: torch.Tensor | None = None
    base: int = 0


class PieceSums:
    """The checksums (and, for pieces with ``dst``, the copies) of a fixed list of pieces, built once.

    Contract: every piece's ``src`` and ``dst`` live on ``out``'s device; ``run()`` enqueues on the
    current stream: zero the slots the pieces use, then copy and sum. Several pieces may share a
    slot (their sums add: a message of several pieces). On CUDA with Triton one kernel launch does
    every piece it can address (1-D, or rows with a pitch, 8-byte aligned; see
    ``checksum_triton.kernel_row``); the rest, and everything on the CPU, go through torch copies and
    ``reference_sum`` (same values). The views must stay valid (same storage) between runs.
    """

    def __init__(self, pieces: Sequence[Piece], out: torch.Tensor, *, use_triton: bool | None = None) -> None:
        self.out, self.pieces = out, list(pieces)
        self.slots = torch.tensor(sorted({p.slot for p in pieces}), dtype=torch.int64, device=out.device)
        if use_triton is None:
            use_triton = out.is_cuda and triton_enabled()
        self.kernel = None
        self.fallback: list[Piece] = list(pieces)
        if use_triton and pieces:
            from refit.transport.checksum_triton import SumLaunch, kernel_row

            rows = [(p, kernel_row(p.src, p.dst, p.base, p.slot)) for p in pieces]
            self.fallback = [p for p, r in rows if r is None]
            fast = [r for _, r in rows if r is not None]
            self.kernel = SumLaunch(fast, out.device, (KEY, MUL1, MUL2, LEN_KEY)) if fast else None

    @property
    def kernel_pieces(self) -> int:
        """How many pieces the Triton kernel does (the rest: torch)."""
        return 0 if self.kernel is None else self.kernel.entries

    def warm(self) -> None:
        """Compile the Triton kernel ``run`` launches, running nothing (before a CUDA graph records ``run``)."""
        if self.kernel is not None:
            self.kernel.launch(self.out, warm=True)

    def run(self) -> None:
        if self.slots.numel():
            self.out.index_fill_(0, self.slots, 0)
        for p in self.fallback:
            if p.dst is not None:
                p.dst.copy_(p.src)
            self.out.narrow(0, p.slot, 1).add_(reference_sum(p.dst if p.dst is not None else p.src, p.base))
        if self.kernel is not None:
            self.kernel.launch(self.out)
