"""verl's own classes drive a refit sync on CPU, as Ray actors: ``examples/verl_checkpoint_engine.py``'s ``verl_job``.

What runs, all verl 0.9.1's own code unless named: a ``RayWorkerGroup`` (CPU ``RayResourcePool``) of one actor of
verl's ``ActorRolloutRefWorker`` (role ``actor``: its ``__init__``, ``init_model`` building the checkpoint engine
from verl's generated PPO config through ``CheckpointEngineRegistry.new``, ``update_weights`` and
``execute_checkpoint_engine``); one rollout replica (a ``RolloutReplica`` subclass without an inference server) of 2
Ray actors of verl's ``CheckpointEngineWorker`` (its ``__init__`` imports ``custom_backend_module``, builds the
backend from ``engine_kwargs.refit`` and joins verl's process group on ``cpu:gloo``; its ``update_weights`` feeds
the server adapter); and ``CheckpointEngineManager.update_weights`` (abort, release, ``build_process_group``,
update, finalize, resume) for 2 steps with an SGD step before each. One trainer rank keeps the actors few (a
2-rank FSDP2 trainer is ``test_verl.py``'s; the example's ``--verl-workers`` runs 2 ranks). Asserted: every
rollout worker's adapter holds exactly its TP share of the trainer's weights, bit for bit, after every sync;
refit's statistics count exactly that share's bytes; verl's full-tensor generators were handed over and never
read; verl's sync metrics come back.

The example's stand-ins, each where verl has no CPU path: the training engine (verl's FSDP engine is registered
for ``cuda`` and ``npu`` only: ``@EngineRegistry.register(..., device=["cuda", "npu"])`` on
``FSDPEngineWithLMHead`` in verl/workers/engine/fsdp/transformer_impl.py), so the actor worker's
``actor_worker_cls`` is a ``TrainingWorker`` holding torch's FSDP2 module on gloo; the server adapter (verl's vLLM
and SGLang adapters pass weights to GPU engines through CUDA IPC), a ``BaseRollout`` that keeps the received share
in CPU tensors; ``sgd_step`` in place of verl's PPO update. No verl code is patched.

Not run: a verl PPO/GRPO training step (``update_actor`` / ``compute_log_prob`` need the FSDP engine above) and a
rollout engine's generation (verl's replicas start vLLM/SGLang servers on GPUs).

Cost: about 90 CPU-s beyond the verl import every test worker pays at collection (Ray's processes, and one trainer
rank and two rollout workers each importing torch and verl).
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="verl is not installed here (scripts/test.sh installs it)")
ray = pytest.importorskip("ray")

from .examples import load_example  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

STEPS, N_TRAINER, ROLLOUT_TP = 2, 1, 2


PORT_TAKEN = "address already in use"  # verl's worker group picks its process group's port free and binds it later


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    """One Ray session and one verl job for the module (Ray and each actor's imports are the cost). Where another
    test took the port verl's worker group picked before its process group bound it (EADDRINUSE, seen once under
    xdist), the job runs again in a fresh Ray session (twice at most)."""
    started = not ray.is_initialized()
    for attempt in range(3):
        if started:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            out = load_example("verl_checkpoint_engine").verl_job(
                STEPS, N_TRAINER, ROLLOUT_TP, str(tmp_path_factory.mktemp("verl-model"))
            )
            break
        except Exception as e:
            if started:
                ray.shutdown()
            if not started or attempt == 2 or PORT_TAKEN not in str(e).lower():
                raise
    try:
        yield out
    finally:
        if started:
            ray.shutdown()


def test_verl_manager_syncs_each_rollout_worker_its_tp_share_bit_for_bit(verl_run):
    out = verl_run
    assert out["exact"] == [[True] * ROLLOUT_TP] * STEPS  # every worker, every step, its share of this step's weights
    share = out["share_bytes"]
    assert all(s < 0.75 * out["model_bytes"] for s in share)  # a TP share, not the model
    assert sum(share) > out["model_bytes"]  # norms are on both ranks; everything else is split
    assert out["bytes"] == [share] * STEPS  # refit's statistics: exactly the share, every step
    for stats in out["stats"]:
        assert (stats["refits"], stats["version"], stats["bytes_total"]) == (
            STEPS,
            STEPS,
            STEPS * stats["bytes_per_refit"],
        )


def test_verl_hands_its_full_tensor_generator_and_refit_never_reads_it(verl_run):
    assert verl_run["generators_read"] == [[False] * STEPS] * N_TRAINER
    # verl's manager merges the trainer ranks' metrics: refit's, with this step as the version
    assert [m["refit/version"] for m in verl_run["metrics"]] == list(range(1, STEPS + 1))
    assert all(m["refit/bytes_sent"] > 0 for m in verl_run["metrics"])
