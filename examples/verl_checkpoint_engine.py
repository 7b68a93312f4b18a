"""refit as verl's checkpoint engine, driven on CPU the way verl drives it.

    python examples/verl_checkpoint_engine.py [--steps 2] [--rollout-tp 1]

Needs verl (scripts/test.sh installs it; docs/integrations/verl.md says how). Two FSDP2 trainer ranks take SGD
steps; two rollout workers (two replicas of TP 1, as verl's server adapters load whole tensors, or with
``--rollout-tp 2`` one replica whose workers each receive only their TP share, for a shard-aware adapter) receive
each step through ``RefitCheckpointEngine``, called in the order of verl's ``CheckpointEngineManager.update_weights``:
prepare, build_topology, init_process_group, send/receive, finalize. Each worker checks what it received against
trainer rank 0's SHA-256 of the same slice of the trainer's weights. In a verl job the same engine is chosen by
``actor_rollout_ref.rollout.checkpoint_engine.backend=refit``. tests/frameworks/test_verl.py runs ``job``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib

import torch

MODEL = "tiny-llama"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


class FullTensors:
    """What verl hands ``send_weights``: its actor's ``get_per_tensor_param()``, which gathers each FSDP parameter
    as it is read. refit never reads it (``read`` stays False)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.read = model, False

    def __iter__(self):
        self.read = True
        for n, p in self.model.named_parameters():
            yield n, p.full_tensor()


def fsdp_policy(world) -> torch.nn.Module:
    """The actor on this trainer rank: the tiny model under FSDP2 over the trainer ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from refit.layout.models import build_model, load_config

    model = build_model(load_config(MODEL), torch.float32, seed=0)
    mesh = DeviceMesh.from_group(world.trainer_group, "cpu", mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sgd_step(model: torch.nn.Module, step: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(100 + step))
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 5e-2 * p.grad
            p.grad = None


def join(engine, world, step: int) -> None:
    """verl's prepare on every process, build_topology in its driver (trainer rank 0's metadata first, shared
    here through the job's store), then init_process_group with this process's entry of the topology."""
    from refit.frameworks.verl import RefitCheckpointEngine

    meta = engine.prepare()
    if world.rank == 0:
        world.store.put(f"meta/{step}", meta)
    metadata = [world.store.get(f"meta/{step}", 60)] + [{}] * (world.world_size - 1)
    actor, rollout = RefitCheckpointEngine.build_topology(world.n_src, world.n_dst, metadata)
    mine, i = (actor, world.src_rank) if world.src_rank is not None else (rollout, world.dst_rank)
    engine.init_process_group(**{k: v[i] for k, v in mine.items()})


def trainer_step(engine, world, model: torch.nn.Module, step: int, out: dict) -> None:
    from refit.layout import box_slices

    sgd_step(model, step)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # for the check only (a collective)
    weights = FullTensors(model)
    metrics = asyncio.run(engine.send_weights(iter(weights), global_steps=step))
    out["unread"].append(not weights.read)
    out["metrics"] = metrics
    if world.rank == 0:  # each worker's share of the weights just sent, as SHA-256 per tensor
        for w in range(world.n_dst):
            want = {t.name: digest(full[t.name][box_slices(box)]) for t, box in engine.dst.local_tensors(w)}
            world.store.put(f"sha/{step}/{w}", want)


async def received(engine, step: int) -> dict[str, torch.Tensor]:
    return {n: t async for n, t in engine.receive_weights(global_steps=step)}


def rollout_step(engine, world, step: int, out: dict) -> None:
    from refit.layout import box_numel

    got = asyncio.run(received(engine, step))
    want = world.store.get(f"sha/{step}/{world.dst_rank}", 60)
    out["exact"].append({n: digest(t) for n, t in got.items()} == want)
    boxes = list(engine.dst.local_tensors(world.dst_rank))
    out["share"] = sum(box_numel(b) * t.dtype.itemsize for t, b in boxes)
    out["model_bytes"] = engine.dst.nbytes


def job(world, steps: int, rollout_tp: int) -> dict:
    """One process of the job: a trainer rank or a rollout worker, ``steps`` weight syncs. Returns what it saw:
    ``bytes`` per step (sent or received), ``peers`` (refit plans made: 1 when every step reused the first),
    refit's ``stats``; a trainer rank also ``unread`` (verl's generator untouched, per step) and verl's ``metrics``;
    a worker ``exact`` (per step), ``share`` (its boxes' bytes) and ``model_bytes``."""
    from refit.frameworks.verl import RefitCheckpointEngine

    trainer = world.src_rank is not None
    engine = RefitCheckpointEngine(1 << 20, world.rank == 0, rollout_tp=rollout_tp, shard_aware_adapter=rollout_tp > 1)
    model = fsdp_policy(world) if trainer else None
    if trainer:
        engine.bind_module(model)  # the hook verl lacks: the actor worker binds its module once
    out = {"role": "trainer" if trainer else "rollout", "bytes": [], "unread": [], "exact": []}
    peers = set()
    for step in range(1, steps + 1):
        join(engine, world, step)
        if trainer:
            trainer_step(engine, world, model, step, out)
        else:
            rollout_step(engine, world, step, out)
        peers.add(id(engine.peer))
        out["bytes"].append(engine.stats.bytes_per_refit)
        engine.finalize()
    out["peers"], out["stats"] = len(peers), vars(engine.stats)
    torch.distributed.barrier()  # every process done with the store trainer rank 0 hosts
    engine.close()
    return out


def report(results: list[dict]) -> tuple[list[str], bool]:
    lines, ok = [], True
    for w, r in enumerate(x for x in results if x["role"] == "rollout"):
        for step, (n, exact) in enumerate(zip(r["bytes"], r["exact"]), 1):
            lines.append(f"rollout worker {w} step {step}: {n:,} B of {r['model_bytes']:,} B, exact {exact}")
        ok = ok and all(r["exact"]) and bool(r["exact"])
    ok = ok and all(all(r["unread"]) for r in results if r["role"] == "trainer")
    lines.append("PASS: every rollout worker received every step exactly" if ok else "FAIL")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rollout-tp", type=int, default=1, choices=(1, 2))
    args = ap.parse_args(argv)
    from refit.tools.launch import run_local

    lines, ok = report(run_local(job, 2, 2, args.steps, args.rollout_tp, backend="gloo"))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
