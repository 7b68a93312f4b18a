"""Balanced data-parallel sharding with sequence packing — pure functions, computed once on the
driver from sequence lengths alone.

``balanced_shards(lengths, dp_world, max_tokens_per_microbatch, group_size=1)`` returns, for
each DP rank, its microbatches (lists of sample indices) such that

- every sample appears exactly once;
- every rank has the same number of microbatches (a rank that finishes its microbatches early
  would wait forever at the next cross-DP collective: the total bin count is a multiple of
  ``dp_world``);
- no microbatch holds more than ``max_tokens_per_microbatch`` tokens unless it is a single
  sample that alone exceeds it;
- the ``group_size`` consecutive samples of a GRPO group land on one rank;
- token totals per rank are balanced: groups are partitioned over ranks by Karmarkar-Karp's
  largest differencing method, then each rank packs its own samples (first fit decreasing);
  a rank with fewer bins than the most any rank has (or than ``min_microbatches``) splits its
  heaviest bin of two or more samples in two, until every rank has that many.

``shard_order`` / ``inverse_permutation`` / ``restore_order`` undo the reordering for per-sample
results (logprobs, values) that come back rank by rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import torch

Shards = list[list[list[int]]]  # rank -> microbatch -> sample indices


def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` parts of near-equal sums (largest differencing
    method). Deterministic: ties broken by index."""
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, w in enumerate(weights):
        parts = [(int(w), [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-int(w), i, parts))  # spread = w - 0
    if not heap:
        return [[] for _ in range(k)]
    tie = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # largest sums of a with smallest of b (both sorted descending)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda p: (-p[0], min(p[1]) if p[1] else len(weights)))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(idx) for _, idx in heap[0][2]]


def pack_microbatches(indices: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First fit decreasing: bins of at most ``budget`` tokens (an oversized sample alone)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= budget:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def _split(mb: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two halves of near-equal tokens, both non-empty (``mb`` has >= 2 samples)."""
    a: list[int] = []
    b: list[int] = []
    ta = tb = 0
    for i in sorted(mb, key=lambda j: (-lengths[j], j)):
        if ta <= tb:
            a.append(i)
            ta += lengths[i]
        else:
            b.append(i)
            tb += lengths[i]
    return a, b


def balanced_shards(
    lengths: Sequence[int] | torch.Tensor,
    dp_world: int,
    max_tokens_per_microbatch: int,
    group_size: int = 1,
    min_microbatches: int = 1,
) -> Shards:
    """See the module docstring. ``min_microbatches``: at least this many per rank (e.g. the
    pipeline depth). Raises ``ValueError`` naming the parameter and numbers for a bad argument
    (a degree, budget or count below 1, a negative length, ``group_size`` not dividing the
    samples, fewer groups than ranks) or when no valid sharding exists (fewer samples than
    microbatches needed on some rank).

    Deterministic. Ranks are ordered by their smallest sample index; a rank's microbatches run
    heaviest first, each listing its sample indices in ascending order."""
    lens = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    n = len(lens)
    if dp_world < 1:
        raise ValueError(f"balanced_shards: dp_world must be >= 1, got {dp_world}")
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"balanced_shards: max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    if group_size < 1 or n % group_size:
        raise ValueError(f"balanced_shards: group_size={group_size} must be >= 1 and divide the {n} samples")
    if min_microbatches < 1:
        raise ValueError(f"balanced_shards: min_microbatches must be >= 1, got {min_microbatches}")
    neg = [i for i, x in enumerate(lens) if x < 0]
    if neg:
        raise ValueError(f"balanced_shards: negative length {lens[neg[0]]} at sample {neg[0]}")
    groups = n // group_size
    if groups < dp_world:
        raise ValueError(
            f"balanced_shards: {groups} groups of {group_size} samples for dp_world={dp_world}: "
            f"every rank needs at least one"
        )
    weights = [sum(lens[g * group_size : (g + 1) * group_size]) for g in range(groups)]
    ranks = [
        [i for g in part for i in range(g * group_size, (g + 1) * group_size)]
        for part in karmarkar_karp(weights, dp_world)
    ]
    ranks.sort(key=lambda r: r[0])  # deterministic rank order: by first sample
    packed = [pack_microbatches(r, lens, max_tokens_per_microbatch) for r in ranks]
    m = max(min_microbatches, max(len(p) for p in packed))
    for rank, bins in enumerate(packed):
        while len(bins) < m:
            splittable = [b for b in bins if len(b) > 1]
            if not splittable:
                raise ValueError(
                    f"balanced_shards: DP rank {rank} holds {len(ranks[rank])} samples but every rank needs {m} "
                    f"microbatches (max_tokens_per_microbatch={max_tokens_per_microbatch}, "
                    f"min_microbatches={min_microbatches}); raise the token budget or give more samples"
                )
            big = max(splittable, key=lambda b: (sum(lens[i] for i in b), len(b)))
            bins.remove(big)
            bins.extend(_split(big, lens))
    return [sorted((sorted(b) for b in bins), key=lambda b: (-sum(lens[i] for i in b), b)) for bins in packed]


def shard_order(shards: Shards) -> list[int]:
    """``perm[j]``: the original index of the j-th sample when ranks' samples are concatenated
    (rank by rank, microbatch by microbatch)."""
    return [i for rank in shards for mb in rank for i in mb]


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[perm[j]] == j``; ``ValueError`` if ``perm`` is not a permutation of
    ``range(len(perm))``."""
    inv = [-1] * len(perm)
    for j, i in enumerate(perm):
        if not 0 <= i < len(perm) or inv[i] != -1:
            raise ValueError(f"inverse_permutation: not a permutation of range({len(perm)}) (entry {i} at {j})")
        inv[i] = j
    return inv


def restore_order(per_rank: Sequence[Any], shards: Shards) -> Any:
    """Per-sample results returned rank by rank (each rank's in its microbatch order: a tensor
    with one row per sample, or a list) back in the original sample order."""
    if len(per_rank) != len(shards):
        raise ValueError(f"restore_order: {len(per_rank)} results for {len(shards)} ranks")
    for r, (res, rank) in enumerate(zip(per_rank, shards)):
        want = sum(len(mb) for mb in rank)
        if len(res) != want:
            raise ValueError(f"restore_order: rank {r} returned {len(res)} rows for its {want} samples")
    inv = inverse_permutation(shard_order(shards))
    if all(isinstance(x, torch.Tensor) for x in per_rank):
        return torch.cat(list(per_rank)).index_select(0, torch.tensor(inv, dtype=torch.long))
    flat = [x for res in per_rank for x in res]
    return [flat[j] for j in inv]


def balance_stats(shards: Shards, lengths: Sequence[int]) -> dict[str, Any]:
    """Tokens per rank (``max_over_mean``, 1.0 when there are none; ``max_tokens``,
    ``min_tokens``), ``microbatches`` (the count per rank) and ``max_microbatch_tokens``."""
    lens = [int(n) for n in lengths]
    tokens = [sum(lens[i] for mb in rank for i in mb) for rank in shards]
    mean = sum(tokens) / len(tokens)
    return {
        "max_over_mean": max(tokens) / mean if mean else 1.0,
        "max_tokens": max(tokens),
        "min_tokens": min(tokens),
        "microbatches": [len(r) for r in shards],
        "max_microbatch_tokens": max(sum(lens[i] for i in mb) for r in shards for mb in r),
    }
