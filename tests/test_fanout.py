"""Fan-out waves on CPU gloo: 1 trainer -> 7 replicas (8 processes)."""

import json
import os

import pytest
import torch

from refit.config import TransferConfig
from refit.fanout import Fanout, wave_plans, wave_schedule, waves_for
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.launch import run_local
from refit.tools.verify import holds, reference_shards

REPLICAS = 7


def _layouts(src="tp=1", dst="tp=1"):
    shapes = param_shapes("tiny-llama")
    return layout_from_spec(shapes, parse_spec(src, "src")), layout_from_spec(shapes, parse_spec(dst, "dst"))


def test_schedule_doubles_holders():
    assert wave_schedule(7) == [[0], [1, 2], [3, 4, 5, 6]]
    assert wave_schedule(1) == [[0]]
    assert wave_schedule(4) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        wave_schedule(0)


def test_wave_plans_spread_receivers_and_balance_bytes():
    trainer, replica = _layouts()
    waves = waves_for(trainer, replica, [0], [[1 + j] for j in range(REPLICAS)])
    plans = wave_plans(waves)
    json.dumps(plans)  # serializable
    last = plans[-1]
    assert last["receivers"] == [3, 4, 5, 6] and last["sources"] == ["trainer", 0, 1, 2]
    # every receiver gets the whole model; sources are spread: each of the 4 holders sends
    sent: dict[str, int] = {}
    for row in last["links"].values():
        for src, pieces in row.items():
            sent[src] = sent.get(src, 0) + len(pieces)
    assert set(sent) == {"0", "1", "2", "3"}
    # a dead replica is neither a source nor a receiver
    waves = waves_for(trainer, replica, [0], [[1 + j] for j in range(REPLICAS)], dead=frozenset({2}))
    assert all(1 not in w.sources and 1 not in w.receivers for w in waves)
    assert 2 not in {p for w in waves for p in w.members}


def _worker(world, kill, versions):
    trainer, replica = _layouts()
    proc = world.rank
    replica_procs = [[1 + j] for j in range(REPLICAS)]
    if proc == 0:
        tensors = reference_shards(trainer, 0)
    else:
        tensors = {
            t.name: torch.full(b_shape, float("nan"), dtype=t.dtype)
            for t, b_shape in ((t, tuple(hi - lo for lo, hi in t.box(0))) for t in replica)
        }
    cfg = TransferConfig(name="fan", deadline_s=8.0, preflight_timeout_s=60.0)
    f = Fanout(trainer, replica, proc, [0], replica_procs, tensors, config=cfg)
    out = []
    for v in versions:
        if proc == 0 and v > versions[0]:
            for t in tensors.values():
                t.mul_(2)  # a new version: the trainer's weights change in place
        if kill is not None and proc == kill[0] and v == kill[2]:

            def hook(wave, attempt, k=kill):
                if wave == k[1]:
                    os._exit(3)  # a source dies as its wave starts; its receivers are mid-wave

            f.hook = hook
        s = f.run(v)
        scale = 2.0 ** (v - versions[0])
        ok = proc == 0 or holds(tensors, replica, 0, scale=scale)
        out.append(
            {
                "version": v,
                "ok": ok,
                "dead": s.dead,
                "sources_seen": s.sources_seen,
                "waves": s.waves,
                "attempts": s.attempts,
                "my_version": f.version,
            }
        )
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(280)
def test_one_trainer_to_seven_replicas_in_waves_bit_exact():
    res = run_local(_worker, 1, REPLICAS, None, [1, 2], timeout_s=240)
    for proc, runs in enumerate(res):
        for r in runs:
            assert r["ok"], (proc, r)
            assert r["my_version"] == r["version"]
            assert all(v == r["version"] for _, _, _, v in r["sources_seen"]), r  # only exact-version sources
    assert res[0][0]["waves"] == 3 and res[0][0]["dead"] == []
    # replicas of the last wave pulled from replicas of earlier waves
    seen = {p for runs in res[4:] for r in runs for _, _, p, _ in r["sources_seen"]}
    assert seen == {1, 2, 3}


@pytest.mark.multiproc
@pytest.mark.timeout(280)
def test_a_source_killed_mid_wave_does_not_fail_the_refit():
    # replica 1 (process 2) received in wave 1; it dies as wave 2 starts, where it is a source
    res = run_local(_worker, 1, REPLICAS, (2, 2, 2), [1, 2], timeout_s=240, expect_dead={2})
    assert res[2] is None
    for proc, runs in enumerate(res):
        if runs is None:
            continue
        v1, v2 = runs
        assert v1["ok"] and v2["ok"], (proc, runs)
        assert v2["my_version"] == 2
        assert all(v == 2 for _, _, _, v in v2["sources_seen"])
        last = max((a for w, a, _, _ in v2["sources_seen"] if w == 2), default=None)
        if last is not None:  # the attempt that completed wave 2 did not use the dead source
            assert last >= 1 and all(p != 2 for w, a, p, _ in v2["sources_seen"] if w == 2 and a == last)
    assert res[0][1]["dead"] == [2] and res[0][1]["attempts"] == 4  # waves 0, 1, then wave 2 twice
