"""Test-only worker methods, called by name (``llm.collective_rpc("refit_test_...")``) like refit's own.

``harness.make_llm`` starts every test engine with ``WorkerTestExtension``; vLLM's worker processes
import this module by its qualified name (``harness.importable_by_workers`` puts its directory on
``PYTHONPATH`` while the engine starts). Arguments and results are plain data: nothing is pickled.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from refit.engines.vllm.extension import RefitWorkerExtension
from refit.layout.models import build_model, load_config

from .leaks import snapshot

PROBE = "model.layers.0.self_attn.q_proj.weight"


class WorkerTestExtension(RefitWorkerExtension):
    """refit's worker methods plus the tests' own (``refit_test_*``)."""

    def refit_test_snapshot(self) -> dict[str, list]:
        """This worker's threads and TCP sockets (``leaks.snapshot``)."""
        return snapshot()

    def refit_test_lora_ids(self) -> dict[str, Any]:
        """The LoRA adapter ids vLLM's LoRA manager holds in this worker now (``ids``, sorted) and how often
        refit registered its adapter again after vLLM cleared them all (``restored``)."""
        adapters = self.weight_transfer_engine.adapters
        return {
            "ids": sorted(self.model_runner.get_model().lora_manager.list_adapters()),
            "restored": adapters.restored if adapters is not None else None,
        }

    def refit_test_insecure(self) -> dict[str, Any]:
        """vLLM's pickle switches (``*INSECURE_SERIALIZATION``) as this worker reads them, and whether any is in
        its environment: ``{"read": {name: value}, "in_env": [names]}``."""
        import vllm.envs as envs

        names = [n for n in dir(envs) if n.endswith("INSECURE_SERIALIZATION")]
        return {"read": {n: bool(getattr(envs, n)) for n in names}, "in_env": [n for n in names if n in os.environ]}

    def refit_test_compare_loaders(self, config_dir: str) -> dict[str, Any]:
        """Three fresh copies of this worker's model (its TP share), zeroed: one loaded by vLLM's loaders
        from the checkpoint transformers wrote (``config_dir/ckpt``), one written box by box through
        ``live_target`` (the direct path), one loaded by vLLM's loaders from ``loader_tensors`` (the
        loader path). Returns the parameters that differ from the first (``differ``; loader path
        prefixed ``loader:``), the rule counts, elements written, the model's elements, and why the
        live (processed) model has no direct target for ``PROBE``."""
        from safetensors.torch import load_file

        hf = build_model(load_config(config_dir), torch.float32, seed=7)
        checkpoint = load_file(os.path.join(config_dir, "ckpt", "model.safetensors"))  # the same weights, as saved
        loaded, direct, boxed = _fresh_models(self.vllm_config, 3)
        loaded.load_weights(iter(checkpoint.items()))  # vLLM's loaders, the checkpoint as transformers wrote it
        weights = _logical(hf.state_dict())
        rules, written = _write_boxes(weights, direct, boxed)
        a, b, c = dict(loaded.named_parameters()), dict(direct.named_parameters()), dict(boxed.named_parameters())
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        differ += [f"loader:{n}" for n in a if not torch.equal(a[n], c[n])]
        return {
            "differ": differ,
            "params": len(a),
            "rules": rules,
            "written": written,
            "model_numel": sum(v.numel() for v in weights.values()),
            "why_live": _why_no_live_target(self.model_runner.model, weights[PROBE].shape),
        }


def _fresh_models(vllm_config, n: int) -> list[torch.nn.Module]:
    """``n`` freshly built (not yet processed) copies of the worker's model, every parameter zero."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    with set_current_vllm_config(vllm_config):
        models = [initialize_model(vllm_config=vllm_config, prefix=f"refit_check_{i}") for i in range(n)]
    for m in models:
        for p in m.parameters():
            p.data.fill_(0)
    return models


def _logical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors in the shapes refit's layouts use (``logical_shape``: stacked experts)."""
    from refit.layout.hf_names import logical_shape

    return {k: v.reshape(logical_shape(k, tuple(v.shape))).contiguous() for k, v in state.items()}


def _write_boxes(weights: dict[str, torch.Tensor], direct, boxed) -> tuple[dict[str, int], int]:
    """Write each tensor's box into ``direct``'s live targets and load ``boxed`` through ``loader_tensors``;
    return the rule counts and the elements written."""
    from refit.engines.vllm.regions import live_target, loader_tensors, region
    from refit.layout import box_slices

    rules, written, loader_in = {}, 0, []
    for name, t in weights.items():
        box, rule = region(direct, name, t.shape)
        view, why = live_target(direct, name, t.shape, box, rule)
        assert view is not None, f"{name}: {why}"
        view.copy_(t[box_slices(box)])
        rules[rule] = rules.get(rule, 0) + 1
        written += view.numel()
        loader_in += list(loader_tensors(boxed, name, t.shape, box, t[box_slices(box)].clone()))
    boxed.load_weights(iter(loader_in))
    return rules, written


def _why_no_live_target(model, shape) -> str:
    """What the live model does after loading on this (CPU) backend: linear weights repacked, originals dropped."""
    from refit.engines.vllm.regions import live_target, region

    box, rule = region(model, PROBE, shape)
    return live_target(model, PROBE, shape, box, rule)[1]
