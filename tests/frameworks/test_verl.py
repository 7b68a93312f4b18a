"""refit as verl's checkpoint engine, with the real ``verl`` package.

What runs: verl's registry finds ``refit`` (``CheckpointEngineRegistry.get`` / ``new``, the keyword arguments
verl's workers pass), the base class's contract (no abstract method left, ``build_topology``'s lists as
``CheckpointEngineManager.build_process_group`` checks them, verl's ``CheckpointEngineConfig`` naming the
module), and the sync between refit engines in separate processes (``examples/verl_checkpoint_engine.py``'s
``job``, run here with the example's own code), driven step by step the way
``CheckpointEngineManager.update_weights`` drives them (prepare, build_topology, init_process_group, send and
receive concurrently, finalize), from a 2-rank FSDP2 trainer that takes SGD steps into one rollout replica of TP 2:
each rollout worker receives exactly its TP share, bit for bit, and verl's full-tensor generator is never read.

verl's own worker classes (``ActorRolloutRefWorker``, ``CheckpointEngineWorker``), its ``RayWorkerGroup`` and
its ``CheckpointEngineManager`` driving the same engine as Ray actors: ``test_verl_workers.py``. Not run anywhere
here: a verl PPO/GRPO training step (verl's FSDP engine is registered for ``cuda`` and ``npu`` only) and a verl
rollout engine (its vLLM/SGLang servers and adapters, which pass weights through CUDA IPC), so the greedy-token
check against HF is made for TRL (``test_trl.py``) and refit's vLLM backend (``tests/vllm_backend``), not here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="verl is not installed here (scripts/test.sh installs it)")

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402

from refit.errors import ConfigError  # noqa: E402
from refit.frameworks.verl import RefitCheckpointEngine  # noqa: E402
from refit.tools.launch import run_local  # noqa: E402

from .examples import load_example  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

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
    with pytest.raises(RuntimeError, match="init_process_group has not run"):
        rollout.share()  # a worker's share exists once it joined and received


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


def _example_job(world, steps: int, rollout_tp: int) -> dict:
    return load_example("verl_checkpoint_engine").job(world, steps, rollout_tp)


def test_fsdp2_trainer_refits_a_tp2_rollout_replica_through_the_verl_contract():
    """examples/verl_checkpoint_engine.py's job with one rollout replica of TP 2: each worker receives its share."""
    results = run_local(_example_job, 2, 2, STEPS, 2, backend="gloo", timeout_s=400)
    trainers, workers = results[:2], results[2:]
    for r in results:
        assert r["peers"] == 1  # one plan for every step: finalize keeps it, init_process_group re-joins nothing
        assert r["stats"]["refits"] == STEPS and r["stats"]["version"] == STEPS
    assert all(all(t["unread"]) and len(t["unread"]) == STEPS for t in trainers)  # verl's generator never read
    assert [t["metrics"]["refit/bytes_sent"] for t in trainers] == [t["bytes"][-1] for t in trainers]
    for w in workers:
        assert w["exact"] == [True] * STEPS, w["exact"]  # each step's weights, bit for bit, in this worker's share
        assert w["bytes"] == [w["share"]] * STEPS  # exactly its share each step
        assert w["share"] < 0.75 * w["model_bytes"]  # a TP share, not the model
    assert workers[0]["share"] + workers[1]["share"] > workers[0]["model_bytes"]  # norms go to both ranks
    sent = [sum(t["bytes"][s] for t in trainers) for s in range(STEPS)]
    assert sent == [workers[0]["share"] + workers[1]["share"]] * STEPS  # every byte sent once, by its holder
    lines, ok = load_example("verl_checkpoint_engine").report(results)
    assert ok and lines[-1].startswith("PASS"), lines


def test_a_megatron_actor_is_bound_with_its_hf_config():
    import torch

    class GPTModel(torch.nn.Module):  # what verl's Megatron workers hold, as refit tells it apart
        pass

    GPTModel.__module__ = "megatron.core.models.gpt.gpt_model"
    engine = RefitCheckpointEngine(is_master=True)
    with pytest.raises(ConfigError, match="hf_config"):
        engine.bind_module([GPTModel()])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        engine.bind_module([])
