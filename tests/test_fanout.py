"""Fan-out on CPU gloo: waves from 1 trainer to 7 replicas (8 processes); a pipelined relay down a chain of 3."""

import json
import os

import pytest
import torch

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.fanout import Fanout, relay_waves, wave_plans, wave_schedule, waves_for
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.layout.tensors import box_intersect
from refit.plan import check_coverage
from refit.tools.launch import run_local
from refit.tools.verify import holds, reference_shards
from refit.transport.p2p import _Op, _Step, recv_ahead

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


# ---------------------------------------------------------------------------- the pipelined relay


def test_relay_plan_sends_one_copy_from_the_trainer_and_forwards_only_what_arrived():
    trainer, replica = _layouts("fsdp=2", "tp=1")
    cfg = TransferConfig(buffer_bytes=128 << 10)
    (wave,) = relay_waves(trainer, replica, [0, 1], [[2], [3], [4]], cfg)
    plan = wave.plan
    check_coverage(plan.dst_layout, [p for m in plan.messages for p in m.pieces] + list(plan.local))
    sent: dict[int, int] = {}
    arrived: dict[tuple[int, str], list] = {}
    for m in sorted(plan.messages, key=lambda m: m.step):
        sent[plan.procs.src[m.src]] = sent.get(plan.procs.src[m.src], 0) + sum(p.nbytes for p in m.pieces)
        for p in m.pieces:
            if plan.procs.src[m.src] >= 2:  # a relay forwards bytes that arrived in an earlier step
                got = [s for b, s in arrived[plan.procs.src[m.src], p.tensor] if box_intersect(b, p.box)]
                assert got and max(got) < m.step, (m, got)
            arrived.setdefault((plan.procs.dst[m.dst], p.tensor), []).append((p.box, m.step))
    model = replica.nbytes
    assert sent == {0: model // 2, 1: model // 2, 2: model, 3: model}  # a chain: the trainer's ranks send one copy
    chunks = -(-model // cfg.buffer_bytes)
    assert plan.num_steps <= chunks + 3  # pipelined: the last replica ends about two steps after the first
    into_first: dict[int, int] = {}  # bytes replica 0 receives per step: the trainer's stream fills each step
    for m in plan.messages:
        if plan.procs.dst[m.dst] == 2:
            into_first[m.step] = into_first.get(m.step, 0) + m.nbytes
    row = max(t.nbytes // t.shape[0] for t in replica)  # a window is cut at a row
    assert all(into_first[k] > cfg.buffer_bytes - row for k in range(max(into_first)))  # the last may be short
    # a dead relay is planned around: the chain skips it
    (wave,) = relay_waves(trainer, replica, [0, 1], [[2], [3], [4]], cfg, dead=frozenset({3}))
    assert wave.receivers == (0, 2) and 3 not in wave.members


def test_receives_are_posted_a_step_ahead_only_where_they_touch_nothing_the_step_before_uses():
    """``recv_ahead`` (the CPU executor posts step k+1's receives while step k is in flight): not into bytes a
    direct op of step k sends or receives, nor into a ring buffer step k uses; the first step never."""
    a, b = torch.zeros(32), torch.zeros(32)
    ring = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]

    def op(t, slot=-1):
        return _Op(1, 0, t, [(t.view(torch.uint8)[:4], a[:1])] if slot >= 0 else [], slot)

    before = _Step(sends=[op(a[0:10])], recvs=[op(ring[0], slot=0)])
    steps = [
        before,
        _Step(recvs=[op(b[0:8]), op(ring[1], slot=1)]),  # other bytes, the free buffer
        _Step(recvs=[op(b[4:12])]),  # overlaps a receive of the step before
        _Step(sends=[op(a[20:30])], recvs=[op(a[28:32])]),  # its own send: no matter
        _Step(recvs=[op(a[25:26])]),  # inside the send of the step before
        _Step(sends=[op(b[0:4])]),  # nothing to receive
        _Step(recvs=[op(ring[0], slot=0)]),  # a buffer the step before does not use (it uses none)
        _Step(recvs=[op(ring[0], slot=0)]),  # the buffer the step before receives into
    ]
    assert recv_ahead(steps) == [False, True, False, True, False, False, True, False]


def test_relay_refuses_what_it_cannot_do():
    trainer, replica = _layouts()
    for cfg, why in (
        (TransferConfig(transport="nixl"), "transport='p2p'"),
        (TransferConfig(delta="auto"), "deltas"),
    ):
        with pytest.raises(ConfigError, match=why):
            Fanout(trainer, replica, 0, [0], [[1]], {}, config=cfg, relay=1)
    with pytest.raises(ConfigError, match="CPU processes only"):
        Fanout(trainer, replica, 0, [0], [[1]], {}, devices=["cuda:0", "cuda:1"], relay=1)


def _die_in_step(n: int):
    """A fault hook that ends this process as its ``n``-th P2P step (from 0) is about to be posted."""
    steps = iter(range(10**6))
    return lambda where, info: os._exit(3) if where == "step" and next(steps) == n else None


def _relay_worker(world, kill_at):
    trainer, replica = _layouts("fsdp=2", "tp=1")
    proc, tprocs, rprocs = world.rank, [0, 1], [[2], [3], [4]]
    out = {}
    for mode in ("staged", "in_place"):
        if proc < 2:
            tensors = reference_shards(trainer, proc)
        else:
            tensors = {t.name: torch.full(t.shape, float("nan"), dtype=t.dtype) for t in replica}
        cfg = TransferConfig(name=f"relay-{mode}", commit=mode, deadline_s=20.0, preflight_timeout_s=120.0)
        f = Fanout(trainer, replica, proc, tprocs, rprocs, tensors, config=cfg, relay=1, relay_chunk_bytes=64 << 10)
        runs = []
        for v in (1, 2):
            if proc < 2 and v == 2:
                for t in tensors.values():
                    t.mul_(2)
            if mode == "in_place" and v == 2 and proc == kill_at:
                f.fault_hook = _die_in_step(5)
            s = f.run(v)
            exact = proc < 2 or holds(tensors, replica, 0, scale=2.0 ** (v - 1))
            runs.append({"exact": exact, "dead": s.dead, "attempts": s.attempts, "version": f.version})
        out[mode] = runs
        f.close()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_chain_of_three_replicas_relays_bit_exact_and_plans_around_a_relay_killed_mid_refit():
    # replica 0 (process 2) relays to replica 1, which relays to replica 2; in the in-place fan-out's second
    # version process 2 dies in its sixth step, mid-stream: the chain is rebuilt without it and the version sent again
    res = run_local(_relay_worker, 2, 3, 2, timeout_s=360, expect_dead={2})
    assert res[2] is None
    for proc in (0, 1, 3, 4):
        staged, in_place = res[proc]["staged"], res[proc]["in_place"]
        assert all(r["exact"] and r["dead"] == [] for r in staged), (proc, staged)
        assert [r["version"] for r in in_place] == [1, 2] and all(r["exact"] for r in in_place), (proc, in_place)
        assert in_place[1]["dead"] == [2], (proc, in_place)
    assert res[0]["in_place"][1]["attempts"] == 2  # the relay wave, then again without the dead relay
