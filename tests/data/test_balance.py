"""Invariants of balanced DP sharding with packing (property-tested)."""

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from refit.data import (
    balance_stats,
    balanced_shards,
    greedy_partition,
    inverse_permutation,
    karmarkar_karp,
    restore_order,
    sample_flops,
    shard_order,
)


@st.composite
def problems(draw):
    dp = draw(st.integers(1, 8))
    group = draw(st.sampled_from([1, 1, 2, 4]))
    groups = draw(st.integers(dp, 40))
    budget = draw(st.integers(16, 4096))
    # long-tailed: mostly short, a few near or at the budget (a sample over it is refused)
    lens = draw(
        st.lists(
            st.one_of(st.integers(1, min(64, budget)), st.integers(1, budget)),
            min_size=groups * group,
            max_size=groups * group,
        )
    )
    return lens, dp, budget, group


def _check(shards, lens, dp, budget, group):
    assert len(shards) == dp
    flat = shard_order(shards)
    assert sorted(flat) == list(range(len(lens)))  # every sample exactly once
    assert len({len(r) for r in shards}) == 1  # equal microbatch counts
    for rank in shards:
        for mb in rank:
            assert mb, "empty microbatch"
            tokens = sum(lens[i] for i in mb)
            assert tokens <= budget, (tokens, budget, mb)
    rank_of = {i: r for r, rank in enumerate(shards) for mb in rank for i in mb}
    for g in range(len(lens) // group):
        assert len({rank_of[i] for i in range(g * group, (g + 1) * group)}) == 1  # a group on one rank


@given(problems())
def test_invariants(p):
    lens, dp, budget, group = p
    try:
        shards = balanced_shards(lens, dp, budget, group_size=group)
    except ValueError as e:  # only when some rank has too few samples for the common count
        assert "microbatches" in str(e) and "DP rank" in str(e)
        return
    _check(shards, lens, dp, budget, group)


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60), st.integers(1, 9))
def test_karmarkar_karp_partitions(weights, k):
    parts = karmarkar_karp(weights, k)
    assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(weights)))
    sums = sorted(sum(weights[i] for i in p) for p in parts)
    # LDM is at least as good as the trivial bound: spread <= the largest item
    assert sums[-1] - sums[0] <= max(weights)


def _long_tail(n, seed=0, cap=16_384):
    """Lognormal lengths within ``cap`` tokens (a sample over the cap is refused)."""
    rng = np.random.default_rng(seed)
    return (np.minimum(rng.lognormal(7.0, 1.0, n), cap - 16).astype(int) + 16).tolist()


def test_long_tail_balance_8_ranks_1024_samples():
    lens = _long_tail(1024)
    shards = balanced_shards(lens, 8, 16_384)
    _check(shards, lens, 8, 16_384, 1)
    s = balance_stats(shards, lens)
    assert s["max_over_mean"] <= 1.05, s
    grouped = balanced_shards(lens, 8, 16_384, group_size=16)
    _check(grouped, lens, 8, 16_384, 16)
    assert balance_stats(grouped, lens)["max_over_mean"] <= 1.05


def test_long_tail_many_seeds_equal_counts():
    for seed in range(20):
        lens = _long_tail(256, seed, cap=8192)
        shards = balanced_shards(lens, 4, 8192, min_microbatches=4)
        _check(shards, lens, 4, 8192, 1)
        assert len(shards[0]) >= 4


def test_counts_equalized_by_splitting():
    # rank loads equal, but one rank's samples pack into fewer bins: it must split one
    lens = [10] * 8 + [40, 40]
    shards = balanced_shards(lens, 2, 40)
    _check(shards, lens, 2, 40, 1)


def test_infeasible_names_numbers():
    with pytest.raises(ValueError, match=r"DP rank \d holds 2 samples but every rank needs 3 microbatches"):
        balanced_shards([5, 5, 5, 5], 2, 10, min_microbatches=3)
    # one rank of the cost-balanced split would hold too few samples: equal group counts instead
    shards = balanced_shards([100, 10, 10, 10, 10, 100, 5, 5], 4, 100)
    _check(shards, [100, 10, 10, 10, 10, 100, 5, 5], 4, 100, 1)
    with pytest.raises(ValueError, match="group_size=3 must be >= 1 and divide the 8 samples"):
        balanced_shards([1] * 8, 2, 10, group_size=3)
    with pytest.raises(ValueError, match="dp_world must be >= 1"):
        balanced_shards([1] * 8, 0, 10)
    with pytest.raises(ValueError, match="3 groups of 1 samples for dp_world=4"):
        balanced_shards([1, 2, 3], 4, 10)


@given(problems())
def test_restore_order_round_trip(p):
    lens, dp, budget, group = p
    try:
        shards = balanced_shards(lens, dp, budget, group_size=group)
    except ValueError:
        return
    values = torch.arange(len(lens)) * 10
    per_rank = [values[[i for mb in rank for i in mb]] for rank in shards]  # what ranks return
    assert torch.equal(restore_order(per_rank, shards), values)
    as_lists = [[f"s{i}" for mb in rank for i in mb] for rank in shards]
    assert restore_order(as_lists, shards) == [f"s{i}" for i in range(len(lens))]
    perm = shard_order(shards)
    inv = inverse_permutation(perm)
    assert [perm[inv[i]] for i in range(len(lens))] == list(range(len(lens)))


def test_restore_order_checks_sizes():
    shards = balanced_shards([5, 5, 5, 5], 2, 10)
    with pytest.raises(ValueError, match="rank 1 returned 1 rows for its 2 samples"):
        restore_order([torch.zeros(2), torch.zeros(1)], shards)
    with pytest.raises(ValueError, match="not a permutation"):
        inverse_permutation([0, 0, 1])


@st.composite
def long_tailed(draw, groups_per_rank=(8, 64), group_sizes=(1, 4, 8)):
    """Lognormal or Pareto lengths (seeded numpy draws), every sample within the token cap."""
    dp = draw(st.sampled_from([2, 4, 8]))
    group = draw(st.sampled_from(group_sizes))
    groups_per_rank = draw(st.integers(*groups_per_rank))
    cap = draw(st.sampled_from([4096, 8192, 32_768]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = dp * groups_per_rank * group
    if draw(st.booleans()):
        raw = rng.lognormal(np.log(cap / draw(st.sampled_from([8, 16, 32]))), draw(st.floats(0.5, 1.5)), n)
        kind = "lognormal"
    else:
        raw = (cap / 64) * (1 + rng.pareto(draw(st.floats(1.1, 3.0)), n))
        kind = "pareto"
    lens = np.clip(raw.astype(int), 1, cap).tolist()
    return lens, dp, cap, group, kind


def _flops_per_rank(shards, flops):
    return [sum(flops[i] for mb in rank for i in mb) for rank in shards]


@settings(max_examples=60, deadline=None)
@given(long_tailed())
def test_flops_balance_holds_token_cap_counts_and_groups(p):
    """Balanced by estimated FLOPs: max <= mean + the costliest group (the greedy bound), hence
    max/mean <= 1.05 wherever no group costs more than 5% of a rank's mean (asserted when so);
    the token cap holds in every microbatch, counts are equal, groups stay on one rank."""
    lens, dp, cap, group, _ = p
    flops = sample_flops(lens)
    shards = balanced_shards(lens, dp, cap, group_size=group, cost=flops)
    _check(shards, lens, dp, cap, group)
    assert all(sum(lens[i] for i in mb) <= cap for rank in shards for mb in rank)  # cap held: no sample exceeds it
    per_rank = _flops_per_rank(shards, flops)
    mean = sum(per_rank) / dp
    heaviest_group = max(sum(flops[g * group : (g + 1) * group]) for g in range(len(lens) // group))
    assert max(per_rank) <= mean + heaviest_group + 1e-6 * mean
    if heaviest_group <= 0.05 * mean:
        assert max(per_rank) / mean <= 1.05
    assert balance_stats(shards, lens, cost=flops)["cost_max_over_mean"] == pytest.approx(max(per_rank) / mean)


@settings(max_examples=25, deadline=None)
@given(long_tailed(groups_per_rank=(100, 300), group_sizes=(1, 4)))
def test_flops_balance_within_5_percent_on_long_tails(p):
    """The <= 1.05 target itself, on instances that allow it (no group above 5% of a rank's
    mean FLOPs: enough groups per rank for the tail; about two thirds of these draws)."""
    lens, dp, cap, group, _ = p
    flops = sample_flops(lens)
    mean = sum(flops) / dp
    assume(max(sum(flops[g * group : (g + 1) * group]) for g in range(len(lens) // group)) <= 0.05 * mean)
    shards = balanced_shards(lens, dp, cap, group_size=group, cost=flops)
    assert max(_flops_per_rank(shards, flops)) / mean <= 1.05


def test_flops_balance_beats_token_balance_on_compute():
    """Balancing tokens leaves compute unbalanced when lengths differ a lot; balancing FLOPs
    fixes it (the numbers the benchmark reports)."""
    rng = np.random.default_rng(0)
    lens = np.clip((512 * (1 + rng.pareto(1.2, 1024))).astype(int), 1, 32_768).tolist()
    flops = sample_flops(lens)
    by_tokens = balance_stats(balanced_shards(lens, 8, 32_768), lens, cost=flops)
    by_flops = balance_stats(balanced_shards(lens, 8, 32_768, cost=flops), lens, cost=flops)
    assert by_flops["cost_max_over_mean"] <= 1.05 and by_flops["cost_max_over_mean"] <= by_tokens["cost_max_over_mean"]


def test_sample_flops_and_cost_errors_name_values():
    assert sample_flops([0, 1, 2], linear=1.0, quadratic=1.0) == [0.0, 2.0, 6.0]
    with pytest.raises(ValueError, match="quadratic must be finite and >= 0, got -1"):
        sample_flops([1], quadratic=-1)
    with pytest.raises(ValueError, match="negative length -3 at sample 1"):
        sample_flops([1, -3])
    with pytest.raises(ValueError, match="cost has 2 entries for 4 samples"):
        balanced_shards([1, 2, 3, 4], 2, 10, cost=[1.0, 2.0])
    with pytest.raises(ValueError, match="cost nan at sample 0 is not finite"):
        balanced_shards([1, 2], 2, 10, cost=[float("nan"), 1.0])
    assert sorted(i for p in greedy_partition([5, 1, 4, 2], 2) for i in p) == [0, 1, 2, 3]
