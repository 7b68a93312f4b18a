"""refit as verl's checkpoint engine, driven on CPU the way verl drives it.

    python examples/verl_checkpoint_engine.py [--steps 2] [--rollout-tp 1] [--verl-workers]

Needs verl (scripts/test.sh installs it; docs/integrations/verl.md says how). Two FSDP2 trainer ranks take SGD
steps; the rollout workers (two replicas of TP 1, as verl's server adapters load whole tensors, or with
``--rollout-tp 2`` one replica whose workers each receive only their TP share, for a shard-aware adapter) receive
each step through ``RefitCheckpointEngine``, and each checks what it received against the trainer's weights.

Without ``--verl-workers`` (``job``, run by tests/frameworks/test_verl.py) the processes are refit's and call the
engine in the order of verl's ``CheckpointEngineManager.update_weights``: prepare, build_topology,
init_process_group, send/receive, finalize. With it (``verl_job``, run by tests/frameworks/test_verl_workers.py)
verl drives: its ``ActorRolloutRefWorker`` and ``CheckpointEngineWorker`` as Ray actors, its ``RayWorkerGroup``
and its ``CheckpointEngineManager``, configured by verl's own PPO config with
``actor_rollout_ref.rollout.checkpoint_engine.backend=refit``; only what verl cannot do on CPU is this file's (the
training engine, the server adapter, the inference server: see ``verl_worker_classes``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
from types import SimpleNamespace

import ray
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


def fsdp_policy(group, config=None) -> torch.nn.Module:
    """The actor on this trainer rank: the tiny model (or ``config``'s) under FSDP2 over ``group``'s ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from refit.layout.models import build_model, load_config

    model = build_model(config or load_config(MODEL), torch.float32, seed=0)
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("fsdp",))
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
    model = fsdp_policy(world.trainer_group) if trainer else None
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


# -- verl's own classes driving the sync: Ray actors of verl's workers, verl's manager ---------------------------


def verl_config(n_trainer: int, rollout_tp: int, model_dir: str):
    """verl's own PPO config (its generated defaults) for a CPU job: the tiny model, the refit backend."""
    import os

    import verl.trainer.config
    from omegaconf import OmegaConf, open_dict

    from refit.layout.models import load_config

    hf = load_config(MODEL)
    hf.architectures = ["LlamaForCausalLM"]  # verl's HFModelConfig needs one architecture
    hf.save_pretrained(model_dir)
    path = os.path.join(os.path.dirname(verl.trainer.config.__file__), "_generated_ppo_trainer.yaml")
    cfg = OmegaConf.load(path).actor_rollout_ref
    with open_dict(cfg):
        cfg.model.update(path=model_dir, load_tokenizer=False, override_config={"attn_implementation": "sdpa"})
        cfg.actor.update(ppo_mini_batch_size=n_trainer, ppo_micro_batch_size_per_gpu=1)
        cfg.rollout.update(name="vllm", tensor_model_parallel_size=rollout_tp, log_prob_micro_batch_size_per_gpu=1)
        cfg.rollout.checkpoint_engine.update(
            backend="refit",
            custom_backend_module="refit.frameworks.verl",
            update_weights_bucket_megabytes=1,
            engine_kwargs={"refit": {"rollout_tp": rollout_tp, "shard_aware_adapter": rollout_tp > 1}},
        )
    return cfg


@functools.cache
def verl_worker_classes() -> SimpleNamespace:
    """The classes verl's Ray job uses, made on first use (importing verl's workers is not free): the actor
    worker (verl's ``ActorRolloutRefWorker`` with a CPU training worker, through its ``actor_worker_cls``), the
    rollout server adapter and replica. Run on CPU, each replaces only what verl's CPU-less code would do."""
    from verl.single_controller.base.worker import Worker
    from verl.utils.distributed import initialize_global_process_group_ray
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica

    class CpuEngine:
        """What verl's workers use of its training engine: the module, ``get_per_tensor_param`` (full tensors,
        gathered as read: refit never reads them) and the data-parallel rank. verl's FSDP engine is registered
        for ``cuda`` and ``npu`` only (verl/workers/engine/fsdp/transformer_impl.py, ``EngineRegistry.register``
        of ``FSDPEngineWithLMHead``), so on CPU the module is FSDP2 of torch, as in verl's engine."""

        def __init__(self, module: torch.nn.Module) -> None:
            self.module, self.handed = module, []

        def initialize(self) -> None:
            """verl's ``TrainingWorker.reset``: the model is built already."""

        def get_per_tensor_param(self, **_):
            self.handed.append(FullTensors(self.module))
            return self.handed[-1], None

    class CpuTrainingWorker(TrainingWorker):
        """verl's training worker with the CPU engine: joins verl's process group on gloo (verl's own init asks
        for ``cpu:gloo,cuda:nccl``) and builds the actor under FSDP2 over it."""

        def __init__(self, config) -> None:
            from torch.distributed import get_rank, group  # not torch.distributed.*: see start_verl

            Worker.__init__(self)
            initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
            self.config, self.model_config, self.loss_fn = config, config.model_config, None
            self.engine = CpuEngine(fsdp_policy(group.WORLD, self.model_config.hf_config))
            self._register_dispatch_collect_info(mesh_name="train", dp_rank=get_rank(), is_collect=True)

    class CpuActorWorker(ActorRolloutRefWorker):
        """verl's actor worker (role ``actor``): its own ``init_model``, ``update_weights`` and
        ``execute_checkpoint_engine``; ``init_model`` then binds the actor's module to refit (the hook verl lacks,
        docs/integrations/verl.md) and ``sgd_step`` stands in for verl's PPO update. The methods added here are
        called with ``execute_all_sync``: verl's ``@register`` wraps them in closures Ray cannot ship by value
        (this file is not importable in Ray's workers, so its classes travel by value)."""

        actor_worker_cls = CpuTrainingWorker

        def init_model(self) -> None:
            super().init_model()
            self.checkpoint_engine.bind_module(self.actor.engine.module)

        def sgd_step(self, step: int) -> dict[str, torch.Tensor] | None:
            """One SGD step; returns the full weights on rank 0 (a collective: every rank gathers)."""
            from torch.distributed import get_rank

            model = self.actor.engine.module
            sgd_step(model, step)
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            return full if get_rank() == 0 else None

        def generators_read(self) -> list[bool]:
            """Whether each full-tensor generator verl handed the checkpoint engine was read."""
            return [g.read for g in self.actor.engine.handed]

    class ShardHolder(BaseRollout):
        """The server adapter of a rollout worker: holds what the checkpoint engine yields (this worker's TP
        share) in CPU tensors, where verl's vLLM/SGLang adapters would hand it to the engine's workers."""

        def __init__(self, config, model_config, replica_rank: int) -> None:
            super().__init__(config, model_config, None)
            self.replica_rank, self.is_leader_rank, self.loaded = replica_rank, True, {}

        async def update_weights(self, weights, wire_format: str = "named_tensors", **_):
            if wire_format != "named_tensors":
                raise ValueError(f"ShardHolder loads named tensors, got wire_format={wire_format!r}")
            self.loaded = {name: t.clone() async for name, t in weights}

        async def resume(self, tags: list[str]):
            """Weights and KV cache stay in place on CPU."""

        async def release(self):
            """Weights and KV cache stay in place on CPU."""

    class CpuReplica(RolloutReplica):
        """One rollout replica: its workers are verl's ``CheckpointEngineWorker`` (the class verl's replicas
        start) with the ``ShardHolder`` adapter, and no inference server (``servers`` stays empty, so verl's
        abort/release/resume calls have nothing to reach)."""

        async def launch_servers(self):
            """No server on CPU."""

        def start(self) -> None:
            from verl.checkpoint_engine.base import CheckpointEngineWorker

            from refit.transport.control import free_port

            env = {"WORLD_SIZE": str(self.world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            cls = ray.remote(CheckpointEngineWorker)
            self.workers = [
                cls.options(num_cpus=0, runtime_env={"env_vars": {**env, "RANK": str(r)}}).remote(
                    self.config, self.model_config, ShardHolder(self.config, self.model_config, self.replica_rank)
                )
                for r in range(self.world_size)
            ]

    return SimpleNamespace(actor=CpuActorWorker, replica=CpuReplica)


def _loaded(worker) -> dict:
    """In a rollout worker's actor (``__ray_call__``): what its adapter loaded, its share, refit's statistics."""
    engine = worker.checkpoint_engine
    return {"loaded": worker.server_adapter.loaded, "boxes": engine.share(), "stats": vars(engine.stats)}


def start_verl(n_trainer: int, rollout_tp: int, model_dir: str) -> SimpleNamespace:
    """verl's actor ``RayWorkerGroup`` (``n_trainer`` CPU bundles), one rollout replica of ``rollout_tp`` workers
    (no CPU reserved) and verl's ``CheckpointEngineManager`` over them."""
    import sys

    from ray import cloudpickle
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass

    # Ray's workers cannot import this file: its classes travel by value (where cloudpickle follows
    # torch.distributed.* it meets torch.distributed.config, which does not pickle: those names are imported locally)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg, classes = verl_config(n_trainer, rollout_tp, model_dir), verl_worker_classes()
    pool = RayResourcePool([n_trainer], use_gpu=False, max_colocate_count=1)
    init = RayClassWithInitArgs(cls=ray.remote(classes.actor), config=cfg, role="actor")
    actor_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=init, use_gpu=False, device_name="cpu")
    replica = classes.replica(0, cfg.rollout, omega_conf_to_dataclass(cfg.model))
    replica.start()
    actor_wg.execute_all_sync("init_model")
    manager = CheckpointEngineManager(omega_conf_to_dataclass(cfg.rollout.checkpoint_engine), actor_wg, [replica])
    return SimpleNamespace(actor_wg=actor_wg, replica=replica, manager=manager, pool=pool)


def stop_verl(job: SimpleNamespace) -> None:
    """End the job's actors and free its placement groups (the Ray session may serve others)."""
    for worker in job.actor_wg.workers + job.replica.workers:
        ray.kill(worker)
    for pg in job.pool.pgs or []:
        ray.util.remove_placement_group(pg)


def check_sync(full: dict[str, torch.Tensor], seen: list[dict]) -> list[bool]:
    """Per rollout worker: it loaded exactly its share's tensors, each equal to its box of the trainer's weights."""
    from refit.layout import box_slices

    def exact(s: dict) -> bool:
        same = (torch.equal(full[n][box_slices(s["boxes"][n])], t) for n, t in s["loaded"].items())
        return s["loaded"].keys() == s["boxes"].keys() and all(same)

    return [exact(s) for s in seen]


def verl_job(steps: int, n_trainer: int, rollout_tp: int, model_dir: str) -> dict:
    """verl drives: ``n_trainer`` Ray actors of verl's actor worker, one rollout replica of ``rollout_tp``
    ``CheckpointEngineWorker`` actors, ``CheckpointEngineManager.update_weights`` every step after an SGD step.
    Needs ``ray.init`` done (``n_trainer`` CPUs free). Returns per step each worker's ``exact`` check and refit's
    ``bytes`` received, verl's ``metrics``; then each worker's ``share_bytes`` and ``stats``, ``model_bytes``
    and, per trainer rank and step, whether verl's full-tensor generator was read (``generators_read``)."""
    job = start_verl(n_trainer, rollout_tp, model_dir)
    out = {"exact": [], "bytes": [], "metrics": []}
    try:
        for step in range(1, steps + 1):
            full = job.actor_wg.execute_all_sync("sgd_step", step)[0]
            out["metrics"].append(job.manager.update_weights(global_steps=step))
            seen = ray.get([w.__ray_call__.remote(_loaded) for w in job.replica.workers])
            out["exact"].append(check_sync(full, seen))
            out["bytes"].append([s["stats"]["bytes_per_refit"] for s in seen])
        out["share_bytes"] = [sum(t.nbytes for t in s["loaded"].values()) for s in seen]
        out["stats"], out["model_bytes"] = [s["stats"] for s in seen], sum(t.nbytes for t in full.values())
        out["generators_read"] = job.actor_wg.execute_all_sync("generators_read")
    finally:
        stop_verl(job)
    return out


def verl_report(out: dict) -> tuple[list[str], bool]:
    lines = [
        f"step {step} rollout worker {w}: {n:,} B of {out['model_bytes']:,} B, exact {exact}"
        for step, (ns, ex) in enumerate(zip(out["bytes"], out["exact"]), 1)
        for w, (n, exact) in enumerate(zip(ns, ex))
    ]
    ok = bool(out["exact"]) and all(all(e) for e in out["exact"])
    ok = ok and not any(any(r) for r in out["generators_read"])
    lines.append("PASS: verl's manager synced every rollout worker exactly" if ok else "FAIL")
    return lines, ok


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
    ap.add_argument("--verl-workers", action="store_true", help="verl's own worker classes and manager, on Ray")
    args = ap.parse_args(argv)
    if args.verl_workers:
        import tempfile

        ray.init(num_cpus=2, include_dashboard=False)
        with tempfile.TemporaryDirectory() as model_dir:
            lines, ok = verl_report(verl_job(args.steps, 2, args.rollout_tp, model_dir))
        ray.shutdown()
    else:
        from refit.tools.launch import run_local

        lines, ok = report(run_local(job, 2, 2, args.steps, args.rollout_tp, backend="gloo"))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
