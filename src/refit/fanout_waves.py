"""The waves of a fan-out as plan inputs: pure data, the same on every process (and in the cost model).

``wave_schedule(R)``: replica indices per wave, holders (the trainer as one) doubling per wave. ``build_wave``:
one wave's two sides (the trainer's ranks and the source replicas' ranks stacked as one source layout, the
receivers' ranks as one destination layout) and its ``ProcessMap``. ``waves_for``: every wave of a fan-out,
skipping replicas with a dead process. ``Wave``: what a wave is. ``refit.fanout.Fanout`` runs them;
``refit.cost`` predicts them from the same plans.

Knows nothing of processes, groups or transports: layouts and the planner's inputs only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate

from refit.layout import Mesh, ModelLayout, TensorLayout
from refit.plan import Plan, ProcessMap
from refit.plan.holders import stack_holder_sets


def wave_schedule(replicas: int) -> list[list[int]]:
    """Replica indices per wave: holders (the trainer as one) double per wave."""
    if replicas < 1:
        raise ValueError(f"wave_schedule: replicas must be >= 1, got {replicas}")
    waves, nxt, holders = [], 0, 1
    while nxt < replicas:
        take = min(holders, replicas - nxt)
        waves.append(list(range(nxt, nxt + take)))
        nxt += take
        holders += take
    return waves


def _stack(parts: list[tuple[ModelLayout, int]]) -> ModelLayout:
    """One destination layout whose side-local ranks are the parts' ranks one after another, each
    part's rank r holding what it holds there (explicit boxes)."""
    out = []
    for t in parts[0][0]:
        boxes, base = {}, 0
        for layout, n in parts:
            lt = layout[t.name]
            for r in range(n):
                b = lt.box(r)
                if b is not None:
                    boxes[base + r] = b
            base += n
        out.append(
            TensorLayout(t.name, t.shape, t.dtype, Mesh((base,), ("r",), tuple(range(base))), (Replicate(),), boxes)
        )
    return ModelLayout(tuple(out), sum(n for _, n in parts))


@dataclass(frozen=True)
class Wave:
    """One wave of a fan-out, as plan inputs: who receives, who sends.

    ``receivers`` / ``sources``: replica indices; the trainer is a source of every wave and is
    not listed. ``src_layout`` is one side made of the trainer's ranks followed by each source
    replica's ranks (in ``sources`` order); ``dst_layout`` of each receiver's ranks. ``procs``
    maps those side-local ranks to global processes; ``members`` is every process taking part.
    Pure data: the same inputs give the same Wave on every process.
    """

    index: int
    receivers: tuple[int, ...]  # replica indices
    sources: tuple[int, ...]  # replica indices holding the version (the trainer is always a source)
    src_layout: ModelLayout
    dst_layout: ModelLayout
    procs: ProcessMap
    plan: Plan | None = None  # a relay's plan (``refit.fanout_relay``); None: the planner's over the two sides

    @property
    def members(self) -> list[int]:
        return sorted({*self.procs.src, *self.procs.dst})


def build_wave(
    index: int,
    receivers: list[int],
    sources: list[int],
    trainer: ModelLayout | None,
    replica: ModelLayout,
    trainer_procs: list[int],
    replica_procs: list[list[int]],
    devices: Sequence[str] | None = None,
) -> Wave:
    """Wave ``index``: replicas ``receivers`` pull from the trainer and replicas ``sources`` (``trainer`` None:
    from the replicas alone, a join wave: ``refit.fanout_join``). ``trainer_procs[r]`` is the process of trainer
    rank ``r``, ``replica_procs[j][r]`` that of rank ``r`` of replica ``j``; ``devices``: every global process's
    device, or None."""
    nr = replica.world_size
    src = stack_holder_sets(([trainer] if trainer is not None else []) + [replica for _ in sources])
    dst = _stack([(replica, nr) for _ in receivers])
    procs = ProcessMap(
        tuple(trainer_procs if trainer is not None else ()) + tuple(p for j in sources for p in replica_procs[j]),
        tuple(p for j in receivers for p in replica_procs[j]),
        tuple(devices) if devices is not None else None,
    )
    return Wave(index, tuple(receivers), tuple(sources), src, dst, procs)


def waves_for(
    trainer: ModelLayout,
    replica: ModelLayout,
    trainer_procs: list[int],
    replica_procs: list[list[int]],
    dead: frozenset[int] = frozenset(),
    devices: Sequence[str] | None = None,
) -> list[Wave]:
    """The waves, skipping replicas with a dead process (as receivers and as sources).
    ``devices``: each global process's device (``"cuda:0"``), so the planner can prefer
    on-device sources and use CUDA IPC where ``transport`` allows."""
    alive = [j for j in range(len(replica_procs)) if not set(replica_procs[j]) & dead]
    out, holders = [], []
    for k, wave in enumerate(wave_schedule(len(replica_procs))):
        recv = [j for j in wave if j in alive]
        if recv:
            out.append(build_wave(k, recv, list(holders), trainer, replica, trainer_procs, replica_procs, devices))
        holders += recv
    return out
