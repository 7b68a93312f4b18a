"""What a LoRA adapter is to refit: its spec, the names of its tensors, their shapes, and the merge.

An adapter puts a low-rank update on some linear modules of an HF model. For module ``m`` (an HF
module path such as ``model.layers.0.self_attn.q_proj`` whose base weight ``m.weight`` is
``[out, in]``) it holds ``m.lora_A.weight`` ``[r, in]`` and ``m.lora_B.weight`` ``[out, r]``; the
module then computes ``x @ (W + scale * B @ A).T``, with ``scale = alpha / r`` (``alpha / sqrt(r)``
under rsLoRA). These names are PEFT's saved names without its ``base_model.model.`` prefix, and what
vLLM's LoRA loader reads.

Two ways into an engine: the adapter itself (its A and B tensors, ``adapter_names``), or merged into
the base weights (``merge_weight``): only the touched modules' weights change. An engine that fuses
modules (vLLM's ``qkv_proj``, ``gate_up_proj``) and reloads a fused layer as a whole needs all of the
layer's parts even where only one changed (``engine_layer_params``).

Pure: names, shapes and one torch expression; nothing reads a model or imports PEFT or vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit.errors import ConfigError, LayoutError
from refit.layout.hf_names import fused_target, split_name

LORA_A = "lora_A"
LORA_B = "lora_B"
_SPEC_KEYS = frozenset({"name", "rank", "alpha", "use_rslora", "modules"})


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA adapter as refit sends it: ``name`` (what the engine calls it), ``rank`` ``r``, ``alpha``,
    ``use_rslora`` and the HF paths of the ``modules`` it adapts (sorted, unique, each a module whose
    base weight is 2-D). One rank and one alpha for every module (PEFT's ``rank_pattern`` /
    ``alpha_pattern`` are refused where the spec is read). Validated here (``ConfigError`` naming the
    field and the value); ``to_json`` / ``from_json`` carry it as plain data through the store."""

    name: str
    rank: int
    alpha: float
    modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        """Every field checked: ``ConfigError`` naming it and the value."""
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"LoraSpec.name must be non-empty text without '/', got {self.name!r}")
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"LoraSpec.rank must be an integer >= 1, got {r!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a) or a == 0:
            raise ConfigError(f"LoraSpec.alpha must be a finite non-zero number, got {a!r}")
        if not isinstance(self.use_rslora, bool):
            raise ConfigError(f"LoraSpec.use_rslora must be a bool, got {self.use_rslora!r}")
        mods = self.modules
        if not isinstance(mods, tuple) or not mods or not all(isinstance(m, str) and m for m in mods):
            raise ConfigError(f"LoraSpec.modules must be a non-empty tuple of module paths, got {mods!r}")
        if list(mods) != sorted(set(mods)):
            raise ConfigError(f"LoraSpec.modules must be sorted and unique, got {list(mods)}")
        bad = [m for m in mods if LORA_A in m.split(".") or LORA_B in m.split(".") or m.startswith("base_model.")]
        if bad:
            raise ConfigError(f"LoraSpec.modules must be the base model's module paths, got {bad[0]!r}")

    @property
    def scale(self) -> float:
        """What ``B @ A`` is multiplied by: ``alpha / r``, or ``alpha / sqrt(r)`` under rsLoRA (PEFT's and vLLM's)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def to_json(self) -> dict[str, Any]:
        """Plain data (``from_json`` reads it back)."""
        return {
            "name": self.name,
            "rank": self.rank,
            "alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "modules": list(self.modules),
        }

    @classmethod
    def from_json(cls, d: Any) -> LoraSpec:
        """The spec ``to_json`` wrote, checked key by key (``ConfigError``: unknown or missing keys, bad values)."""
        if not isinstance(d, Mapping) or set(d) != _SPEC_KEYS:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ConfigError(f"a LoRA spec must have exactly the keys {sorted(_SPEC_KEYS)}, got {got}")
        if not isinstance(d["modules"], list):
            raise ConfigError(f"LoraSpec.modules must be a list in JSON, got {type(d['modules']).__name__}")
        return cls(d["name"], d["rank"], d["alpha"], tuple(d["modules"]), d["use_rslora"])

    def peft_config(self) -> dict[str, Any]:
        """The adapter's config as PEFT's ``adapter_config.json`` spells it (what vLLM's ``PEFTHelper`` reads)."""
        leaves = sorted({m.rsplit(".", 1)[-1] for m in self.modules})
        return {"r": self.rank, "lora_alpha": self.alpha, "use_rslora": self.use_rslora, "target_modules": leaves}


def adapter_names(module: str) -> tuple[str, str]:
    """The names of module ``module``'s A (``[r, in]``) and B (``[out, r]``) tensors."""
    return f"{module}.{LORA_A}.weight", f"{module}.{LORA_B}.weight"


def adapter_shapes(spec: LoraSpec, base_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """Every adapter tensor's name and shape, in ``spec.modules`` order, from the base weights' shapes
    (``{module: (out, in)}``); ``LayoutError`` for a module without one or whose weight is not 2-D."""
    out: dict[str, tuple[int, int]] = {}
    for m in spec.modules:
        shape = base_shapes.get(m)
        if shape is None:
            raise LayoutError(f"LoRA module {m!r} of adapter {spec.name!r} is not a linear module of the base model")
        if len(shape) != 2:
            raise LayoutError(f"LoRA module {m!r}: its base weight has shape {list(shape)}, not [out, in]")
        a, b = adapter_names(m)
        out[a] = (spec.rank, shape[1])
        out[b] = (shape[0], spec.rank)
    return out


def check_adapter_tensors(
    spec: LoraSpec, tensors: Mapping[str, tuple[int, ...]], base_shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """That ``tensors`` (name -> shape) are exactly the adapter ``spec`` describes over base weights of
    ``base_shapes``: ``LayoutError`` naming the first missing, extra or misshapen tensor with both shapes
    (a wrong rank shows here: ``[8, 64]`` where the spec says ``[4, 64]``)."""
    want = adapter_shapes(spec, base_shapes)
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise LayoutError(f"adapter {spec.name!r}: tensor {extra[0]!r} is not one of its modules' A/B tensors")
    for name, shape in want.items():
        got = tensors.get(name)
        if got is None:
            raise LayoutError(f"adapter {spec.name!r}: tensor {name!r} is missing")
        if tuple(got) != shape:
            raise LayoutError(
                f"adapter {spec.name!r}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                f"(rank {spec.rank})"
            )


def merge_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``base + (b @ a) * scale`` (PEFT's merge, same operations in the same order, so the same bits), into
    ``out`` if given (no allocation but the product's). ``base`` ``[out, in]``, ``a`` ``[r, in]``, ``b``
    ``[out, r]``; ``LayoutError`` on shapes that do not chain."""
    if (
        a.dim() != 2
        or b.dim() != 2
        or base.dim() != 2
        or b.shape[1] != a.shape[0]
        or base.shape
        != (
            b.shape[0],
            a.shape[1],
        )
    ):
        raise LayoutError(
            f"LoRA merge: base {list(base.shape)} != B {list(b.shape)} @ A {list(a.shape)} (B [out, r], A [r, in])"
        )
    delta = (b @ a) * scale
    return torch.add(base, delta, out=out) if out is not None else base + delta


def engine_layer_params(modules: Iterable[str], params: Iterable[str]) -> list[str]:
    """The base parameters an engine reloading whole fused layers needs when ``modules`` change: every
    parameter in ``params`` (the base model's names, in their order) of a module that shares a fused
    engine parameter (``hf_names.fused_target``: q/k/v, gate/up) with one of ``modules``, or is one of them
    (weights and biases alike)."""
    modules = set(modules)
    groups = {_group(m) for m in modules}
    out = []
    for p in params:
        module, _ = split_name(p)
        if module in modules or _group(module) in groups:
            out.append(p)
    return out


def _group(module: str) -> str:
    """A module's fused engine module (``...self_attn.qkv_proj``), or the module itself where none."""
    target = fused_target(f"{module}.weight")
    return target.module if target is not None else module
