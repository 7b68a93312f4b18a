"""Double-buffered refit, commit by pointer swap (``refit.swap.SwapCommit``), on CPU gloo.

An engine stand-in reads its weights by reference (``holder["w"]``) on every pass; ``rebind`` points
it at the other set. Checked: every commit makes the engine read exactly v, passes during staging
read v-1 whole and never a mix, rollback switches back without a copy, a failed stage leaves the
live set and the version untouched, mismatched sets are refused before any process is involved.
"""

import time

import pytest
import torch

from refit.config import TransferConfig
from refit.errors import ConfigError, RefitAborted, RefitError
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.swap import SwapCommit, check_sets
from refit.tools.launch import run_local
from refit.tools.standin import ForwardLoop
from refit.tools.verify import holds, reference_shards
from test_overlap import mid_stage_fault


def _layouts():
    shapes = param_shapes("tiny-llama")
    return layout_from_spec(shapes, parse_spec("tp=1", "src")), layout_from_spec(shapes, parse_spec("tp=2", "dst"))


def _fingerprint(tensors):
    return tuple(float(tensors[n].double().sum()) for n in sorted(tensors))


def _setup(world, name, **cfg):
    """A trainer (process 0) and two engine ranks; the engine reads ``holder['w']`` (set A, version 0)."""
    src, dst = _layouts()
    is_src = world.src_rank is not None
    layout, rank = (src, 0) if is_src else (dst, world.dst_rank)
    tensors = reference_shards(layout, rank, 0)
    holder = {"w": tensors}
    config = TransferConfig(name=name, buffer_bytes=64 << 10, **cfg)
    if is_src:
        kw = {"src_tensors": tensors}
    else:
        spare = {n: torch.zeros_like(t) for n, t in tensors.items()}
        kw = {"sets": (tensors, spare), "rebind": lambda t: holder.__setitem__("w", t)}
    swap = SwapCommit(src, dst, world.rank, procs=ProcessMap.disjoint(1, 2), config=config, **kw)
    return swap, holder, (src, dst, layout, rank, is_src, tensors)


def _which(fps, out):
    return next((u for u, fp in fps.items() if fp == out), None)


def _swap_worker(world):
    """Versions 1, 2, 3, roll back to 2, then 4 (refit version v carries reference weights v)."""
    swap, holder, (src, dst, layout, rank, is_src, tensors) = _setup(world, "sw", deadline_s=30)
    fps = {v: _fingerprint(reference_shards(layout, rank, v)) for v in range(5)}
    loop = None if is_src else ForwardLoop(lambda: _fingerprint(holder["w"])).start()
    out, live = {"checks": [], "sets": []}, 0
    for v in (1, 2, 3, 4):
        if is_src:
            for n, t in reference_shards(src, 0, v).items():
                tensors[n].copy_(t)
        t0 = time.perf_counter()
        swap.stage(v)
        t1 = time.perf_counter()
        swap.commit(*((loop.pause, loop.resume) if loop else ()))
        out["sets"].append(swap.live)
        time.sleep(0.05)
        if loop is not None:
            t2 = time.perf_counter()
            seen = [_which(fps, o) for _, o in loop.between(t0, t2)]
            out["checks"].append(
                {
                    "v": v,
                    "staging_left_live_alone": {_which(fps, o) for _, o in loop.between(t0, t1)} <= {live},
                    "old_then_new_never_a_mix": bool(seen) and set(seen) <= {live, v} and seen == sorted(seen),
                    "reads_v_exactly": holds(holder["w"], dst, rank, v) and _which(fps, loop.records[-1][1]) == v,
                    "other_set_holds_old": holds(swap.sets[1 - swap.live], dst, rank, live) if v > 1 else True,
                    "rebound_not_copied": holder["w"] is swap.sets[swap.live],
                }
            )
        live = v
        if v == 3:  # back to version 2 by rebind, then on to 4 from there
            out["rolled_back_to"] = swap.rollback(*((loop.pause, loop.resume) if loop else ()))
            if loop is not None:
                out["after_rollback_exact"] = holds(holder["w"], dst, rank, 2) and holder["w"] is swap.sets[0]
            with pytest.raises(RefitError, match="nothing to restore"):
                swap.rollback()
            live = 2
    if loop is not None:
        loop.stop()
        out["extra_bytes"] = swap.extra_bytes
        out["share_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    out["version"] = swap.version
    swap.close()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_swap_commit_is_exact_over_versions_and_rolls_back_by_rebind():
    res = run_local(_swap_worker, 1, 2, timeout_s=150)
    assert res[0]["version"] == 4 and res[0]["rolled_back_to"] == 2
    for r in res:
        assert r["sets"] == [1, 0, 1, 1]  # v goes into the set not live; after the rollback to 2 (set A), B again
    for r in res[1:]:
        assert [c["v"] for c in r["checks"]] == [1, 2, 3, 4]
        for c in r["checks"]:
            assert all(c.values()), c
        assert r["rolled_back_to"] == 2 and r["after_rollback_exact"]
        assert r["version"] == 4
        assert r["extra_bytes"] == r["share_bytes"]  # one more share: the spare set


def _fault_worker(world, mode):
    swap, holder, (src, dst, layout, rank, is_src, tensors) = _setup(
        world, "swf", checksums=mode == "corrupt", deadline_s=4.0
    )
    if is_src:
        for n, t in reference_shards(src, 0, 1).items():
            tensors[n].copy_(t)
    swap.stage(1)
    swap.commit()
    if is_src:
        for n, t in reference_shards(src, 0, 2).items():
            tensors[n].copy_(t)
    fp1 = _fingerprint(reference_shards(layout, rank, 1))
    loop = None if is_src else ForwardLoop(lambda: _fingerprint(holder["w"])).start()
    hook = mid_stage_fault(swap.peers[0].executor, mode, world.rank == 1)  # v2 goes into set A (B is live)
    t0, error = time.perf_counter(), None
    try:
        swap.stage(2, fault_hook=hook)
    except RefitAborted as e:
        error = str(e)
    out = {"error": error, "version": swap.version, "live": swap.live}
    if loop is not None:
        time.sleep(0.1)  # the engine keeps generating on version 1
        seen = [o == fp1 for _, o in loop.between(t0, time.perf_counter())]
        loop.stop()
        out.update(
            passes=len(seen),
            all_v1=all(seen),
            v1_exact=holds(holder["w"], dst, rank, 1),
            same_set=holder["w"] is swap.tensors,
        )
        with pytest.raises(RefitError, match="no staged version"):
            swap.commit()
        with pytest.raises(RefitAborted, match="spent"):
            swap.stage(3)
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["kill", "corrupt"])
def test_a_failed_stage_leaves_the_live_set_and_version_untouched(mode):
    res = run_local(_fault_worker, 1, 2, mode, timeout_s=150, expect_dead={1} if mode == "kill" else set())
    survivors = [r for r in res if r is not None]
    assert len(survivors) == (2 if mode == "kill" else 3), res
    want = "process 1" if mode == "kill" else "checksum mismatch"
    assert all(r["error"] and want in r["error"] for r in survivors), [r["error"] for r in survivors]
    assert all(r["version"] == 1 and r["live"] == 1 for r in survivors), survivors
    engines = [r for r in survivors if "passes" in r]
    assert engines and all(r["passes"] > 0 and r["all_v1"] and r["v1_exact"] and r["same_set"] for r in engines), (
        engines
    )


def test_mismatched_sets_and_a_missing_rebind_are_refused():
    live = {"a": torch.zeros(4, 2), "b": torch.zeros(3)}
    src, dst = _layouts()
    with pytest.raises(ConfigError, match=r"tensor 'a': shape \(4, 2\) in the live set, \(2, 4\) in the spare"):
        check_sets((live, {"a": torch.zeros(2, 4), "b": torch.zeros(3)}))
    with pytest.raises(ConfigError, match="tensor 'b': dtype torch.float32 in the live set, torch.float16"):
        check_sets((live, {"a": torch.zeros(4, 2), "b": torch.zeros(3, dtype=torch.float16)}))
    with pytest.raises(ConfigError, match="'b' is in one set only"):
        check_sets((live, {"a": torch.zeros(4, 2)}))
    with pytest.raises(ConfigError, match="share storage .*'a'"):
        check_sets((live, {"a": live["a"].view(4, 2), "b": torch.zeros(3)}))
    with pytest.raises(ConfigError, match="two mappings"):
        check_sets(live)
    with pytest.raises(ConfigError, match="rebind"):
        SwapCommit(src, dst, 1, sets=(live, {n: torch.zeros_like(t) for n, t in live.items()}))
    with pytest.raises(ConfigError, match="callable rebind"):
        SwapCommit(src, dst, 1, sets=(live, {n: torch.zeros_like(t) for n, t in live.items()}), rebind=3)
    c = check_sets((live, {n: torch.zeros_like(t) for n, t in live.items()}))
    assert c[0]["a"] is live["a"] and c[1]["a"] is not live["a"]
