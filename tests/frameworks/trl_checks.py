"""What the TRL tests check of a GRPO run that refit synced (``examples/trl_grpo_refit.py``'s ``train`` and
``train_server`` return the same record): the same checks for the colocated engine and the served one."""

from __future__ import annotations

import torch

from refit.layout import box_numel
from refit.layout.engines import engine_layout
from refit.layout.models import build_model, load_config, param_shapes
from refit.layout.spec import parse_spec


def share_bytes(path: str, tp: int) -> list[int]:
    """Each engine worker's share of the model in vLLM's TP layout, from refit's layout rules (not from the run)."""
    lay = engine_layout(param_shapes(path), parse_spec(f"tp={tp}", "dst"), load_config(path), "vllm")
    return [sum(box_numel(b) * t.dtype.itemsize for t, b in lay.local_tensors(r)) for r in range(tp)]


def check_run(example, result: dict, path: str, steps: int, tp: int) -> None:
    """``steps`` GRPO steps, one sync before each step's generation, vLLM's greedy tokens equal to HF's with the
    trainer's weights after every sync, the weights changed between syncs, and each vLLM worker received exactly
    its TP share of the model at ``path`` per sync (never the whole model); the example's report says PASS."""
    syncs, workers = result["syncs"], result["workers"]
    assert result["global_step"] == steps
    assert [s["step"] for s in syncs] == list(range(steps))  # one sync before each step's generation
    for s in syncs:
        assert s["vllm"] == s["hf"] and s["logprob_diff"] <= 1e-4, s  # vLLM serves exactly the trainer's weights
    assert len({s["weight"] for s in syncs}) == steps  # the weights changed between syncs
    assert [w["refits"] for w in workers] == [steps] * tp and all(w["version"] == steps for w in workers)
    shares = share_bytes(path, tp)
    assert [w["bytes_per_refit"] for w in workers] == shares  # each worker: its TP share only
    assert [w["bytes_received"] for w in workers] == [steps * s for s in shares]
    model_bytes = sum(p.numel() * 4 for p in build_model(load_config(path), torch.float32, seed=0).parameters())
    assert max(shares) < 0.75 * model_bytes and all(s["bytes_sent"] == sum(shares) for s in syncs)
    lines, ok = example.report(result)
    assert ok and lines[-1].startswith("PASS"), lines
