"""What one process does with a built plan, as plain data: its P2P messages, their ring slots and tags,
the stages of an all-IPC pull, and which part of a source tensor a pulled piece lies in.

Pure functions of the plan (no torch.distributed, no CUDA): every process of a refit derives the same
answers from the same plan, which is what lets a sender and its receiver agree without talking.

Invariants (``tests/test_schedule.py``):

* ``assign_slots``: the packed messages of one step on a process never share a ring slot (the planner
  puts at most ``max(1, num_buffers // 2)`` of them in a step); a slot is reused only by a later step.
* ``assign_tags``: the sender of a message and its receiver give it the same tag; the messages of one
  (step, source rank, destination rank) get distinct tags.
* ``ipc_stages``: the stages partition the source tensor names, in plan order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from refit.errors import PlanError
from refit.layout import Box, box_contains
from refit.plan.planner import Message, Plan


def p2p_messages(plan: Plan, proc: int) -> list[int]:
    """Indices (into ``plan.messages``) of the P2P messages ``proc`` sends or receives, in plan order."""
    return [
        i
        for i, m in enumerate(plan.messages)
        if m.transport == "p2p" and proc in (plan.procs.src[m.src], plan.procs.dst[m.dst])
    ]


def assign_slots(messages: Sequence[Message], num_buffers: int) -> list[int]:
    """The ring slot of each of one process's packed messages (same order as ``messages``).

    The messages sorted by (step, source rank, destination rank) (stable) take slots round-robin over
    ``min(num_buffers, len(messages))`` buffers: message i of that order gets slot ``i % n``.
    """
    n = max(min(num_buffers, len(messages)), 1)
    order = sorted(range(len(messages)), key=lambda i: (messages[i].step, messages[i].src, messages[i].dst))
    slots = [0] * len(messages)
    for k, i in enumerate(order):
        slots[i] = k % n
    return slots


def assign_tags(plan: Plan, proc: int, tag_base: int) -> dict[int, int]:
    """The P2P tag of each message ``proc`` sends or receives: message index -> tag.

    ``tag_base`` plus a counter per (step, source rank, destination rank), counting that key's
    messages in plan order: both ends of a message count the same messages, so they agree.
    """
    count: dict[tuple[int, int, int], int] = defaultdict(int)
    tags: dict[int, int] = {}
    for i in p2p_messages(plan, proc):
        m = plan.messages[i]
        key = (m.step, m.src, m.dst)
        tags[i] = tag_base + count[key]
        count[key] += 1
    return tags


def ipc_stages(plan: Plan, stages: int) -> list[set[str]]:
    """The source tensors in plan order cut into ``stages`` runs of about equal bytes (the same on
    every process: a function of the plan). One stage (all names) when ``stages`` <= 1."""
    names = [t.name for t in plan.src_layout]
    if stages <= 1 or len(names) <= 1:
        return [set(names)]
    sizes = [plan.src_layout[n].nbytes for n in names]
    total, out, cur, acc = sum(sizes), [], set(), 0
    for n, b in zip(names, sizes):
        cur.add(n)
        acc += b
        if acc >= total * (len(out) + 1) / stages and len(out) < stages - 1:
            out.append(cur)
            cur = set()
    out.append(cur)
    return [c for c in out if c]


def part_key(tensor: str, part: int) -> str:
    """The handle name of part ``part`` of a source tensor (``TensorLayout.parts``): the tensor's name for
    its first (usually only) part."""
    return tensor if part == 0 else f"{tensor}#{part}"


def source_part(plan: Plan, src: int, tensor: str, box: Box) -> tuple[int, Box]:
    """The index and box of the part of source rank ``src``'s tensor that holds ``box``."""
    for i, part in enumerate(plan.src_layout[tensor].parts(src)):
        if box_contains(part, box):
            return i, part
    raise PlanError(f"source rank {src} holds no part of {tensor!r} containing {[list(b) for b in box]}")
