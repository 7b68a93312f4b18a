"""Fan-out from every trainer layout into every replica layout: a wave's sources are the trainer's shards and
whole replicas at once (several holder sets, ``refit.plan.holders``). The planner's part without processes,
then every layout pair x commit mode x transport in one spawned job on CPU gloo (one launch: CI time)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from refit.config import TransferConfig
from refit.errors import PlanError
from refit.fanout import Fanout, wave_plans, waves_for
from refit.layout import Mesh, ModelLayout, TensorLayout, box_contains, box_slices
from refit.layout.megatron import megatron_layout
from refit.layout.models import load_config, param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.layout.tensors import box_runs_whole
from refit.plan import build_plan, check_coverage
from refit.plan.holders import HolderSets, refined_tiles, stack_holder_sets
from refit.tools.launch import run_local
from refit.tools.verify import reference_tensor, same_bits
from refit.transport import nixl_agent

REPLICAS = 2  # wave 0: replica 0 from the trainer; wave 1: replica 1 from the trainer and replica 0 together
PAIRS = [  # (model, trainer spec, replica spec)
    ("tiny-llama", "fsdp=2", "tp=1"),
    ("tiny-llama", "tp=2", "tp=1"),
    ("tiny-llama", "tp=2,pp=2", "tp=1"),
    ("tiny-mixtral", "ep=2", "tp=1"),
    ("tiny-llama", "tp=1", "tp=2"),
    ("tiny-llama", "megatron:tp=2", "tp=1"),  # q, k, v rows stored per query group (row_block), padded vocab
]
MODES = {
    "in_place": {},
    "staged": {"commit": "staged"},
    "delta": {"delta": "auto"},
    "nixl": {"transport": "nixl"},
}


def _layouts(model: str, src: str, dst: str) -> tuple[ModelLayout, ModelLayout]:
    shapes = param_shapes(model)
    dst_layout = layout_from_spec(shapes, parse_spec(dst, "dst"))
    if src.startswith("megatron:"):
        return megatron_layout(shapes, parse_spec(src.removeprefix("megatron:"), "src"), load_config(model)), dst_layout
    return layout_from_spec(shapes, parse_spec(src, "src")), dst_layout


def _procs(trainer: ModelLayout, replica: ModelLayout) -> tuple[list[int], list[list[int]]]:
    nt, nr = trainer.world_size, replica.world_size
    return list(range(nt)), [[nt + j * nr + k for k in range(nr)] for j in range(REPLICAS)]


# ---------------------------------------------------------------------------- the planner alone


def _explicit(name: str, shape: tuple[int, ...], boxes: dict, world: int, row_block=None) -> ModelLayout:
    mesh = Mesh((world,), ("r",), tuple(range(world)))
    t = TensorLayout(name, shape, torch.float32, mesh, (Replicate(),), boxes, row_block)
    return ModelLayout((t,), world)


def test_refined_tiles_cut_overlapping_sets_so_every_set_holds_each_tile_whole():
    rows = _explicit("w", (8, 4), {0: ((0, 4), (0, 4)), 1: ((4, 8), (0, 4))}, 2)  # FSDP rows
    cols = _explicit("w", (8, 4), {0: ((0, 8), (0, 2)), 1: ((0, 8), (2, 4))}, 2)  # TP columns
    src = stack_holder_sets([rows, cols])
    t = src["w"]
    assert isinstance(t, HolderSets) and t.set_starts == (0, 2)
    tiles = refined_tiles(t)
    assert [b for b, _ in tiles] == [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((4, 8), (0, 2)), ((4, 8), (2, 4))]
    assert [h for _, h in tiles] == [[0, 2], [0, 3], [1, 2], [1, 3]]


def test_a_set_overlapping_itself_or_leaving_a_gap_is_refused_naming_the_set():
    whole = _explicit("w", (8, 4), {0: ((0, 8), (0, 4))}, 1)
    overlap = _explicit("w", (8, 4), {0: ((0, 5), (0, 4)), 1: ((4, 8), (0, 4))}, 2)
    gap = _explicit("w", (8, 4), {0: ((0, 3), (0, 4)), 1: ((4, 8), (0, 4))}, 2)
    with pytest.raises(PlanError, match=r"in holder set 1 \(ranks from 1\) boxes .* overlap"):
        refined_tiles(stack_holder_sets([whole, overlap])["w"])
    with pytest.raises(PlanError, match=r"holder set 1 \(ranks from 1\) holds 28 of 32 elements"):
        refined_tiles(stack_holder_sets([whole, gap])["w"])


def test_row_blocks_of_one_set_do_not_fragment_what_another_set_serves():
    # the trainer stores its rows in blocks of 2 (Megatron's query groups); the replica holds one tensor
    blocks = _explicit("w", (8, 4), {0: ((0, 4), (0, 4)), 1: ((4, 8), (0, 4))}, 2, row_block=2)
    whole = _explicit("w", (8, 4), {0: ((0, 8), (0, 4))}, 1)
    src, dst = stack_holder_sets([blocks, whole]), _explicit("w", (8, 4), {0: ((0, 8), (0, 4))}, 1)
    assert src["w"].parts(0) == [((0, 2), (0, 4)), ((2, 4), (0, 4))] and src["w"].parts(2) == [((0, 8), (0, 4))]
    assert len(refined_tiles(src["w"])) == 4  # cut at every block
    plan = build_plan(src, dst)
    pieces = [p for m in plan.messages for p in m.pieces]
    check_coverage(dst, pieces)
    for p in pieces:  # no piece crosses a block of the rank that sends it
        assert any(all(lo <= a and b <= hi for (a, b), (lo, hi) in zip(p.box, part)) for part in src["w"].parts(p.src))
    # from the replica alone (the trainer's ranks dead) the tiles merge back into one piece
    only = build_plan(stack_holder_sets([whole]), dst)
    assert [len(m.pieces) for m in only.messages] == [1]


@pytest.mark.parametrize("model,src,dst", PAIRS)
def test_every_wave_plans_from_trainer_shards_and_replicas_balanced_and_covering(model, src, dst):
    trainer, replica = _layouts(model, src, dst)
    tprocs, rprocs = _procs(trainer, replica)
    waves = waves_for(trainer, replica, tprocs, rprocs + [[p + REPLICAS * replica.world_size for p in rprocs[0]]])
    assert [w.receivers for w in waves] == [(0,), (1, 2)]
    plan = build_plan(waves[1].src_layout, waves[1].dst_layout, waves[1].procs)
    check_coverage(waves[1].dst_layout, [p for m in plan.messages for p in m.pieces] + list(plan.local))
    for m in plan.messages:  # a direct piece is one run of the part its sender stores (tiles can be smaller)
        part = [q for q in waves[1].src_layout[m.pieces[0].tensor].parts(m.src) if box_contains(q, m.pieces[0].box)]
        assert not m.direct or box_runs_whole(m.pieces[0].box, part[0]), m
    sent = {s: sum(d.values()) for s, d in plan.links.items()}
    assert set(sent) == set(range(trainer.world_size + replica.world_size))  # every holder serves
    # per sending rank within 25% of a fair share (LPT over tiles; PP stages hold unequal parts)
    fair = plan.bytes_moved / len(sent)
    assert max(sent.values()) <= 1.25 * fair, sent
    assert wave_plans(waves[1:], {1: plan})[0]["sources"] == ["trainer", 0]


# ---------------------------------------------------------------------------- every pair, every mode


def _value(t: TensorLayout, version: int) -> torch.Tensor:
    """The whole tensor at ``version``: the reference, then every 7th element changed (a delta pays)."""
    x = reference_tensor(t.name, t.shape, t.dtype)
    if version > 1:
        x.view(-1)[::7] += float(version)
    return x


def _nan(box) -> torch.Tensor:
    return torch.full(tuple(b - a for a, b in box), float("nan"))


def _update(tensors: dict, layout: ModelLayout, rank: int, version: int) -> None:
    """A trainer rank's new weights, in place; a tensor stored in blocks (``row_block``) part by part."""
    for t, box in layout.local_tensors(rank):
        x, parts = tensors[t.name], t.parts(rank)
        for part, dst in zip(parts, x) if isinstance(x, list) else [(box, x)]:
            dst.copy_(_value(t, version)[box_slices(part)])


def _one_mode(world, trainer, replica, tprocs, rprocs, mode: str, tag: str) -> dict:
    proc = world.rank
    layout, rank = (trainer, proc) if proc in tprocs else (replica, next(r.index(proc) for r in rprocs if proc in r))
    tensors = {  # a trainer's tensor stored in blocks is a list of one tensor per block, as Megatron keeps it
        t.name: [_nan(p) for p in t.parts(rank)] if proc in tprocs and t.row_block else _nan(box)
        for t, box in layout.local_tensors(rank)
    }
    cfg = TransferConfig(name=f"{tag}/{mode}", deadline_s=30.0, preflight_timeout_s=120.0, **MODES[mode])
    f = Fanout(trainer, replica, proc, tprocs, rprocs, tensors, config=cfg)
    out = {"exact": [], "delta": False}
    for v in (1, 2):
        if proc in tprocs:
            _update(tensors, layout, rank, v)
        f.run(v)
        out["exact"].append(
            proc in tprocs
            or all(same_bits(tensors[t.name], _value(t, v)[box_slices(box)]) for t, box in layout.local_tensors(rank))
        )
        out["delta"] |= any(p.executor.delta is not None for _, p in f.peers.values())
    out["version"] = f.version
    f.close()
    return out


def _pairs_worker(world):
    import time

    out = {}
    for model, src, dst in PAIRS:
        trainer, replica = _layouts(model, src, dst)
        tprocs, rprocs = _procs(trainer, replica)
        if world.rank in {*tprocs, *(p for r in rprocs for p in r)}:
            for mode in MODES:
                if mode == "nixl" and not nixl_agent.available():
                    continue
                t0 = time.perf_counter()
                out[f"{src}->{dst} {mode}"] = _one_mode(world, trainer, replica, tprocs, rprocs, mode, f"{src}>{dst}")
                out[f"{src}->{dst} {mode}"]["s"] = time.perf_counter() - t0
        dist.barrier()  # the next pair starts together (processes outside this one wait here)
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_every_trainer_layout_fans_out_into_every_replica_layout_bit_exact():
    if not nixl_agent.available():
        pytest.skip("nixl is not installed (pip install 'refit-rl[nixl]'): the NIXL mode cannot run")
    res = run_local(_pairs_worker, 4, 2, timeout_s=840)  # 6 processes: tp=2,pp=2 + 2 replicas is the largest
    for model, src, dst in PAIRS:
        trainer, replica = _layouts(model, src, dst)
        n = trainer.world_size + REPLICAS * replica.world_size
        for mode in MODES:
            key = f"{src}->{dst} {mode}"
            for proc in range(n):
                r = res[proc][key]
                assert r["exact"] == [True, True] and r["version"] == 2, (model, key, proc, r)
            # a delta refit sends deltas over every wave's P2P links (a sender's schedule is built)
            assert any(res[p][key]["delta"] for p in range(n)) == (mode == "delta"), (key, mode)
        assert all(f"{src}->{dst} in_place" not in res[p] for p in range(n, 6))
