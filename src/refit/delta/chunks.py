"""What every process derives alike from the plan and the config before a delta run: the step-chunks
(``step_chunks``), each message's share of its chunk (``chunk_shares``), the speed of each link
(``link_speed``), whether a message is found per 64-bit word (``words_for``) and whether the delta protocol
can pay for the plan at all (``plan_may_pay``). No communication: the same answers on every process.
"""

from __future__ import annotations

from dataclasses import replace

from refit.config import TransferConfig
from refit.delta.rule import LINKS, PAY_MARGIN, LinkSpeed, best_case, predicted_seconds, prefer_words
from refit.delta.words import whole_words
from refit.plan import Plan

FIND_BATCH_BYTES = 1 << 30  # data diffed per host sync (the kernel's slots: ~1.25x that for bf16)
WORD_BATCH_BYTES = 4 << 30  # the same for word deltas (their slots: 0.375x that)


def link_speed(plan: Plan, a: int, b: int, config: TransferConfig) -> LinkSpeed:
    """The ``LINKS`` entry of the link between processes ``a`` and ``b`` (same device; CUDA on one host:
    NVLink; CUDA across hosts: a NIC; else CPU), its link speed replaced by ``config.delta_link_gbps``."""
    speed = LINKS[link_kind(plan, a, b)]
    return replace(speed, link_gbps=config.delta_link_gbps) if config.delta_link_gbps is not None else speed


def link_kind(plan: Plan, a: int, b: int) -> str:
    """The ``LINKS`` kind of the link between processes ``a`` and ``b``: same device; CUDA on one host: NVLink;
    CUDA across hosts: a NIC; else CPU."""
    procs = plan.procs
    if procs.same_device(a, b) and procs.devices is not None:
        return "same_device"
    if "cuda" in procs.device_of(a) and "cuda" in procs.device_of(b):
        return "nvlink" if procs.host_of(a) == procs.host_of(b) else "nic"
    return "cpu"


def plan_may_pay(plan: Plan, config: TransferConfig) -> bool:
    """Whether the delta protocol can pay for ``plan``'s P2P messages as a whole: with nothing changed, each
    message at the cheaper of dense and its best delta (``rule.best_case`` over its link), plus the
    fixed cost of every chunk (``LinkSpeed.chunk_s``: its header exchange and host syncs, paid even where
    every message goes dense), at most ``PAY_MARGIN`` of sending everything dense. Under ``delta="auto"`` a
    plan where this fails runs the plain P2P path: no base copy, no header exchange. The same answer on
    every process (the plan and the config decide it)."""
    chunk = step_chunks(plan, config)
    dense = best = 0.0
    fixed: dict[tuple[int, int], float] = {}
    for i, m in enumerate(plan.messages):
        if m.transport != "p2p":
            continue
        link = link_speed(plan, plan.procs.src[m.src], plan.procs.dst[m.dst], config)
        pieces = [(p.nbytes // p.itemsize, p.itemsize) for p in m.pieces]
        words = all(whole_words(p.nbytes) for p in m.pieces) and words_for(config, pieces, link)
        d = sum(predicted_seconds("dense", n, 0, s, link) for n, s in pieces)
        dense, best = dense + d, best + min(d, best_case(pieces, link, words))
        fixed.setdefault((m.step, chunk[i]), link.chunk_s)
    return best < dense and best + sum(fixed.values()) <= PAY_MARGIN * dense


def step_chunks(plan: Plan, config: TransferConfig) -> dict[int, int]:
    """Each P2P message's chunk within its step: the step's messages in plan order, cut where their bytes pass
    the staging budget (at most ``FIND_BATCH_BYTES``, or ``WORD_BATCH_BYTES`` where words may be sent) times
    the step's sending processes. Every process
    computes the same cuts and runs a step chunk by chunk (headers, payloads, apply), so a receiver applies
    one chunk while its sender finds the next, and the changes held at a time stay bounded."""
    by_step: dict[int, list[int]] = {}
    for i, m in enumerate(plan.messages):
        if m.transport == "p2p":
            by_step.setdefault(m.step, []).append(i)
    out: dict[int, int] = {}
    for ids in by_step.values():
        senders = len({plan.procs.src[plan.messages[i].src] for i in ids})
        batch = WORD_BATCH_BYTES if config.delta in ("words", "auto") else FIND_BATCH_BYTES
        limit = max(1, min(batch, config.num_buffers * config.buffer_bytes)) * senders
        c, size = 0, 0
        for i in ids:
            if size and size + plan.messages[i].nbytes > limit:
                c, size = c + 1, 0
            out[i] = c
            size += plan.messages[i].nbytes
    return out


def chunk_shares(plan: Plan, config: TransferConfig) -> dict[int, float]:
    """Each P2P message's part of its chunk's bytes (``step_chunks``): the part of a chunk's fixed cost
    (``LinkSpeed.chunk_s``) the encoding rule charges a delta of it. The same on every process."""
    chunk = step_chunks(plan, config)
    total: dict[tuple[int, int], int] = {}
    for i, c in chunk.items():
        key = (plan.messages[i].step, c)
        total[key] = total.get(key, 0) + plan.messages[i].nbytes
    return {i: plan.messages[i].nbytes / max(1, total[(plan.messages[i].step, c)]) for i, c in chunk.items()}


def words_for(config: TransferConfig, pieces: list[tuple[int, int]], link: LinkSpeed) -> bool:
    """Whether a message of whole-word pieces ``(n, itemsize)`` is found per word: always under
    ``delta="words"``, under ``"auto"`` where ``rule.prefer_words`` says so for its link."""
    return config.delta == "words" or (config.delta == "auto" and prefer_words(pieces, link))
