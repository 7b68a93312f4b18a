"""Run by tests/test_delta.py with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors): the word
kernels of ``refit.delta.kernels`` (find, pack, check, scatter over many pieces in one
launch) against the torch reference of ``refit.delta.words``. Prints ALL OK."""

from __future__ import annotations

import os

import torch

from refit.delta.elements import bits
from refit.delta.words import (
    apply_words,
    check_words_many,
    find_words,
    find_words_many,
    scatter_words_many,
)

assert os.environ.get("TRITON_INTERPRET") == "1"
G = torch.Generator().manual_seed(0)


def versions(n: int, dtype: torch.dtype, f: float) -> tuple[torch.Tensor, torch.Tensor]:
    cur = torch.randn(n, generator=G).to(dtype)
    base = cur.clone()
    bits(cur)[torch.rand(n, generator=G) < f] ^= 1
    return base, cur


def main() -> None:
    # pieces of several sizes and dtypes in one launch; one over a quarter of its words changed (overflow)
    specs = [(4096 * 3 + 8, torch.bfloat16, 0.01), (16, torch.float32, 0.5), (5000 * 8, torch.float8_e4m3fn, 0.001)]
    specs += [(4, torch.bfloat16, 0.0), (2048 * 4 * 2, torch.bfloat16, 0.9)]
    specs += [(40960, torch.bfloat16, 0.06)]  # 10,240 words, 2,560 slots, ~2,250 changed: two blocks of slots
    pairs = [versions(n, d, f) for n, d, f in specs]
    found = find_words_many(pairs, use_triton=True)
    for (base, cur), (idx, words, k) in zip(pairs, found):
        want_i, want_w = find_words(base, cur)
        assert k == len(want_i), (k, len(want_i))
        if idx is None:
            assert k > (cur.numel() * cur.element_size() // 8) // 4
            continue
        order = torch.argsort(idx)
        assert torch.equal(idx[order], want_i) and torch.equal(words[order], want_w)
    assert found[4][0] is None  # 90% of the elements changed: over the slots
    assert 2048 < found[5][2] <= 2560, found[5][2]
    # the wire format packed by one launch equals the pieces' bytes one after another (odd counts padded with 0)
    import numpy as np

    from refit.delta.wire import wire_sizes
    from refit.delta.words import find_words_table, pack_table

    ptrs = [np.array([t.data_ptr() for t in ts], dtype=np.int64) for ts in zip(*pairs)]
    nw = np.array([c.numel() * c.element_size() // 8 for _, c in pairs], dtype=np.int64)
    table_found = find_words_table(*ptrs, nw, torch.device("cpu"))
    ok = table_found.count <= table_found.cap
    sizes = np.where(ok, wire_sizes(table_found.count), 0)
    buf = torch.full((int(sizes.sum()),), 0xAB, dtype=torch.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    table_found.count = np.where(ok, table_found.count, 0)  # pieces over their slots are not packed
    pack_table(table_found, np.arange(len(pairs)), buf.data_ptr() + offs, torch.device("cpu"))
    want = []
    for j in range(len(pairs)):
        i, w = table_found.piece(j)
        if i is not None and len(i):
            want += [i.view(torch.uint8), torch.zeros(4 * (len(i) % 2), dtype=torch.uint8), w.view(torch.uint8)]
    assert torch.equal(buf, torch.cat(want)), "packed wire format"
    # check: in range, then one index out of range in the first piece
    good = [(i, cur.numel() * cur.element_size() // 8) for (_, cur), (i, _, _) in zip(pairs, found) if i is not None]
    assert check_words_many(good, use_triton=True)
    bad = [(i.clone(), n) for i, n in good]
    bad[0][0][3] = bad[0][1]
    assert not check_words_many(bad, use_triton=True)
    bad[0][0][3] = -1
    assert not check_words_many(bad, use_triton=True)
    # the check without a host sync, a flag per piece (``Scatter.check``), and a scatter it guards: the bad
    # index's piece flagged alone, and nothing stored anywhere while ``flags[0]`` is raised
    from refit.delta.words import Scatter

    kept = [(b, i, w) for (b, _), (i, w, _) in zip(pairs, found) if i is not None]
    before = [bits(b).clone() for b, _, _ in kept]
    rows = [np.array([t.data_ptr() for t in ts], dtype=np.int64) for ts in zip(*kept)]
    k = np.array([len(i) for _, i, _ in kept], dtype=np.int64)
    n = np.array([b.numel() * b.element_size() // 8 for b, _, _ in kept], dtype=np.int64)
    j = int(np.flatnonzero(k)[-1])  # the last piece with changes: one index past its words
    saved = kept[j][1][0].item()
    kept[j][1][0] = int(n[j])
    scatter = Scatter.of(*rows, k, n, torch.device("cpu"))
    flags = torch.zeros(1 + len(scatter.pieces), dtype=torch.int32)
    scatter.check(flags)
    raised = [int(scatter.pieces[r]) for r, v in enumerate(flags[1:].tolist()) if v]
    assert flags[0] == 1 and raised == [j] and len(scatter.pieces) > 1, (flags, raised, j)
    scatter.apply(flag=flags)
    assert all(torch.equal(bits(b), old) for (b, _, _), old in zip(kept, before)), "a raised flag stores nothing"
    kept[j][1][0] = saved
    flags.zero_()
    scatter.check(flags)
    assert not flags.any()
    # scatter into the bases: they become the current versions
    items = [(b, i, w) for (b, _), (i, w, _) in zip(pairs, found) if i is not None]
    scatter_words_many(items, use_triton=True)
    for (b, c), (i, _, _) in zip(pairs, found):
        if i is not None:
            assert torch.equal(bits(b), bits(c))
    # a sender's base updates from packed payloads (``SourceBase.defer_packed``): held within the budget, those
    # held applied first where the next buffer would pass it, the rest at ``flush(final=True)``
    from refit.delta.base import SourceBase

    held = object.__new__(SourceBase)
    held.queued, held.packed, held.packed_bytes, held.budget, held.updating = [], [], 0, 100, None
    bases = [torch.zeros(8, dtype=torch.int64) for _ in range(3)]
    wanted = [torch.arange(8, dtype=torch.int64) + 10 * (j + 1) for j in range(3)]
    for j, (base, want) in enumerate(zip(bases, wanted)):  # each base's words 1, 4, 6 change, packed in a buffer
        idx = torch.tensor([1, 4, 6], dtype=torch.int32)
        buf = torch.cat([idx.view(torch.uint8), torch.zeros(4, dtype=torch.uint8), want[idx.long()].view(torch.uint8)])
        at = buf.data_ptr()
        rows = tuple(np.array([v], dtype=np.int64) for v in (base.data_ptr(), at, at + 16, 3, 8))
        held.defer_packed(rows, buf)  # 40 bytes each: the third would pass 100
        done = [torch.equal(b[[1, 4, 6]], w[[1, 4, 6]]) for b, w in zip(bases, wanted)]
        assert done == [j == 2] * 2 + [False], (j, done)  # the third's deferral applied the first two
        assert held.packed_bytes == (40 if j == 2 else 40 * (j + 1)), held.packed_bytes
    held.defer_packed(tuple(np.zeros(0, dtype=np.int64) for _ in range(5)), torch.zeros(64, dtype=torch.uint8))
    assert held.packed_bytes == 40, "a buffer that updates nothing is not held"
    held.flush(final=True)
    assert all(torch.equal(b[[1, 4, 6]], w[[1, 4, 6]]) for b, w in zip(bases, wanted)) and not held.packed
    assert all(int(b[[0, 2, 3, 5, 7]].abs().sum()) == 0 for b in bases), "only the packed words are written"
    # the torch path into a strided destination (the elements of each word)
    base, cur = versions(64 * 8, torch.bfloat16, 0.05)
    dst = torch.zeros(64, 16, dtype=torch.bfloat16)[:, :8]
    dst.copy_(base.view(64, 8))
    idx, words = find_words(base.view(64, 8), cur.view(64, 8))
    apply_words(dst, idx, words)
    assert torch.equal(bits(dst.contiguous()).reshape(-1), bits(cur))
    print("ALL OK")


if __name__ == "__main__":
    main()
