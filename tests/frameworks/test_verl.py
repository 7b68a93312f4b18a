"""refit as verl's checkpoint engine, with the real ``verl`` package.

What runs: verl's registry finds ``refit`` (``CheckpointEngineRegistry.get`` / ``new``, the keyword arguments
verl's workers pass), the base class's contract (no abstract method left, ``build_topology``'s lists as
``CheckpointEngineManager.build_process_group`` checks them, verl's ``CheckpointEngineConfig`` naming the
module), and the sync between refit engines in separate processes, driven step by step the way
``CheckpointEngineManager.update_weights`` drives them (prepare, build_topology, init_process_group, send and
receive concurrently, finalize), from a 2-rank FSDP2 trainer that takes SGD steps into one rollout replica of TP 2:
each rollout worker receives exactly its TP share, bit for bit, and verl's full-tensor generator is never read.

What does not run, and why: verl's own worker classes (``ActorRolloutRefWorker``, ``CheckpointEngineWorker``)
and its ``CheckpointEngineManager`` run only as Ray actors of a GPU cluster (verl's FSDP engine places the actor
on CUDA/NPU, and its vLLM server adapter hands weights to vLLM's workers through CUDA IPC), so no verl training
step and no verl rollout engine run on this CPU machine; the greedy-token check against HF is therefore made
for TRL (``test_trl.py``) and refit's vLLM backend (``tests/vllm_backend``), not here.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed here (scripts/frameworks_setup.sh installs it)")

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402

from refit.errors import ConfigError  # noqa: E402
from refit.frameworks.verl import RefitCheckpointEngine  # noqa: E402
from refit.layout import box_numel, box_slices  # noqa: E402
from refit.layout.models import build_model, load_config  # noqa: E402
from refit.tools.launch import run_local  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
STEPS = 2


def test_verl_registry_finds_refit_and_builds_it_as_its_workers_do():
    assert CheckpointEngineRegistry.get("refit") is RefitCheckpointEngine
    assert issubclass(RefitCheckpointEngine, CheckpointEngine)
    assert not RefitCheckpointEngine.__abstractmethods__
    # the arguments verl's actor worker and CheckpointEngineWorker pass, with engine_kwargs.refit spread in
    trainer = CheckpointEngineRegistry.new("refit", is_master=True, bucket_size=8 << 20, rollout_tp=1)
    rollout = CheckpointEngineRegistry.new("refit", bucket_size=8 << 20)
    assert (trainer.is_master, rollout.is_master, trainer.bucket_size) == (True, False, 8 << 20)
    meta = trainer.prepare()
    assert meta["master_port"] > 0 and trainer.prepare() == meta  # one store for every step
    assert rollout.prepare() == {}


def test_verl_config_names_the_refit_module():
    from verl.workers.config import CheckpointEngineConfig

    cfg = CheckpointEngineConfig(backend="refit", custom_backend_module="refit.frameworks.verl")
    assert (cfg.backend, cfg.custom_backend_module) == ("refit", "refit.frameworks.verl")


def test_build_topology_gives_each_worker_group_one_entry_per_worker():
    meta = RefitCheckpointEngine(is_master=True).prepare()
    actor, rollout = RefitCheckpointEngine.build_topology(2, 4, [meta, {}, {}, {}, {}, {}])
    for kwargs, n in ((actor, 2), (rollout, 4)):
        assert all(len(v) == n for v in kwargs.values())  # what CheckpointEngineManager asserts
    assert actor["rank"] == [0, 1] and rollout["rank"] == [2, 3, 4, 5]
    assert set(actor["role"]) == {"trainer"} and set(rollout["role"]) == {"rollout"}
    assert all(m == meta for m in actor["master_metadata"] + rollout["master_metadata"])
    with pytest.raises(ConfigError, match="metadata\\[0\\]"):
        RefitCheckpointEngine.build_topology(2, 4, [{}, meta, {}, {}, {}, {}])


def test_rollout_tp_above_one_needs_a_shard_aware_adapter():
    with pytest.raises(ConfigError, match="rollout_tp=2"):
        RefitCheckpointEngine(rollout_tp=2)
    with pytest.raises(ConfigError, match="rollout_tp must be"):
        RefitCheckpointEngine(rollout_tp=0)


def _fsdp_model(world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(load_config(MODEL), torch.float32, seed=0)
    mesh = DeviceMesh.from_group(world.trainer_group, "cpu", mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sgd_step(model, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, load_config(MODEL).vocab_size, (2, 12), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 5e-2 * p.grad
            p.grad = None


class FullTensors:
    """verl's ``get_per_tensor_param()`` stand-in: gathers each parameter when read, and says whether it was."""

    def __init__(self, model) -> None:
        self.model, self.read = model, False

    def __iter__(self):
        self.read = True
        for n, p in self.model.named_parameters():
            yield n, p.full_tensor()


def _manager_step(engine, world, step: int) -> dict:
    """One ``CheckpointEngineManager.update_weights`` round seen from one process: prepare, the driver's
    build_topology (trainer rank 0's metadata shared through the job's store), init_process_group."""
    meta = engine.prepare()
    if world.rank == 0:
        world.store.put(f"meta/{step}", meta)
    meta0 = world.store.get(f"meta/{step}", 60)
    metadata = [meta0] + [{}] * (world.world_size - 1)
    actor, rollout = RefitCheckpointEngine.build_topology(world.n_src, world.n_dst, metadata)
    side, i = (actor, world.rank) if world.src_rank is not None else (rollout, world.dst_rank)
    engine.init_process_group(**{k: v[i] for k, v in side.items()})
    return meta0


async def _collect(gen) -> dict:
    return {n: t.clone() async for n, t in gen}


def _verl_job(world, folder: str) -> dict:
    trainer = world.src_rank is not None
    engine = RefitCheckpointEngine(1 << 20, world.rank == 0, rollout_tp=2, shard_aware_adapter=True)
    model = _fsdp_model(world) if trainer else None
    if trainer:
        engine.bind_module(model)
    out = {"peers": set(), "bytes": [], "exact": [], "unread": []}
    for step in range(1, STEPS + 1):
        _manager_step(engine, world, step)
        if trainer:
            _sgd_step(model, step)
            full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}  # the check's reference
            if world.rank == 0:
                torch.save(full, os.path.join(folder, f"step{step}.tmp"))
                os.replace(os.path.join(folder, f"step{step}.tmp"), os.path.join(folder, f"step{step}.pt"))
            weights = FullTensors(model)
            metrics = asyncio.run(engine.send_weights(iter(weights), global_steps=step))
            out["unread"].append(not weights.read)
            out["metrics"] = metrics
        else:
            got = asyncio.run(_collect(engine.receive_weights(global_steps=step)))
            want = torch.load(os.path.join(folder, f"step{step}.pt"), weights_only=True)
            boxes = dict((t.name, box) for t, box in engine.dst.local_tensors(world.dst_rank))
            out["exact"].append(all(torch.equal(got[n], want[n][box_slices(boxes[n])]) for n in boxes))
            out["share"] = sum(box_numel(b) * want[n].element_size() for n, b in boxes.items())
            out["model_bytes"] = sum(t.numel() * t.element_size() for t in want.values())
        out["peers"].add(id(engine.peer))
        out["bytes"].append(engine.stats.bytes_per_refit)
        engine.finalize()
    out["stats"] = vars(engine.stats)
    out["peers"] = len(out["peers"])
    torch.distributed.barrier()  # every process done with the store trainer rank 0 hosts
    engine.close()
    return out


def test_fsdp2_trainer_refits_a_tp2_rollout_replica_through_the_verl_contract(tmp_path):
    results = run_local(_verl_job, 2, 2, str(tmp_path), backend="gloo", timeout_s=400)
    trainers, workers = results[:2], results[2:]
    for r in results:
        assert r["peers"] == 1  # one plan for every step: finalize keeps it, init_process_group re-joins nothing
        assert r["stats"]["refits"] == STEPS and r["stats"]["version"] == STEPS
    assert all(all(t["unread"]) for t in trainers)  # verl's gathering generator was never read
    assert [t["metrics"]["refit/bytes_sent"] for t in trainers] == [t["bytes"][-1] for t in trainers]
    for w in workers:
        assert all(w["exact"]), w["exact"]  # each step's weights, bit for bit, in this worker's share
        assert w["bytes"] == [w["share"]] * STEPS  # exactly its share each step
        assert w["share"] < 0.75 * w["model_bytes"]  # a TP share, not the model
    assert workers[0]["share"] + workers[1]["share"] > workers[0]["model_bytes"]  # norms go to both ranks
    sent = [sum(t["bytes"][s] for t in trainers) for s in range(STEPS)]
    assert sent == [workers[0]["share"] + workers[1]["share"]] * STEPS  # every byte sent once, by its holder
