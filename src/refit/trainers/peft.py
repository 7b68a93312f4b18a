"""A PEFT LoRA model as refit's source: the adapter alone, or the base weights it touches, merged.

    model = get_peft_model(hf_model, LoraConfig(r=8, lora_alpha=16, target_modules=[...]))
    source = LoraAdapterSource(model, world_size)   # an engine serving LoRA (vLLM enable_lora=True)
    source = MergedLoraSource(model, world_size)    # any engine: W + scale * B @ A of the touched modules

Both take a PEFT model whose adapter is plain LoRA on ``nn.Linear`` modules (one rank and alpha, no
DoRA, no LoRA bias, no ``modules_to_save``, no ``fan_in_fan_out``), every trainer rank holding all of
it (data parallel; DTensor adapters are refused). Names are the base model's HF names
(``hf_name``): ``model.layers.0.self_attn.q_proj.lora_A.weight`` for the adapter,
``model.layers.0.self_attn.q_proj.weight`` for a base weight. Nothing is gathered or copied at setup
but the merged buffers; a refit reads the live adapter parameters.

Work per refit: ``LoraAdapterSource`` none (its ``local()`` are the live ``lora_A`` / ``lora_B``
parameters; it moves ``2 * r * (in + out)`` elements per module); ``MergedLoraSource.prepare``
recomputes ``W + scale * B @ A`` for the adapted modules into buffers allocated once (O(adapted
parameters); PEFT's own merge, bit for bit) before the refit reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from refit.errors import ConfigError, LayoutError
from refit.layout import Mesh, ModelLayout, TensorLayout
from refit.layout.lora import LoraSpec, adapter_names, check_adapter_tensors, engine_layer_params, merge_weight

PEFT_PREFIX = "base_model.model."
BASE_LAYER = "base_layer"


def hf_name(peft_name: str, adapter: str = "default") -> str:
    """The HF name of a PEFT model's parameter: ``base_model.model.`` dropped, ``X.base_layer.weight`` ->
    ``X.weight`` (the base weight), ``X.lora_A.<adapter>.weight`` -> ``X.lora_A.weight``. ``LayoutError``
    for another adapter's tensor (``lora_A.<other>``)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    parts = name.split(".")
    out = []
    for i, p in enumerate(parts):
        if p == BASE_LAYER:
            continue
        if i > 0 and parts[i - 1] in ("lora_A", "lora_B"):
            if p != adapter:
                raise LayoutError(f"{peft_name!r} belongs to adapter {p!r}, not {adapter!r}")
            continue
        out.append(p)
    return ".".join(out)


@dataclass
class LoraParts:
    """What refit reads of a PEFT LoRA model (``read_lora``): its ``spec``, the live ``adapter`` tensors
    (HF adapter names -> the ``lora_A`` / ``lora_B`` parameters themselves) and the ``base`` parameters
    (HF names -> the frozen base tensors, every one of the model's, in its order)."""

    spec: LoraSpec
    adapter: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]

    def base_weight(self, module: str) -> torch.Tensor:
        """The base weight ``[out, in]`` of adapted module ``module``."""
        return self.base[f"{module}.weight"]


def read_lora(model: nn.Module, adapter: str = "default", name: str | None = None) -> LoraParts:
    """Read ``model`` (a ``peft.PeftModel`` or its ``LoraModel``) for adapter ``adapter`` (``name``: what the
    engine calls it, default the adapter's). ``ConfigError`` naming the setting or module refit cannot
    carry (see the module docstring); ``LayoutError`` if the tensors disagree with the config (a wrong rank)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    config = _lora_config(model, adapter)
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model.model
    modules, adapter_tensors = [], {}
    for mname, mod in base_model.named_modules():
        held = (getattr(mod, "lora_A", {}), getattr(mod, "lora_embedding_A", {}))
        if not isinstance(mod, LoraLayer) or not any(adapter in h for h in held):
            continue
        if not isinstance(mod, LoraLinear) or not isinstance(getattr(mod, "base_layer", None), nn.Linear):
            base = type(getattr(mod, "base_layer", None)).__name__
            raise ConfigError(
                f"LoRA module {mname!r} is a {type(mod).__name__} over {base}: "
                "refit carries LoRA on nn.Linear modules only"
            )
        modules.append(mname)
        a_name, b_name = adapter_names(mname)
        adapter_tensors[a_name] = mod.lora_A[adapter].weight
        adapter_tensors[b_name] = mod.lora_B[adapter].weight
    if not modules:
        raise ConfigError(f"the PEFT model has no LoRA module holding adapter {adapter!r}")
    base = {hf_name(n, adapter): p for n, p in base_model.named_parameters() if ".lora_" not in n}
    for n, t in [*adapter_tensors.items(), *base.items()]:
        if isinstance(t, DTensor):
            raise LayoutError(f"{n!r} is a DTensor: LoRA sources take plain (data-parallel) parameters")
    spec = LoraSpec(name or adapter, int(config.r), config.lora_alpha, tuple(sorted(modules)), bool(config.use_rslora))
    shapes = {m: tuple(base[f"{m}.weight"].shape) for m in spec.modules}
    check_adapter_tensors(spec, {n: tuple(t.shape) for n, t in adapter_tensors.items()}, shapes)
    return LoraParts(spec, {n: adapter_tensors[n] for n in sorted(adapter_tensors)}, base)


_REFUSED = (  # (LoraConfig field, value refit carries, why)
    ("use_dora", False, "DoRA"),
    ("lora_bias", False, "LoRA bias"),
    ("bias", "none", "trained biases"),
    ("fan_in_fan_out", False, "fan_in_fan_out (Conv1D-style weights)"),
)


def _lora_config(model: nn.Module, adapter: str):
    """The adapter's ``LoraConfig``, refused (``ConfigError`` naming the field and value) where refit cannot
    carry it: another PEFT method, DoRA, LoRA bias, trained biases, ``modules_to_save``, per-module ranks
    or alphas, ``target_parameters``, ``layer_replication``."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or adapter not in configs:
        have = sorted(configs) if isinstance(configs, Mapping) else None
        raise ConfigError(f"model has no PEFT adapter {adapter!r} (adapters: {have})")
    c = configs[adapter]
    kind = str(getattr(c, "peft_type", ""))
    if not kind.endswith("LORA") or kind.endswith("ADALORA"):
        raise ConfigError(f"adapter {adapter!r} is peft_type={kind}; refit carries plain LoRA")
    for field_name, ok, what in _REFUSED:
        if getattr(c, field_name, ok) != ok:
            raise ConfigError(f"adapter {adapter!r}: {field_name}={getattr(c, field_name)!r} ({what}) is not supported")
    for field_name in ("modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters", "layer_replication"):
        if getattr(c, field_name, None):
            raise ConfigError(
                f"adapter {adapter!r}: {field_name}={getattr(c, field_name)!r} is not supported "
                "(one rank and alpha for every module, LoRA on nn.Linear modules only)"
            )
    return c


def _replicated(entries: list[tuple[str, torch.Tensor]], world_size: int) -> ModelLayout:
    """Tensors every trainer rank holds whole."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    everyone = Mesh((world_size,), ("dp",), tuple(range(world_size)))
    return ModelLayout(
        tuple(TensorLayout(n, tuple(t.shape), t.dtype, everyone, (Replicate(),)) for n, t in entries), world_size
    )


class LoraAdapterSource:
    """The adapter of a PEFT LoRA model as refit's source, for an engine that serves LoRA adapters.

    ``layout()``: every ``lora_A`` / ``lora_B`` tensor (HF adapter names), whole on every trainer rank;
    ``local()``: the live parameters (no copy); ``lora_spec()``: what the engine needs to serve them
    (rank, alpha, modules; sent as plain data). The vLLM backend (``RefitTrainerEngine.trainer_init(...,
    source=LoraAdapterSource(model, n))``) installs each version as its own adapter
    (``refit.engines.vllm.lora``). Must agree on every rank: the model's adapter config and modules.
    """

    def __init__(self, model: nn.Module, world_size: int, adapter: str = "default", name: str | None = None) -> None:
        self.parts = read_lora(model, adapter, name)
        self.world_size = world_size
        self._layout = _replicated(list(self.parts.adapter.items()), world_size)

    def layout(self) -> ModelLayout:
        return self._layout

    def local(self) -> dict[str, torch.Tensor]:
        return {n: t.detach() for n, t in self.parts.adapter.items()}

    def lora_spec(self) -> LoraSpec:
        return self.parts.spec


class MergedLoraSource:
    """The base weights a PEFT LoRA adapter touches, merged (``W + scale * B @ A``), as refit's source, for
    any engine: the engine already holds the frozen base weights; a refit moves only the adapted modules.

    ``layout()``: the adapted modules' base weights under their HF names (with ``engine_layers=True``,
    the default, every parameter of the engine's fused layers they belong to, e.g. k_proj and v_proj
    beside an adapted q_proj, and biases: vLLM's CPU loader reloads a fused layer whole, and a part
    left out would be lost); ``local()``: buffers for the merged weights (allocated once) and the base
    tensors for the rest; ``prepare(names)``: recompute the merged buffers of ``names`` (``None``: all)
    from the live adapter. The vLLM backend calls ``prepare`` before every refit (through the Peer); with
    a ``Sender`` pass ``prepare=source.prepare``. Extra memory: one weight per adapted module.
    """

    def __init__(
        self, model: nn.Module, world_size: int, adapter: str = "default", *, engine_layers: bool = True
    ) -> None:
        self.parts = read_lora(model, adapter)
        self.world_size = world_size
        spec, base = self.parts.spec, self.parts.base
        merged = {f"{m}.weight" for m in spec.modules}
        names = engine_layer_params(spec.modules, base) if engine_layers else [n for n in base if n in merged]
        self.buffers = {n: torch.empty_like(base[n]) for n in names if n in merged}
        self.tensors = {n: self.buffers.get(n, base[n].detach()) for n in names}
        self._layout = _replicated(list(self.tensors.items()), world_size)
        self.prepare(None)

    def layout(self) -> ModelLayout:
        return self._layout

    def local(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def prepare(self, names: set[str] | None = None) -> None:
        """Recompute the merged weights among ``names`` (``None``: all) from the live adapter."""
        scale = self.parts.spec.scale
        with torch.no_grad():
            for n, out in self.buffers.items():
                if names is not None and n not in names:
                    continue
                module = n.removesuffix(".weight")
                a_name, b_name = adapter_names(module)
                a, b = self.parts.adapter[a_name], self.parts.adapter[b_name]
                merge_weight(self.parts.base[n], a, b, scale, out=out)
