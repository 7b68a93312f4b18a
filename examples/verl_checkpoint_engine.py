"""refit as verl's checkpoint engine, driven on CPU the way verl drives it.

    python examples/verl_checkpoint_engine.py [--steps 3]

Needs verl (``scripts/frameworks_setup.sh`` installs it). Two FSDP2 trainer ranks take SGD steps; two rollout
workers (two replicas at the default ``rollout_tp`` 1, as verl's server adapters load whole tensors) receive each
step through ``RefitCheckpointEngine``, called in the order of verl's ``CheckpointEngineManager.update_weights``:
prepare, build_topology, init_process_group, send/receive, finalize. Each worker checks what it received against
trainer rank 0's SHA-256 of every tensor. In a verl job the same engine is chosen by
``actor_rollout_ref.rollout.checkpoint_engine.backend=refit`` (docs/integrations/verl.md).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib

import torch


def digests(named) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest() for n, t in named}


async def received(engine, step: int) -> dict[str, torch.Tensor]:
    return {n: t async for n, t in engine.receive_weights(global_steps=step)}


def job(world, steps: int) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from refit.frameworks.verl import RefitCheckpointEngine
    from refit.layout.models import build_model, load_config

    engine = RefitCheckpointEngine(bucket_size=4 << 20, is_master=world.rank == 0)
    if world.src_rank is not None:  # an actor worker: its FSDP2 module, bound once
        model = build_model(load_config("tiny-llama"), torch.float32, seed=0)
        mesh = DeviceMesh.from_group(world.trainer_group, "cpu", mesh_dim_names=("fsdp",))
        fully_shard(model, mesh=mesh)
        engine.bind_module(model)
    lines = []
    for step in range(1, steps + 1):
        meta = engine.prepare()  # verl: on every worker, then build_topology in the driver
        if world.rank == 0:
            world.store.put(f"meta/{step}", meta)
        metadata = [world.store.get(f"meta/{step}", 60)] + [{}] * (world.world_size - 1)
        actor, rollout = RefitCheckpointEngine.build_topology(world.n_src, world.n_dst, metadata)
        mine, i = (actor, world.src_rank) if world.src_rank is not None else (rollout, world.dst_rank)
        engine.init_process_group(**{k: v[i] for k, v in mine.items()})
        if world.src_rank is not None:
            ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 5e-2 * p.grad
                    p.grad = None
            want = digests((n, p.full_tensor()) for n, p in model.named_parameters())
            if world.rank == 0:
                world.store.put(f"sha/{step}", want)
            asyncio.run(engine.send_weights(iter(()), global_steps=step))  # verl's generator: never read
        else:
            got = asyncio.run(received(engine, step))
            exact = digests(got.items()) == world.store.get(f"sha/{step}", 60)
            lines.append(
                f"rollout worker {world.dst_rank} step {step}: {engine.stats.bytes_per_refit:,} B, exact {exact}"
            )
        engine.finalize()
    torch.distributed.barrier()  # every process done with the store trainer rank 0 hosts
    engine.close()
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from refit.tools.launch import run_local

    out = "\n".join(r for r in run_local(job, 2, 2, args.steps, backend="gloo") if r)
    print(out)
    ok = "exact False" not in out
    print("PASS: every rollout worker received every step exactly" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
