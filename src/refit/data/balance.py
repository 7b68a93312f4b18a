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
- the cost per rank is balanced — tokens by default, or any per-sample ``cost`` such as the
  estimated training FLOPs of ``sample_flops`` (a linear term plus attention's quadratic term:
  a 32k-token sample costs more than four 8k ones): groups are partitioned over ranks by
  Karmarkar-Karp's largest differencing method, or by longest-processing-time greedy where
  that leaves a smaller maximum (it bounds the heaviest rank: max <= mean + the costliest
  group, so max/mean <= 1.05 whenever no group costs more than 5% of a rank's mean); then each
  rank packs its own samples by tokens (first fit decreasing, the cap is on tokens whatever
  the cost); a rank with fewer bins than the most any rank has (or than ``min_microbatches``)
  splits its heaviest bin of two or more samples in two, until every rank has that many. If a
  rank got too few samples for that (one costly group can outweigh a rank of short ones), the
  groups are partitioned again with equal group counts per rank (greedy, heaviest first).
  Packing and splitting never move a sample between ranks, so the cost per rank is the
  partition's.

``shard_order`` / ``inverse_permutation`` / ``restore_order`` undo the reordering for per-sample
results (logprobs, values) that come back rank by rank.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import torch

from .inputs import check_lengths

Shards = list[list[list[int]]]  # rank -> microbatch -> sample indices


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """Indices of ``weights`` (ints or floats) split into ``k`` parts of near-equal sums
    (largest differencing method). Deterministic: ties broken by index."""
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, w in enumerate(weights):
        parts = [(w, [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-w, i, parts))  # spread = w - 0
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


def greedy_partition(weights: Sequence[float], k: int, max_per_part: int | None = None) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` parts, heaviest first into the lightest part
    (longest processing time) that holds fewer than ``max_per_part`` items (None: no limit).
    Without a limit its bound holds: the heaviest part is at most the mean part plus the largest
    weight. Deterministic: ties broken by index. ``ValueError`` when ``k < 1`` or the limit
    cannot hold every item."""
    if k < 1:
        raise ValueError(f"greedy_partition: k must be >= 1, got {k}")
    if max_per_part is not None and max_per_part * k < len(weights):
        raise ValueError(f"greedy_partition: max_per_part={max_per_part} x k={k} < {len(weights)} items")
    heap = [(0.0, p) for p in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda j: (-weights[j], j)):
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        if max_per_part is None or len(parts[p]) < max_per_part:  # a full part takes no more
            heapq.heappush(heap, (load + weights[i], p))
    return [sorted(p) for p in parts]


def _partition(weights: Sequence[float], k: int) -> list[list[int]]:
    """Karmarkar-Karp's parts, or the greedy ones where their heaviest part is lighter."""
    kk, lpt = karmarkar_karp(weights, k), greedy_partition(weights, k)
    heaviest = [max(sum(weights[i] for i in p) for p in parts) for parts in (kk, lpt)]
    return lpt if heaviest[1] < heaviest[0] else kk


def sample_flops(
    lengths: Sequence[int] | torch.Tensor, linear: float = 6 * 7e9, quadratic: float = 6 * 32 * 4096
) -> list[float]:
    """Estimated training FLOPs of each sample: ``linear * L + quadratic * L**2`` for a sequence
    of ``L`` tokens. Defaults describe a 7B dense model trained forward and backward: 6 FLOPs
    per parameter per token, and causal attention's score and value products, 6 * layers *
    hidden per pair of tokens (32 layers, hidden 4096) — the quadratic term is 15% of the
    linear one at 8k tokens, 60% at 32k. Pass your model's numbers (e.g. ``quadratic=0`` for
    tokens only). ``ValueError`` names a negative or non-finite coefficient or length."""
    lens = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    for name, c in (("linear", linear), ("quadratic", quadratic)):
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"sample_flops: {name} must be finite and >= 0, got {c}")
    neg = [i for i, n in enumerate(lens) if n < 0]
    if neg:
        raise ValueError(f"sample_flops: negative length {lens[neg[0]]} at sample {neg[0]}")
    return [linear * n + quadratic * n * n for n in lens]


def pack_microbatches(indices: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First fit decreasing: bins of at most ``budget`` tokens; a sample over ``budget`` is refused
    (``ValueError`` naming it and the budget), never put alone in an oversized bin."""
    over = next((i for i in indices if lengths[i] > budget), None)
    if over is not None:
        raise ValueError(f"pack_microbatches: sample {over} has {lengths[over]} tokens, over the budget of {budget}")
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


def _checked(
    lengths: Sequence[int] | torch.Tensor,
    dp_world: int,
    max_tokens_per_microbatch: int,
    group_size: int,
    min_microbatches: int,
    cost: Sequence[float] | torch.Tensor | None,
) -> tuple[list[int], list[float]]:
    """``balanced_shards``'s arguments checked: the lengths and the per-sample costs."""
    lens = check_lengths(lengths, "lengths", "balanced_shards")
    n = len(lens)
    if dp_world < 1:
        raise ValueError(f"balanced_shards: dp_world must be >= 1, got {dp_world}")
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"balanced_shards: max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    if group_size < 1 or n % group_size:
        raise ValueError(f"balanced_shards: group_size={group_size} must be >= 1 and divide the {n} samples")
    if min_microbatches < 1:
        raise ValueError(f"balanced_shards: min_microbatches must be >= 1, got {min_microbatches}")
    over = next((i for i, x in enumerate(lens) if x > max_tokens_per_microbatch), None)
    if over is not None:
        raise ValueError(
            f"balanced_shards: sample {over} has {lens[over]} tokens, over max_tokens_per_microbatch="
            f"{max_tokens_per_microbatch}: no microbatch can hold it (truncate or drop it, or raise the cap)"
        )
    if n // group_size < dp_world:
        raise ValueError(
            f"balanced_shards: {n // group_size} groups of {group_size} samples for dp_world={dp_world}: "
            f"every rank needs at least one"
        )
    if cost is None:
        return lens, [float(x) for x in lens]
    costs = [float(c) for c in (cost.tolist() if isinstance(cost, torch.Tensor) else cost)]
    if len(costs) != n:
        raise ValueError(f"balanced_shards: cost has {len(costs)} entries for {n} samples")
    bad = [i for i, c in enumerate(costs) if not (math.isfinite(c) and c >= 0)]
    if bad:
        raise ValueError(f"balanced_shards: cost {costs[bad[0]]} at sample {bad[0]} is not finite and >= 0")
    return lens, costs


def _equalize(packed: list[list[list[int]]], lens: list[int], m: int, budget: int, min_mb: int) -> None:
    """Split each rank's heaviest bin of two or more samples until it has ``m`` bins (in place)."""
    for rank, bins in enumerate(packed):
        while len(bins) < m:
            splittable = [b for b in bins if len(b) > 1]
            if not splittable:
                raise ValueError(
                    f"balanced_shards: DP rank {rank} holds {sum(len(b) for b in bins)} samples but every rank "
                    f"needs {m} microbatches (max_tokens_per_microbatch={budget}, "
                    f"min_microbatches={min_mb}); raise the token budget or give more samples"
                )
            big = max(splittable, key=lambda b: (sum(lens[i] for i in b), len(b)))
            bins.remove(big)
            bins.extend(_split(big, lens))


def balanced_shards(
    lengths: Sequence[int] | torch.Tensor,
    dp_world: int,
    max_tokens_per_microbatch: int,
    group_size: int = 1,
    min_microbatches: int = 1,
    cost: Sequence[float] | torch.Tensor | None = None,
) -> Shards:
    """See the module docstring. ``min_microbatches``: at least this many per rank (e.g. the
    pipeline depth). ``cost``: one number per sample that ranks are balanced by (default: the
    lengths, i.e. tokens; ``sample_flops(lengths)`` balances estimated compute); the token cap
    holds whatever it is. Raises ``ValueError`` naming the parameter and numbers for a bad
    argument (a degree, budget or count below 1, a negative length, ``group_size`` not dividing
    the samples, fewer groups than ranks, a cost per sample missing, negative or not finite) or
    when no valid sharding exists (fewer samples than microbatches needed on some rank).

    Deterministic. Ranks are ordered by their smallest sample index; a rank's microbatches run
    heaviest first, each listing its sample indices in ascending order."""
    lens, costs = _checked(lengths, dp_world, max_tokens_per_microbatch, group_size, min_microbatches, cost)
    weights = [sum(costs[g * group_size : (g + 1) * group_size]) for g in range(len(lens) // group_size)]

    def pack(parts: list[list[int]]) -> tuple[list[list[list[int]]], int]:
        ranks = [[i for g in part for i in range(g * group_size, (g + 1) * group_size)] for part in parts]
        ranks.sort(key=lambda r: r[0])  # deterministic rank order: by first sample
        packed = [pack_microbatches(r, lens, max_tokens_per_microbatch) for r in ranks]
        return packed, max(min_microbatches, max(len(p) for p in packed))

    packed, m = pack(_partition(weights, dp_world))
    if any(sum(len(b) for b in bins) < m for bins in packed):  # a rank too few samples for m microbatches:
        packed, m = pack(greedy_partition(weights, dp_world, -(-len(weights) // dp_world)))  # equal group counts
    _equalize(packed, lens, m, max_tokens_per_microbatch, min_microbatches)
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


def balance_stats(shards: Shards, lengths: Sequence[int], cost: Sequence[float] | None = None) -> dict[str, Any]:
    """Tokens per rank (``max_over_mean``, 1.0 when there are none; ``max_tokens``,
    ``min_tokens``), ``microbatches`` (the count per rank) and ``max_microbatch_tokens``; with
    ``cost`` (one number per sample, e.g. ``sample_flops``) also ``cost_max_over_mean``."""
    lens = [int(n) for n in lengths]
    tokens = [sum(lens[i] for mb in rank for i in mb) for rank in shards]
    mean = sum(tokens) / len(tokens)
    extra = {}
    if cost is not None:
        per_rank = [sum(float(cost[i]) for mb in rank for i in mb) for rank in shards]
        cmean = sum(per_rank) / len(per_rank)
        extra["cost_max_over_mean"] = max(per_rank) / cmean if cmean else 1.0
    return {
        **extra,
        "max_over_mean": max(tokens) / mean if mean else 1.0,
        "max_tokens": max(tokens),
        "min_tokens": min(tokens),
        "microbatches": [len(r) for r in shards],
        "max_microbatch_tokens": max(sum(lens[i] for i in mb) for r in shards for mb in r),
    }
