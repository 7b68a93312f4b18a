"""Leader fetch inside model-parallel groups, and DP ranks fetching their balanced shares
(multi-process, gloo)."""

import pytest
import torch
import torch.distributed as dist

from refit.data import InProcessStore, LeaderFetchError, balanced_shards, leader_fetch, replica_groups, restore_order
from refit.tools.launch import run_local

pytestmark = pytest.mark.multiproc

N = 24


class Forbidden:
    """A store the non-leaders hold: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"non-leader touched the store ({name})")


def _rollouts():
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(3, 40, (N,), generator=g)
    return {
        "ids": torch.randint(0, 1000, (N, 40), generator=g),
        "logprobs": torch.randn(N, 40, generator=g).to(torch.bfloat16),
        "adv": torch.randn(N, generator=g),
        "tokens": [torch.arange(int(n), dtype=torch.int32) for n in lens],
    }, lens.tolist()


def _filled_store():
    store = InProcessStore()
    data, lens = _rollouts()
    store.put([f"s{i}" for i in range(N)], data, partition="train", seq_lens=lens)
    return store


def _worker(world, mp_size):
    group, dp_rank = replica_groups(mp_size)
    dp_world = world.world_size // mp_size
    leader = dist.get_rank(group) == 0
    data, lens = _rollouts()
    shards = balanced_shards(lens, dp_world, 64)  # the driver's plan: same on every rank
    mine = [i for mb in shards[dp_rank] for i in mb]
    keys = [f"s{i}" for i in mine]
    store = _filled_store() if leader else Forbidden()
    got = leader_fetch(store, keys, ["ids", "logprobs", "adv", "tokens"], group=group, partition="train")
    assert got["logprobs"].dtype == torch.bfloat16
    assert torch.equal(got["logprobs"].view(torch.int16), data["logprobs"][mine].view(torch.int16))
    assert torch.equal(got["ids"], data["ids"][mine]) and got["adv"].dim() == 1
    assert torch.equal(got["adv"], data["adv"][mine])
    assert [t.tolist() for t in got["tokens"]] == [data["tokens"][i].tolist() for i in mine]
    # a failed fetch on the leader raises on every rank of the group, no hang
    try:
        leader_fetch(store, keys, ["ids", "missing"], group=group, partition="train")
        err = None
    except LeaderFetchError as e:
        err = str(e)
    # each replica "trains": a per-sample result, gathered rank by rank
    result = (got["adv"] * 2).tolist()
    return dp_rank, leader, err, result, shards


@pytest.mark.timeout(240)
def test_leader_fetch_and_balanced_shares():
    out = run_local(_worker, 4, 0, 2, timeout_s=180)
    for _, _, err, _, _ in out:
        assert err is not None and "field 'missing' was never produced" in err
    shards = out[0][4]
    per_rank = [torch.tensor(next(r for d, lead, _, r, _ in out if d == k and lead)) for k in range(2)]
    data, _ = _rollouts()
    assert torch.equal(restore_order(per_rank, shards), data["adv"] * 2)  # original order back
    # both members of a replica got identical data
    for k in range(2):
        res = [r for d, _, _, r, _ in out if d == k]
        assert res[0] == res[1]


def _no_store_worker(world):
    group, _ = replica_groups(2)
    try:
        leader_fetch(None, ["s0"], ["ids"], group=group)
    except LeaderFetchError as e:
        return str(e)
    return None


def test_leader_without_store_fails_everywhere():
    out = run_local(_no_store_worker, 2, 0, timeout_s=120)
    assert all(e is not None and "was given no store" in e for e in out)
