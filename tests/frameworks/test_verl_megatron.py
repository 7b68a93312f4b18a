"""refit as verl's checkpoint engine for a Megatron-Core actor, with the real ``verl`` and ``megatron-core``.

verl's Megatron workers hold the actor as Megatron ``GPTModel`` chunks in a default process group of the trainer
ranks alone. Here two trainer processes (one job, its own default group) run a TP=2 ``GPTModel`` on CPU and take
training steps; two rollout workers (another job, one replica of TP 2) receive each step through
``RefitCheckpointEngine`` driven in the order of verl's ``CheckpointEngineManager.update_weights``. The two jobs
meet only through files (trainer rank 0's ``prepare()`` metadata, what each worker must receive) and refit's own
store and group. Each worker receives exactly its TP share of the HF weights, bit for bit, every step.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed here (scripts/test.sh installs it)")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here (scripts/test.sh installs it)")

import torch  # noqa: E402

from refit.frameworks.verl import RefitCheckpointEngine  # noqa: E402
from refit.layout import box_numel, box_slices  # noqa: E402
from refit.tools.launch import run_local  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

STEPS = 2
N_TRAINER, N_WORKER = 2, 2


def _put(folder: str, name: str, value) -> None:
    tmp = Path(folder) / f".{name}.{os.getpid()}"
    tmp.write_text(json.dumps(value))
    os.replace(tmp, Path(folder) / name)


def _get(folder: str, name: str, timeout_s: float = 240.0):
    path, end = Path(folder) / name, time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{name} did not appear in {timeout_s} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _join(engine: RefitCheckpointEngine, rank: int, meta: dict) -> None:
    metadata = [meta] + [{}] * (N_TRAINER + N_WORKER - 1)
    actor, rollout = RefitCheckpointEngine.build_topology(N_TRAINER, N_WORKER, metadata)
    mine, i = (actor, rank) if rank < N_TRAINER else (rollout, rank - N_TRAINER)
    engine.init_process_group(**{k: v[i] for k, v in mine.items()})


def _trainer(world, folder: str) -> dict:
    from transformers import AutoConfig

    import refit.tools.megatron_cpu as mc
    from refit.layout.models import PRESETS

    mc.patch_for_cpu()
    mc.init_parallel(tp=2, pp=1)
    preset = PRESETS["tiny-llama"]
    hf_config = AutoConfig.for_model(preset.model_type, **preset.config)
    model = mc.build_gpt(preset.config, preset.model_type, seed=0)
    engine = RefitCheckpointEngine(1 << 20, world.rank == 0, rollout_tp=2, shard_aware_adapter=True)
    engine.bind_module([model], hf_config=hf_config)  # verl's Megatron actor: a list of chunks
    tokens = torch.randint(0, hf_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    out = {"bytes": []}
    for step in range(1, STEPS + 1):
        mc.train_steps(model, tokens, steps=1)
        full = mc.gather_hf_state(model, hf_config)  # the oracle (a collective of the trainer ranks)
        meta = engine.prepare()
        if world.rank == 0:
            _put(folder, f"meta-{step}", meta)
        _join(engine, world.rank, _get(folder, f"meta-{step}"))
        asyncio.run(engine.send_weights(iter(()), global_steps=step))  # verl's full tensors: never read
        out["bytes"].append(engine.stats.bytes_per_refit)
        if world.rank == 0:
            for w in range(N_WORKER):
                want = {t.name: _digest(full[t.name][box_slices(box)]) for t, box in engine.dst.local_tensors(w)}
                _put(folder, f"sha-{step}-{w}", want)
        engine.finalize()
    if world.rank == 0:
        for w in range(N_WORKER):
            _get(folder, f"done-{w}")  # the workers are done with the store this rank hosts
    engine.close()
    out["stats"] = vars(engine.stats)
    return out


async def _received(engine: RefitCheckpointEngine, step: int) -> dict[str, torch.Tensor]:
    return {n: t async for n, t in engine.receive_weights(global_steps=step)}


def _worker(world, folder: str) -> dict:
    w = world.rank
    engine = RefitCheckpointEngine(1 << 20, False, rollout_tp=2, shard_aware_adapter=True)
    out = {"exact": [], "bytes": []}
    for step in range(1, STEPS + 1):
        _join(engine, N_TRAINER + w, _get(folder, f"meta-{step}"))
        got = asyncio.run(_received(engine, step))
        out["exact"].append({n: _digest(t) for n, t in got.items()} == _get(folder, f"sha-{step}-{w}"))
        out["bytes"].append(engine.stats.bytes_per_refit)
        engine.finalize()
    boxes = list(engine.dst.local_tensors(w))
    out["share"] = sum(box_numel(b) * t.dtype.itemsize for t, b in boxes)
    out["model_bytes"] = engine.dst.nbytes
    _put(folder, f"done-{w}", True)
    engine.close()
    return out


def test_megatron_tp2_actor_refits_a_tp2_rollout_replica_through_the_verl_contract(tmp_path):
    results: dict[str, list] = {}

    def trainers() -> None:
        results["trainers"] = run_local(_trainer, N_TRAINER, 0, str(tmp_path), backend="gloo", timeout_s=500)

    thread = threading.Thread(target=trainers)
    thread.start()
    try:
        workers = run_local(_worker, 0, N_WORKER, str(tmp_path), backend="gloo", timeout_s=500)
    finally:
        thread.join()
    trainers_out = results["trainers"]
    for w in workers:
        assert w["exact"] == [True] * STEPS, w["exact"]  # each step's weights, bit for bit, in this worker's share
        assert w["bytes"] == [w["share"]] * STEPS  # exactly its share each step
        assert w["share"] < 0.75 * w["model_bytes"]  # a TP share, not the model
    for t in trainers_out:
        assert t["stats"]["refits"] == STEPS and t["stats"]["version"] == STEPS
    sent = [sum(t["bytes"][s] for t in trainers_out) for s in range(STEPS)]
    assert sent == [sum(w["share"] for w in workers)] * STEPS  # every byte sent once, by the rank holding it
    assert all(t["bytes"][0] > 0 for t in trainers_out)  # both TP ranks send: nothing gathered on one
