"""The schedule of one process (``refit.plan.schedule``): ring slots, P2P tags and IPC stages, as plain
data derived from a plan. Each test is named for an invariant of the module's docstring."""

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.config import TransferConfig
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import Message, ProcessMap, build_plan
from refit.plan.schedule import assign_slots, assign_tags, ipc_stages, p2p_messages
from strategies import layout_pairs


@st.composite
def plans(draw, transports=("p2p",)):
    """A plan over random layouts: disjoint or colocated processes, a small staging budget (many packed
    messages over several steps), and, for IPC, every process on a CUDA device of one host."""
    src, dst = draw(layout_pairs())
    colocated = draw(st.booleans())
    procs = (ProcessMap.colocated if colocated else ProcessMap.disjoint)(src.world_size, dst.world_size)
    transport = draw(st.sampled_from(transports))
    if transport != "p2p":  # some processes on CUDA (IPC links between them), the others on CPU
        procs = procs.with_devices(
            [draw(st.sampled_from(["cuda:0", "cuda:1", "cpu"])) for _ in range(procs.world_size)]
        )
        transport = "auto"
    config = TransferConfig(
        num_buffers=draw(st.sampled_from([1, 2, 4, 6])),
        buffer_bytes=draw(st.sampled_from([64, 128, 1024, 1 << 20])),
        transport=transport,
    )
    return build_plan(src, dst, procs, config)


def _processes(plan):
    return sorted({*plan.procs.src, *plan.procs.dst})


def _slots_by_process(plan):
    """proc -> [(message, slot)] of its packed P2P messages, as the executor's staging ring assigns them."""
    out = {}
    for proc in _processes(plan):
        packed = [plan.messages[i] for i in p2p_messages(plan, proc) if not plan.messages[i].direct]
        out[proc] = list(zip(packed, assign_slots(packed, plan.num_buffers)))
    return out


@settings(deadline=None)
@given(plans())
def test_one_steps_packed_messages_on_a_process_never_share_a_slot(plan):
    for proc, slotted in _slots_by_process(plan).items():
        used = defaultdict(list)
        for m, slot in slotted:
            assert 0 <= slot < min(plan.num_buffers, len(slotted))  # the ring never outgrows the budget
            used[m.step].append(slot)
        assert all(len(s) == len(set(s)) for s in used.values()), (proc, dict(used))


@settings(deadline=None)
@given(plans())
def test_a_slot_is_reused_only_by_a_later_step(plan):
    for slotted in _slots_by_process(plan).values():
        order = sorted(slotted, key=lambda ms: (ms[0].step, ms[0].src, ms[0].dst))
        last_step = {}
        for m, slot in order:
            assert last_step.get(slot, -1) < m.step
            last_step[slot] = m.step


def test_assign_slots_goes_round_robin_in_step_order():
    def msg(step, src, dst):
        return Message(src, dst, step, False, (), (), 64)

    messages = [msg(1, 0, 1), msg(0, 0, 2), msg(0, 0, 1), msg(2, 1, 0), msg(1, 0, 2)]
    # sorted by (step, src, dst): m2, m1, m0, m4, m3 -> slots 0, 1, 0, 1, 0
    assert assign_slots(messages, 2) == [0, 1, 0, 0, 1]
    assert assign_slots(messages, 8) == [2, 1, 0, 4, 3]  # fewer messages than buffers: one each
    assert assign_slots([], 2) == []


@settings(deadline=None)
@given(plans(), st.sampled_from([0, 1 << 21, 5 << 21]))
def test_a_senders_tag_for_a_message_equals_its_receivers_tag(plan, tag_base):
    tags = {proc: assign_tags(plan, proc, tag_base) for proc in _processes(plan)}
    seen = set()
    for i, m in enumerate(plan.messages):
        if m.transport != "p2p":
            assert all(i not in t for t in tags.values())  # IPC pulls carry no tag
            continue
        sender, receiver = plan.procs.src[m.src], plan.procs.dst[m.dst]
        assert tags[sender][i] == tags[receiver][i] >= tag_base
        key = (m.step, m.src, m.dst, tags[sender][i])
        assert key not in seen  # one (step, link)'s messages have distinct tags
        seen.add(key)
    for proc, t in tags.items():
        assert sorted(t) == p2p_messages(plan, proc)  # a tag for every message it sends or receives


@settings(deadline=None)
@given(plans(transports=("p2p", "auto")), st.integers(1, 5))
def test_stages_partition_the_source_names_in_plan_order(plan, stages):
    names = [t.name for t in plan.src_layout]
    cut = ipc_stages(plan, stages)
    assert 1 <= len(cut) <= max(1, stages) and all(cut)
    assert [n for s in cut for n in names if n in s] == names  # each name once, runs in plan order
    assert sum(map(len, cut)) == len(names)


def test_ipc_stages_cut_the_source_tensors_in_order_into_runs_of_about_equal_bytes():
    shapes = param_shapes("tiny-qwen3")
    plan = build_plan(
        layout_from_spec(shapes, parse_spec("tp=1", "src")), layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    )
    names = [t.name for t in plan.src_layout]
    assert ipc_stages(plan, 1) == [set(names)]
    st = ipc_stages(plan, 4)
    assert len(st) == 4 and set().union(*st) == set(names) and sum(map(len, st)) == len(names)  # a partition
    order = {n: i for i, n in enumerate(names)}
    assert all(max(order[n] for n in a) < min(order[n] for n in b) for a, b in zip(st, st[1:]))  # runs, in order
    total = plan.src_layout.nbytes
    assert all(sum(plan.src_layout[n].nbytes for n in s) < total / 2 for s in st)


@pytest.mark.parametrize("src,dst", [("tp=2,pp=2", "tp=4"), ("fsdp=4", "tp=2")])
@pytest.mark.parametrize("colocated", [False, True])
def test_the_schedule_of_a_real_model_holds_every_invariant(src, dst, colocated):
    shapes = param_shapes("tiny-qwen3")
    s, d = layout_from_spec(shapes, parse_spec(src, "src")), layout_from_spec(shapes, parse_spec(dst, "dst"))
    procs = (ProcessMap.colocated if colocated else ProcessMap.disjoint)(s.world_size, d.world_size)
    plan = build_plan(s, d, procs, TransferConfig(num_buffers=6, buffer_bytes=4096))
    tags = {proc: assign_tags(plan, proc, 0) for proc in _processes(plan)}
    for i, m in enumerate(plan.messages):
        assert tags[plan.procs.src[m.src]][i] == tags[plan.procs.dst[m.dst]][i]
    shared = 0
    for slotted in _slots_by_process(plan).values():
        per_step = defaultdict(list)
        for m, slot in slotted:
            per_step[m.step].append(slot)
        assert all(len(v) == len(set(v)) for v in per_step.values())
        shared += sum(len(v) > 1 for v in per_step.values())
    assert shared > 0  # the case the invariant is about does occur here
