"""Run by tests/test_delta.py with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors): the one-pass
delta kernel of ``refit.delta.kernels`` against ``find_changes``'s torch path. Prints ALL OK."""

from __future__ import annotations

import os

import torch

from refit.delta.elements import bits, find_changes, find_changes_many
from refit.delta.kernels import diff_compact

assert os.environ.get("TRITON_INTERPRET") == "1"
G = torch.Generator().manual_seed(0)


def same_changes(base: torch.Tensor, cur: torch.Tensor, chunk: int) -> None:
    want_i, want_v = find_changes(base, cur, use_triton=False)
    got_i, got_v = find_changes(base, cur, chunk_bytes=chunk, use_triton=True)
    order = torch.argsort(got_i)
    assert torch.equal(got_i[order], want_i), (got_i, want_i)
    assert torch.equal(bits(got_v[order]), bits(want_v))


def main() -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        for n in (0, 1, 1023, 1025, 5000):
            cur = torch.randn(n, generator=G).to(dtype)
            base = cur.clone()
            for f in (0.0, 0.01, 0.3, 1.0):
                flip = torch.rand(n, generator=G) < f
                bits(cur)[flip] ^= 1
                for chunk in (1 << 20, 700 * cur.element_size()):  # several chunks, a block across a chunk end
                    same_changes(base, cur, chunk)
                base.copy_(cur)
    # many pieces, one sync: few changes (the kernel's slots), many (over a quarter: the torch path again)
    pairs = []
    for n, f in ((5000, 0.01), (3000, 0.9), (1, 1.0), (0, 0.0)):
        cur = torch.randn(n, generator=G).to(torch.bfloat16)
        base = cur.clone()
        bits(cur)[torch.rand(n, generator=G) < f] ^= 1
        pairs.append((base, cur))
    for (base, cur), (i, v) in zip(pairs, find_changes_many(pairs, use_triton=True)):
        want_i, want_v = find_changes(base, cur, use_triton=False)
        order = torch.argsort(i)
        assert torch.equal(i[order], want_i) and torch.equal(bits(v[order]), bits(want_v))
    # overflow: fewer slots than changes, the count still true; the fused base update
    base = torch.zeros(3000, dtype=torch.int16)
    cur = torch.arange(3000, dtype=torch.int16)
    idx, vals, k = diff_compact(base, cur, cap=100)
    assert k == 2999 and len(idx) == 100 and torch.equal(cur[idx], vals)
    idx, vals, k = diff_compact(base, cur, start=7, update=True)
    assert k == 2999 and torch.equal(base, cur) and torch.equal(torch.sort(idx).values, torch.arange(8, 3007))
    print("ALL OK")


if __name__ == "__main__":
    main()
