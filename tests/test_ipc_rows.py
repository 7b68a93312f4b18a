"""How a strided piece is seen as evenly spaced rows, for 2-D copies and pitched kernels (pure stride math)."""

import torch

from refit.transport.rows import row_copy, rows_of


def test_rows_of_dense_strided_and_irregular():
    m = torch.empty(8, 64, dtype=torch.bfloat16)
    assert rows_of(m) == (1, 8 * 64 * 2, 8 * 64 * 2)
    assert rows_of(m[:, 16:48]) == (8, 32 * 2, 64 * 2)
    assert rows_of(m[2:5]) == (1, 3 * 64 * 2, 3 * 64 * 2)
    assert rows_of(m[:, ::2]) is None  # not contiguous within a row
    assert rows_of(torch.empty(4, 6, 8)[:, 1:3, 2:6]) is None  # two strided dims
    assert rows_of(torch.empty(4, 6, 8)[:, 2:4, :]) == (4, 2 * 8 * 4, 6 * 8 * 4)  # trailing dims dense


def test_row_copy_takes_dense_side_width():
    src = torch.empty(16, 32, dtype=torch.float32)[:, 8:24]  # 16 rows of 64 B, pitch 128 B
    dst = torch.empty(16, 16, dtype=torch.float32)  # dense
    assert row_copy(dst, src) == (16, 64, 64, 128)
    assert row_copy(src, dst) == (16, 64, 128, 64)
    assert row_copy(dst.to(torch.float64), src) is None  # dtypes differ
    assert row_copy(torch.empty(16, 8), src[:, :8]) == (16, 32, 32, 128)


def test_stacked_expert_pieces_are_rows_across_experts_and_gate_up():
    # an fsdp shard of gate_up [E, 2, I, H], its tp half of I: experts and gate/up are evenly spaced rows
    shard = torch.empty(4, 2, 12, 8, dtype=torch.bfloat16)
    assert rows_of(shard[:, :, 6:, :]) == (8, 6 * 8 * 2, 12 * 8 * 2)
    assert row_copy(torch.empty(4, 2, 6, 8, dtype=torch.bfloat16), shard[:, :, 6:, :]) == (8, 96, 96, 192)
    assert rows_of(shard[::2, :, 6:, :]) is None  # every other expert: not evenly spaced with gate/up
