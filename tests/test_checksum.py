"""Position-sensitive checksums (``refit.transport.checksum``): what they catch, and that every path gives the
same value for the same bytes (CPU; the Triton kernel through ``TRITON_INTERPRET=1`` in a subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interpreter import assert_all_ok_in_interpreter, needs_triton
from refit.transport.checksum import KEY, LEN_KEY, Piece, PieceSums, checksum, mix64, reference_sum, signed64


def _definition(t: torch.Tensor, base: int = 0) -> int:
    """The module docstring's formula on Python ints, byte by byte."""
    b = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    total = mix64(len(b) ^ LEN_KEY)
    for i in range(0, len(b), 8):
        word = int.from_bytes(b[i : i + 8].ljust(8, b"\0"), "little")
        total += mix64(word ^ ((base + i // 8 + 1) * KEY))
    return signed64(total)


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _sum(t: torch.Tensor) -> int:
    return int(checksum(t)[0])


def _plain_word_sum(t: torch.Tensor) -> int:
    """The checksum before issue 18: a wrapping sum of the 8-byte words (order-insensitive)."""
    return int(t.contiguous().reshape(-1).view(torch.int64).sum())


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 64, 1023, 4099])
def test_reference_matches_the_definition_on_odd_sizes(n):
    t = _random_bytes(n, seed=n)
    assert int(reference_sum(t)) == _definition(t)
    assert int(reference_sum(t, base=5)) == _definition(t, base=5)
    assert checksum(t).tolist() == [_definition(t), n]


def test_reference_in_chunks_equals_one_pass(monkeypatch):
    t = _random_bytes(8 * 1000 + 3, seed=1)
    whole = int(reference_sum(t))
    monkeypatch.setitem(__import__("refit.transport.checksum", fromlist=["x"])._CHUNK_WORDS, "cpu", 7)
    assert int(reference_sum(t)) == whole == _definition(t)


def test_a_flipped_bit_anywhere_changes_the_checksum():
    t = _random_bytes(256, seed=2)
    base = _sum(t)
    for byte in (0, 7, 8, 100, 255):
        for bit in range(8):
            u = t.clone()
            u[byte] ^= 1 << bit
            assert _sum(u) != base, (byte, bit)


def test_two_swapped_64_byte_blocks_change_the_checksum():
    t = _random_bytes(4096, seed=3)
    u = t.clone()
    u[0:64], u[1024:1088] = t[1024:1088].clone(), t[0:64].clone()
    assert _plain_word_sum(u) == _plain_word_sum(t)  # what the old sum missed
    assert _sum(u) != _sum(t)


def test_two_swapped_rows_of_a_2d_tensor_change_the_checksum():
    m = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    s = m.clone()
    s[[3, 11]] = m[[11, 3]]
    assert _plain_word_sum(s) == _plain_word_sum(m)
    assert _sum(s) != _sum(m)
    w = m.clone()
    w[:, [0, 1]] = m[:, [1, 0]]  # swapped columns: 4-byte pieces inside words
    assert _sum(w) != _sum(m)


def test_a_zeroed_piece_changes_the_checksum():
    t = _random_bytes(4096, seed=5)
    for lo, hi in ((0, 64), (4032, 4096), (0, 4096), (100, 101)):
        u = t.clone()
        u[lo:hi] = 0
        assert _sum(u) != _sum(t), (lo, hi)
    assert _sum(torch.zeros(64, dtype=torch.uint8)) != _sum(torch.zeros(72, dtype=torch.uint8))


def test_trailing_zero_bytes_count():
    t = _random_bytes(13, seed=6)
    assert _sum(t) != _sum(torch.cat([t, torch.zeros(1, dtype=torch.uint8)]))
    assert _sum(torch.zeros(0, dtype=torch.uint8)) != _sum(torch.zeros(1, dtype=torch.uint8))


def test_equal_bytes_give_equal_checksums_across_dtypes_and_views():
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(7))
    want = _sum(x)
    assert _sum(x.view(torch.int32)) == _sum(x.view(torch.uint8)) == _sum(x.view(torch.bfloat16)) == want
    assert _sum(x.reshape(-1)) == _sum(x.reshape(4, 2, 24)) == want
    assert _sum(x.to(torch.bfloat16)) != _sum(x.to(torch.float16))  # different bytes


def test_non_contiguous_and_unaligned_views_equal_their_contiguous_copy():
    m = torch.randn(12, 40, generator=torch.Generator().manual_seed(8))
    for v in (m[:, 3:29], m[2:9, 1:2], m.t(), m[::2], m.view(torch.bfloat16)[:, 1:78]):
        assert _sum(v) == _sum(v.contiguous()) == _definition(v)
    raw = _random_bytes(101, seed=9)
    assert _sum(raw[3:]) == _sum(raw[3:].clone())  # starts 3 bytes into the storage


def test_piece_sums_on_the_cpu_add_pieces_at_their_bases_and_copy():
    a, b = _random_bytes(40, seed=10), torch.randn(6, 10, generator=torch.Generator().manual_seed(11))[:, 2:8]
    out = torch.full((3,), 99, dtype=torch.int64)
    dst = torch.zeros(6, 6)
    sums = PieceSums([Piece(a, 1, base=0), Piece(b, 1, base=5), Piece(b, 2, dst=dst)], out)
    sums.run()
    assert int(out[1]) == signed64(_definition(a) + _definition(b, base=5))
    assert int(out[2]) == _definition(b) and torch.equal(dst, b)
    assert int(out[0]) == 99  # slots no piece uses are left alone


INTERPRET_SCRIPT = Path(__file__).with_name("checksum_interpret.py")


@pytest.mark.timeout(600)
@needs_triton
def test_triton_kernel_in_interpreter_equals_reference():
    assert_all_ok_in_interpreter(INTERPRET_SCRIPT, 560)


def test_a_process_that_pulls_nothing_checks_nothing():
    from refit.transport.ipc import IpcSums

    IpcSums([], torch.device("cpu"), stages=1).check()  # a source process: no pieces, no error
