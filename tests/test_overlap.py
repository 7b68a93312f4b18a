"""Refit while generating (issue 21), engine-agnostic, on CPU gloo.

An engine stand-in (``refit.tools.standin.ForwardLoop``) runs a "forward pass" in a thread on the
live tensors the whole time; each pass records a fingerprint of what it read. Staging must leave
the live tensors alone (every pass during it reads v-1 whole), the commit pauses the loop for the
copy only, and every pass reads either v-1 or v, never a mix. Fleet commit over a fan-out, rollback
without the trainer, faults during an overlapped refit, the commit budget.
"""

import os
import signal
import time

import pytest
import torch

from refit.commit import StagedCommit, TokenVersions
from refit.config import TransferConfig
from refit.errors import ConfigError, FanoutError, RefitAborted, RefitError
from refit.fanout import Fanout
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.launch import run_local
from refit.tools.standin import ForwardLoop
from refit.tools.verify import holds, reference_shards
from refit.transfer import Peer

SLOW_STEP_S = 0.3  # the engine's receive is held this long mid-stage, so passes surely run during staging


def _layouts(src="tp=1", dst="tp=2"):
    shapes = param_shapes("tiny-llama")
    return layout_from_spec(shapes, parse_spec(src, "src")), layout_from_spec(shapes, parse_spec(dst, "dst"))


def _fingerprint(tensors):
    return tuple(float(tensors[n].double().sum()) for n in sorted(tensors))


def _seen(loop, t0, t1, versions):
    """The version each pass completed in [t0, t1] read (None: neither of ``versions``' fingerprints)."""
    return [next((v for v, fp in versions.items() if fp == out), None) for _, out in loop.between(t0, t1)]


def _slow_middle(peer):
    steps = peer.executor.steps
    middle = steps[len(steps) // 2] if steps else None

    def hook(where, info):
        if where == "step" and info["step"] is middle:
            time.sleep(SLOW_STEP_S)

    return hook


def _overlap_worker(world):
    src, dst = _layouts()
    procs = ProcessMap.disjoint(1, 2)
    is_src = world.src_rank is not None
    layout, rank = (src, 0) if is_src else (dst, world.dst_rank)
    tensors = reference_shards(layout, rank, 0)
    cfg = TransferConfig(name="ov", commit="staged", keep_previous=True, buffer_bytes=64 << 10, deadline_s=30)
    kw = {"src_tensors": tensors} if is_src else {"dst_tensors": tensors}
    peer = Peer(src, dst, world.rank, procs=procs, config=cfg, **kw)
    peer.run(1)
    out = {"role": "trainer" if is_src else "engine"}
    fps = {v: _fingerprint(reference_shards(layout, rank, v - 1)) for v in (1, 2, 3)}
    loop = None if is_src else ForwardLoop(lambda: _fingerprint(tensors)).start()
    live = 1  # the version the engine serves
    for v in (2, 3):
        out[f"v{v}_live_before"] = live
        if is_src:
            for n, t in reference_shards(src, 0, v - 1).items():
                tensors[n].copy_(t)
        t0 = time.perf_counter()
        peer.stage(v, fault_hook=None if is_src else _slow_middle(peer))
        t1 = time.perf_counter()
        if not is_src:
            out[f"v{v}_live_untouched_after_stage"] = holds(tensors, dst, rank, live - 1)
        out[f"v{v}_commit_s"] = peer.commit(*((loop.pause, loop.resume) if loop else ()))
        t2 = time.perf_counter()
        time.sleep(0.05)
        if loop is not None:
            out[f"v{v}_during_stage"] = _seen(loop, t0, t1, fps)
            out[f"v{v}_around"] = _seen(loop, t0, time.perf_counter(), fps)
            out[f"v{v}_exact"] = holds(tensors, dst, rank, v - 1)
            out[f"v{v}_stall"], out[f"v{v}_commit_window"] = loop.stall(t1, t2 + 0.05), t2 - t1
        live = v
        if v == 2 and loop is not None:  # roll back to version 1 without the trainer
            peer.rollback(loop.pause, loop.resume)
            out["rolled_back_to"], out["v1_exact_after_rollback"] = peer.version, holds(tensors, dst, rank, 0)
            live = 1
            with pytest.raises(RefitError, match="nothing to restore"):
                peer.rollback()
    if loop is not None:
        loop.stop()
        out["extra_bytes"] = peer.buffers.extra_bytes
        out["share_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    out["version"] = peer.version
    peer.close()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_staging_leaves_live_weights_alone_and_the_commit_switches_them_whole():
    res = run_local(_overlap_worker, 1, 2, timeout_s=150)
    for r in res[1:]:
        for v in (2, 3):
            assert r[f"v{v}_live_untouched_after_stage"], (v, r)
            before = r[f"v{v}_live_before"]  # 1 before version 3: version 2 was rolled back
            assert r[f"v{v}_during_stage"] and set(r[f"v{v}_during_stage"]) == {before}, r  # passes ran, on it
            seen = r[f"v{v}_around"]
            assert None not in seen, seen  # never a half-written version
            assert set(seen) == {before, v} and seen == sorted(seen), seen  # the old version ... then v ...
            assert r[f"v{v}_exact"]
        assert r["v3_live_before"] == 1 and r["rolled_back_to"] == 1 and r["v1_exact_after_rollback"]
        assert r["version"] == 3
        assert r["extra_bytes"] == 2 * r["share_bytes"]  # shadow + previous version
    assert res[0]["version"] == 3


def test_commit_budget_and_rollback_contract():
    live = {"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(4, 2)}
    share = 8 * 4 + 8 * 4
    with pytest.raises(ConfigError, match=f"commit_budget_bytes={2 * share - 1} .* needs {2 * share} bytes"):
        StagedCommit(live, keep_previous=True, budget=2 * share - 1)
    assert StagedCommit(live, budget=share).extra_bytes == share
    c = StagedCommit(live, keep_previous=True, budget=2 * share)
    with pytest.raises(RefitError, match="nothing to restore"):
        c.rollback()
    before = {n: t.clone() for n, t in live.items()}
    for t in c.shadow.values():
        t.fill_(7)
    calls = []
    c.commit(5, lambda: calls.append("pause"), lambda: calls.append("resume"))
    assert calls == ["pause", "resume"] and all(torch.all(t == 7) for t in live.values()) and c.version == 5
    assert c.rollback() is None and all(torch.equal(live[n], before[n]) for n in live)
    with pytest.raises(RefitError, match="keep_previous=True"):
        StagedCommit(live).rollback()
    with pytest.raises(ConfigError, match="keep_previous=True needs commit='staged'"):
        TransferConfig(keep_previous=True)
    with pytest.raises(ConfigError, match="commit_budget_bytes must be None or an integer >= 0, got -1"):
        TransferConfig(commit_budget_bytes=-1)
    for bad in (0, -5.0, float("nan"), float("inf"), True, "fast"):
        with pytest.raises(ConfigError, match=r"pull_gbps must be None or a finite number of GB/s > 0, got"):
            TransferConfig(pull_gbps=bad)
    assert TransferConfig(pull_gbps=250).pull_gbps == 250
    assert "pull_gbps" not in TransferConfig().agreement()  # a receiver's own pacing, not the wire's shape


def test_a_pace_that_would_outlast_half_the_deadline_is_refused_naming_both():
    from refit.plan import build_plan
    from refit.transport.ipc_pace import check_pace

    shapes = param_shapes("tiny-llama")
    src, dst = layout_from_spec(shapes, parse_spec("tp=1", "src")), layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    plan = build_plan(src, dst, ProcessMap((0,), (1,), ("cuda:0", "cuda:1")), TransferConfig(transport="ipc"))
    pulled = sum(p.nbytes for m in plan.messages for p in m.pieces)
    assert {m.transport for m in plan.messages} == {"ipc"} and pulled > 0
    slow = TransferConfig(transport="ipc", pull_gbps=pulled / 1e9 / 6, deadline_s=10)  # 6 s of pulls
    with pytest.raises(ConfigError, match=r"pull_gbps=.* paces process 1's .* GB of IPC pulls to at least 6\.0 s, "
                       r"more than half of deadline_s=10"):  # fmt: skip
        check_pace(plan, 1, slow)
    check_pace(plan, 0, slow)  # the source pulls nothing
    check_pace(plan, 1, TransferConfig(transport="ipc", pull_gbps=pulled / 1e9 / 4, deadline_s=10))  # 4 s: fine
    check_pace(plan, 1, TransferConfig(transport="ipc", deadline_s=10))  # no pace


def test_token_versions():
    tv = TokenVersions(((0, 1), (3, 2)), n_tokens=5)
    assert tv.per_token() == [1, 1, 1, 2, 2]
    assert TokenVersions(((0, 4),), n_tokens=2, aborted=True).per_token() == [4, 4]
    with pytest.raises(ValueError, match="start at index 0"):
        TokenVersions(((1, 1),), n_tokens=2)


# -- fleet commit over a fan-out --------------------------------------------------------------------
REPLICAS = 3


def _corrupt_every_message(where, info):
    if where == "received" and info["step"].recvs:
        info["step"].recvs[0].tensor.view(torch.uint8)[-1] ^= 0x10  # after the wire, before the check


def _fleet_worker(world, mode):
    trainer, replica = _layouts("tp=1", "tp=1")
    proc = world.rank
    tensors = reference_shards(trainer if proc == 0 else replica, 0, 0)
    cfg = TransferConfig(name="fleet", commit="staged", keep_previous=True, checksums=mode == "corrupt", deadline_s=4.0)
    f = Fanout(trainer, replica, proc, [0], [[1 + j] for j in range(REPLICAS)], tensors, config=cfg, max_attempts=2)
    f.run(1)
    fps = {v: _fingerprint(reference_shards(replica, 0, v - 1)) for v in (1, 2, 3)}
    loop = None if proc == 0 else ForwardLoop(lambda: _fingerprint(tensors)).start()
    out = {}
    for v in (2, 3):
        if proc == 0:
            for n, t in reference_shards(trainer, 0, v - 1).items():
                tensors[n].copy_(t)
        if v == 3 and proc == REPLICAS and mode == "kill":  # the last replica dies as its wave starts

            def hook(wave, attempt):
                if wave == 1:
                    os.kill(os.getpid(), signal.SIGKILL)

            f.hook = hook
        if v == 3 and proc == REPLICAS and mode == "corrupt":  # every message it receives arrives damaged
            f.fault_hook = _corrupt_every_message
        t0 = time.perf_counter()
        try:
            f.stage(v)
            f.commit(*((loop.pause, loop.resume) if loop else ()))
            out[f"v{v}"] = "committed"
        except FanoutError as e:
            out[f"v{v}"] = str(e)
        if loop is not None:
            time.sleep(0.05)
            out[f"v{v}_seen"] = _seen(loop, t0, time.perf_counter(), fps)
            out[f"v{v}_holds"] = next((u for u in (1, 2, 3) if holds(tensors, replica, 0, u - 1)), None)
        if v == 2 and loop is not None:
            f.rollback(loop.pause, loop.resume)
            out["after_rollback"] = (f.version, holds(tensors, replica, 0, 0))
    if loop is not None:
        loop.stop()
    out["version"] = f.version
    f.close()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["kill", "corrupt"])
def test_fleet_commits_every_replica_or_none_and_rolls_back_without_the_trainer(mode):
    # version 3: the last replica is killed as its wave starts, or (checksums on) every message it
    # receives is damaged, on every attempt: the fleet refuses the commit, every replica stays on version 1
    dead = {REPLICAS} if mode == "kill" else set()
    res = run_local(_fleet_worker, 1, REPLICAS, mode, timeout_s=200, expect_dead=dead)
    assert (res[REPLICAS] is None) == (mode == "kill")
    for proc, r in enumerate(res if mode == "corrupt" else res[:REPLICAS]):
        assert r["v2"] == "committed", r
        assert "fleet commit of version 3 refused" in r["v3"] and f"process {REPLICAS}" in r["v3"], r
        if mode == "corrupt":
            assert "checksum mismatch" in r["v3"], r
        if proc == 0:
            assert r["version"] == 2  # the trainer committed 2; 3 was refused
            continue
        assert r["v2_holds"] == 2 and r["after_rollback"] == (1, True)
        assert r["v3_holds"] == 1 and r["version"] == 1  # no replica committed 3: all serve version 1
        assert set(r["v3_seen"]) == {1}, r["v3_seen"]  # and kept generating on it the whole time
        assert None not in r["v2_seen"] and r["v2_seen"] == sorted(r["v2_seen"])


# -- faults during an overlapped refit ------------------------------------------------------------------
def mid_stage_fault(executor, mode, here):
    """A fault hook for ``executor``'s run: on the process where ``here`` is true, in the middle step,
    ``kill`` kills the process, ``corrupt`` flips a byte of the first message it received."""
    steps = executor.steps
    middle = steps[len(steps) // 2] if steps else None

    def hook(where, info):
        if not here or info.get("step") is not middle:
            return
        if mode == "kill" and where == "step":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "corrupt" and where == "received" and middle.recvs:
            middle.recvs[0].tensor.view(torch.uint8)[-1] ^= 0x10

    return hook


def _fault_worker(world, mode):
    src, dst = _layouts()
    procs = ProcessMap.disjoint(1, 2)
    is_src = world.src_rank is not None
    layout, rank = (src, 0) if is_src else (dst, world.dst_rank)
    tensors = reference_shards(layout, rank, 0)
    cfg = TransferConfig(
        name="ovf", commit="staged", checksums=mode == "corrupt", buffer_bytes=64 << 10, deadline_s=4.0
    )
    peer = Peer(
        src,
        dst,
        world.rank,
        procs=procs,
        config=cfg,
        **({"src_tensors": tensors} if is_src else {"dst_tensors": tensors}),
    )
    peer.run(1)
    if is_src:
        for n, t in reference_shards(src, 0, 1).items():
            tensors[n].copy_(t)
    fp1 = _fingerprint(reference_shards(layout, rank, 0))
    loop = None if is_src else ForwardLoop(lambda: _fingerprint(tensors)).start()
    hook = mid_stage_fault(peer.executor, mode, world.rank == 1)  # engine rank 0 fails
    t0, error = time.perf_counter(), None
    try:
        peer.stage(2, fault_hook=hook)
    except RefitAborted as e:
        error = str(e)
    out = {"error": error, "staged": peer.staged_version, "version": peer.version}
    if loop is not None:
        time.sleep(0.1)  # the engine keeps generating after the failed refit
        seen = [out == fp1 for _, out in loop.between(t0, time.perf_counter())]
        loop.stop()
        out.update(passes=len(seen), all_v1=all(seen), v1_exact=holds(tensors, dst, rank, 0))
        with pytest.raises(RefitError, match="no staged version"):
            peer.commit()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["kill", "corrupt"])
def test_a_fault_during_an_overlapped_refit_commits_nothing_and_engines_keep_serving(mode):
    res = run_local(_fault_worker, 1, 2, mode, timeout_s=150, expect_dead={1} if mode == "kill" else set())
    survivors = [r for r in res if r is not None]
    assert len(survivors) == (2 if mode == "kill" else 3)
    want = "process 1" if mode == "kill" else "checksum mismatch"
    assert all(r["error"] and want in r["error"] for r in survivors), [r["error"] for r in survivors]
    assert len({r["error"] for r in survivors}) == 1  # one message everywhere
    assert all(r["staged"] is None and r["version"] == 1 for r in survivors)
    engines = [r for r in survivors if "passes" in r]
    assert engines and all(r["passes"] > 0 and r["all_v1"] and r["v1_exact"] for r in engines)
