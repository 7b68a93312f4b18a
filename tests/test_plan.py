from collections import defaultdict
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout import (
    Mesh,
    ModelLayout,
    TensorLayout,
    box_intersect,
    box_is_contiguous,
    box_relative,
    box_shape,
    box_slices,
)
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import PlanError, ProcessMap, build_plan, check_coverage
from strategies import layout_pairs


def _all_pieces(plan):
    return [p for m in plan.messages for p in m.pieces] + list(plan.local)


@given(layout_pairs(), st.integers(1, 3), st.sampled_from([64, 128, 1024, 1 << 20]))
def test_plan_covers_every_destination_element_exactly_once(pair, num_buffers, buffer_bytes):
    src, dst = pair
    plan = build_plan(src, dst, config=TransferConfig(num_buffers=num_buffers, buffer_bytes=buffer_bytes))
    counts = {}
    for t in dst:
        for r in t.ranks:
            counts[(t.name, r)] = torch.zeros(tuple(b - a for a, b in t.box(r)), dtype=torch.int32)
    for p in _all_pieces(plan):
        # the chosen source really holds the box
        assert box_intersect(p.box, src[p.tensor].box(p.src)) == p.box
        dbox = dst[p.tensor].box(p.dst)
        rel = tuple((a - o, b - o) for (a, b), (o, _) in zip(p.box, dbox))
        counts[(p.tensor, p.dst)][box_slices(rel)] += 1
    assert all(bool((c == 1).all()) for c in counts.values())
    check_coverage(dst, _all_pieces(plan))  # the planner's own checker agrees
    # a direct (unpacked) message is one contiguous run in both local tensors
    for m in plan.messages:
        if m.direct and m.transport == "p2p":
            (p,) = m.pieces
            for side, rank in ((src, p.src), (dst, p.dst)):
                own = side[p.tensor].box(rank)
                assert box_is_contiguous(box_relative(p.box, own), box_shape(own))
    # minimal traffic: nothing but what destinations hold crosses a link
    assert plan.bytes_moved == plan.bytes_needed
    # bounded memory: no process stages more than the budget in any step
    per = defaultdict(int)
    for m in plan.messages:
        if not m.direct:
            assert m.nbytes <= buffer_bytes
            per[(plan.procs.src[m.src], m.step)] += 1
            per[(plan.procs.dst[m.dst], m.step)] += 1
    assert all(v <= num_buffers for v in per.values())


@given(layout_pairs())
def test_plan_is_deterministic(pair):
    src, dst = pair
    assert build_plan(src, dst).digest == build_plan(src, dst).digest


def _spec_plan(model, s, d, **kw):
    shapes = param_shapes(model)
    return build_plan(
        layout_from_spec(shapes, parse_spec(s, "src")), layout_from_spec(shapes, parse_spec(d, "dst")), **kw
    )


@pytest.mark.parametrize(
    "src,dst",
    [
        ("tp=2", "tp=1,dp=2"),
        ("fsdp=2", "tp=2"),
        ("tp=2,pp=2", "tp=4"),
        ("dp=2,tp=2", "tp=1,dp=4"),
        ("fsdp=4", "tp=2,dp=2"),
    ],
)
def test_required_pairs_move_exactly_what_is_needed(src, dst):
    plan = _spec_plan("llama-3.1-8b", src, dst)
    assert plan.bytes_moved == plan.bytes_needed
    assert plan.ratio == 1.0
    if parse_spec(dst, "dst").degree("tp") == 1:  # every replica holds the whole model
        assert plan.bytes_needed == parse_spec(dst, "dst").degree("dp") * 16_060_522_496


@pytest.mark.parametrize("spec", ["tp=2", "dp=2,tp=2", "tp=4", "dp=4"])
def test_identical_layouts_pair_each_destination_with_its_counterpart(spec):
    plan = _spec_plan("tiny-qwen3", spec, spec)
    assert {d: set(v) for d, v in _receivers(plan).items()} == {
        r: {r} for r in range(parse_spec(spec, "dst").world_size)
    }


def _receivers(plan):
    out = defaultdict(set)
    for s, row in plan.links.items():
        for d in row:
            out[d].add(s)
    return out


def test_replicas_spread_load_across_senders():
    plan = _spec_plan("llama-3.1-8b", "dp=4", "tp=1,dp=1")
    sent = [sum(plan.links.get(s, {}).values()) for s in range(4)]
    assert min(sent) > 0
    assert max(sent) / min(sent) < 1.2


def test_forced_load_counts_before_the_least_loaded_choice():
    # "big" lives only on trainer rank 0; "small" is replicated on ranks 0 and 1. Rank 0 must
    # send big anyway, so every piece of small goes to rank 1 (LPT alone would put the first on 0).
    mesh = Mesh((2,), ("dp",), (0, 1))
    big = TensorLayout("big", (64, 4), torch.float32, mesh, (Replicate(),), boxes={0: ((0, 64), (0, 4))})
    small = TensorLayout("small", (8, 4), torch.float32, mesh, (Replicate(),))
    one = Mesh((2,), ("dp",), (0, 1))
    dst = ModelLayout(
        (
            TensorLayout("big", (64, 4), torch.float32, one, (Replicate(),)),
            TensorLayout("small", (8, 4), torch.float32, one, (Shard(0),)),
        ),
        2,
    )
    plan = build_plan(ModelLayout((big, small), 2), dst)
    senders = {(p.tensor, p.dst): p.src for m in plan.messages for p in m.pieces}
    assert senders[("big", 0)] == senders[("big", 1)] == 0
    assert senders[("small", 0)] == senders[("small", 1)] == 1
    assert plan.links == {0: {0: 64 * 4 * 4, 1: 64 * 4 * 4}, 1: {0: 4 * 4 * 4, 1: 4 * 4 * 4}}


def test_schedule_keeps_a_link_in_order_and_the_ring_bounded():
    # many packed pieces on two links into one receiver: steps never go back on a link and
    # no process holds more than half its ring in one step
    src = _one(shape=(64, 6), world=2, placement=Shard(1))
    dst = _one(shape=(64, 6), world=2, placement=Shard(0))
    plan = build_plan(src, dst, config=TransferConfig(num_buffers=2, buffer_bytes=256))
    per_link = defaultdict(list)
    per_proc_step = defaultdict(int)
    for m in sorted(plan.messages, key=lambda m: m.step):
        per_link[(m.src, m.dst)].append(m.step)
        if not m.direct:
            per_proc_step[(plan.procs.src[m.src], m.step)] += 1
            per_proc_step[(plan.procs.dst[m.dst], m.step)] += 1
    assert all(v <= 1 for v in per_proc_step.values())
    busiest = max(sum(1 for p, _ in per_proc_step if p == proc) for proc in range(4))
    assert busiest == 4 and plan.num_steps == busiest  # earliest free step: no step left idle
    for steps in per_link.values():
        assert steps == sorted(steps)


def test_colocated_plan_copies_locally():
    plan = _spec_plan("tiny-llama", "tp=2", "tp=2", procs=ProcessMap.colocated(2, 2))
    assert plan.bytes_moved == 0 and plan.bytes_local == plan.bytes_needed


def test_digest_ignores_mesh_names_but_not_boxes():
    a = ModelLayout((TensorLayout("w", (8, 4), torch.float32, Mesh((2,), ("tp",), (0, 1)), (Shard(0),)),), 2)
    b = ModelLayout((TensorLayout("w", (8, 4), torch.float32, Mesh((2,), ("fsdp",), (0, 1)), (Shard(0),)),), 2)
    c = ModelLayout((TensorLayout("w", (8, 4), torch.float32, Mesh((2,), ("tp",), (0, 1)), (Shard(1),)),), 2)
    dst = ModelLayout((TensorLayout("w", (8, 4), torch.float32, Mesh((1,), ("tp",), (0,)), (Replicate(),)),), 1)
    assert build_plan(a, dst).digest == build_plan(b, dst).digest != build_plan(c, dst).digest


def test_digest_equal_for_a_mesh_and_the_same_boxes_given_explicitly():
    mesh = Mesh((2, 2), ("dp", "tp"), (0, 1, 2, 3))
    a = ModelLayout((TensorLayout("w", (8, 6), torch.float32, mesh, (Replicate(), Shard(1))),), 4)
    boxes = {r: a["w"].box(r) for r in range(4)}
    flat = Mesh((4,), ("x",), (0, 1, 2, 3))
    b = ModelLayout((TensorLayout("w", (8, 6), torch.float32, flat, (Replicate(),), boxes=boxes),), 4)
    dst = _one(shape=(8, 6), world=2)
    assert build_plan(a, dst).digest == build_plan(b, dst).digest
    assert build_plan(a, dst).canonical() == build_plan(b, dst).canonical()


def _digest_base():
    # local copies ("n"), a direct message ("c") and a packed one with two pieces ("a", "b" on one link)
    src_mesh, dst_mesh = Mesh((2,), ("fsdp",), (0, 1)), Mesh((2,), ("tp",), (0, 1))
    src, dst = [], []
    for name, shape, s, d in (
        ("a", (8, 4), Shard(1), Shard(0)),
        ("b", (8, 4), Shard(1), Shard(0)),
        ("c", (8, 4), Shard(0), Replicate()),
        ("n", (8,), Shard(0), Shard(0)),
    ):
        src.append(TensorLayout(name, shape, torch.float32, src_mesh, (s,)))
        dst.append(TensorLayout(name, shape, torch.float32, dst_mesh, (d,)))
    procs = ProcessMap.colocated(2, 2)
    return build_plan(ModelLayout(tuple(src), 2), ModelLayout(tuple(dst), 2), procs, TransferConfig(buffer_bytes=1024))


def _with_message(plan, i, **kw):
    messages = list(plan.messages)
    messages[i] = replace(messages[i], **kw)
    return replace(plan, messages=tuple(messages))


def _with_piece(plan, i, j, **kw):
    pieces = list(plan.messages[i].pieces)
    pieces[j] = replace(pieces[j], **kw)
    return _with_message(plan, i, pieces=tuple(pieces))


def _shrunk(box):
    (lo, hi), *rest = box
    return ((lo, hi - 1), *rest)


def _mutated(plan, what):
    packed = next(i for i, m in enumerate(plan.messages) if len(m.pieces) > 1)
    m = plan.messages[packed]
    other = next(t.name for t in plan.dst_layout if t.name != m.pieces[0].tensor)
    if what == "piece box":
        return _with_piece(plan, packed, 0, box=_shrunk(m.pieces[0].box))
    if what == "piece tensor":
        return _with_piece(plan, packed, 0, tensor=other)
    if what == "piece source rank":
        return _with_piece(plan, packed, 0, src=1 - m.src)
    if what == "message step":
        return _with_message(plan, packed, step=m.step + 1)
    if what == "message offset":
        return _with_message(plan, packed, offsets=(m.offsets[0], m.offsets[1] + 64, *m.offsets[2:]))
    if what == "message transport":
        return _with_message(plan, packed, transport="ipc")
    if what == "message direct":
        return _with_message(plan, packed, direct=True)
    if what == "message link":
        return _with_message(plan, packed, dst=1 - m.dst)
    if what == "message order":
        messages = list(plan.messages)
        messages[0], messages[-1] = messages[-1], messages[0]
        return replace(plan, messages=tuple(messages))
    if what == "message dropped":
        return replace(plan, messages=plan.messages[1:])
    if what == "local copy box":
        return replace(plan, local=(replace(plan.local[0], box=_shrunk(plan.local[0].box)), *plan.local[1:]))
    if what == "local copy dropped":
        return replace(plan, local=plan.local[1:])
    if what == "layout":
        return replace(
            plan, src_layout=ModelLayout(tuple(replace(t, placements=(Shard(0),)) for t in plan.src_layout), 2)
        )
    if what == "process map":
        return replace(plan, procs=ProcessMap((1, 0), plan.procs.dst))
    if what == "devices":
        return replace(plan, procs=plan.procs.with_devices(["cuda:0", "cuda:1"]))
    if what == "delta_link_gbps":  # weighed only with deltas on (``plan_may_pay`` decides the protocol)
        return replace(plan, config=replace(plan.config, delta="auto", delta_link_gbps=50.0))
    if what in TransferConfig().agreement():
        value = {"num_buffers": 3, "buffer_bytes": 2048, "transport": "auto", "commit": "staged"}.get(what)
        changed = {what: value if value is not None else {"checksums": True, "stages": 2, "delta": "auto"}[what]}
        return replace(plan, config=replace(plan.config, **changed))
    raise AssertionError(what)


@pytest.mark.parametrize(
    "what",
    [
        "piece box",
        "piece tensor",
        "piece source rank",
        "message step",
        "message offset",
        "message transport",
        "message direct",
        "message link",
        "message order",
        "message dropped",
        "local copy box",
        "local copy dropped",
        "layout",
        "process map",
        "devices",
        *TransferConfig().agreement(),
    ],
)
def test_digest_changes_with_any_part_of_the_plan(what):
    plan = _digest_base()
    changed = _mutated(plan, what)
    assert changed != plan
    assert changed.digest != plan.digest


def test_digest_ignores_settings_that_need_not_agree():
    plan = _digest_base()
    other = replace(plan.config, name="other", deadline_s=9.0, preflight_timeout_s=5.0, copy_streams=4)
    assert replace(plan, config=other).digest == plan.digest
    # the link speed the delta rule weighs must agree only where deltas are on
    assert replace(plan, config=replace(plan.config, delta_link_gbps=50.0)).digest == plan.digest
    auto = replace(plan, config=replace(plan.config, delta="auto"))
    assert replace(auto, config=replace(auto.config, delta_link_gbps=50.0)).digest != auto.digest


# ----------------------------------------------------------------------------- errors before anything moves


def _one(name="w", shape=(8, 4), dtype=torch.float32, world=2, placement=Shard(0), boxes=None):  # noqa: B008
    mesh = Mesh((world,), ("tp",), tuple(range(world)))
    return ModelLayout((TensorLayout(name, shape, dtype, mesh, (placement,), boxes=boxes),), world)


def test_mismatched_names():
    with pytest.raises(PlanError, match="destination tensor.*no source, first: 'v'"):
        build_plan(_one("w"), _one("v"))


def test_mismatched_shapes():
    with pytest.raises(PlanError, match=r"tensor 'w': source shape \[8, 4\] != destination shape \[8, 5\]"):
        build_plan(_one(shape=(8, 4)), _one(shape=(8, 5)))


def test_mismatched_dtypes():
    with pytest.raises(PlanError, match="tensor 'w': source dtype torch.float32 != destination dtype torch.bfloat16"):
        build_plan(_one(dtype=torch.float32), _one(dtype=torch.bfloat16))


def test_coverage_gap():
    gap = _one(boxes={0: ((0, 3), (0, 4)), 1: ((4, 8), (0, 4))})
    with pytest.raises(PlanError, match=r"'w' \[8, 4\]: source ranks hold 28 of 32 elements \(coverage gap\)"):
        build_plan(gap, _one())


def test_overlapping_sources():
    ov = _one(boxes={0: ((0, 5), (0, 4)), 1: ((4, 8), (0, 4))})
    with pytest.raises(PlanError, match="overlap"):
        build_plan(ov, _one())


def test_budget_validation():
    with pytest.raises(ConfigError, match="num_buffers must be an integer >= 1, got 0"):
        TransferConfig(num_buffers=0)
    with pytest.raises(ConfigError, match="buffer_bytes must be an integer >= 64, got 32"):
        TransferConfig(buffer_bytes=32)
