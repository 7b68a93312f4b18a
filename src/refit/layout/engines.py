"""Engine layouts as engines allocate them: padded sizes and replicated KV heads, per engine, as data.

An engine's tensor-parallel rank does not always hold a ``torch.chunk`` piece of an HF tensor. Where an engine pads
a size before splitting it, each rank holds ``padded / tp`` units of which the last ranks' are partly or wholly
padding; refit's layouts keep HF coordinates, so a rank's box is the *real* units of its share (padding never
travels, receivers never write it, moved/needed count real bytes). The rules, read in the installed packages
(vLLM 0.32, SGLang 0.5.23):

* **Vocabulary** (``embed_tokens``, ``lm_head`` rows): padded to a multiple of 64 and split evenly on the padded
  size; rank ``r`` holds rows ``[min(r*p, V), min((r+1)*p, V))``, ``p = padded / tp``.
  vLLM: ``vllm/model_executor/layers/vocab_parallel_embedding.py`` (``DEFAULT_VOCAB_PADDING_SIZE = 64``,
  ``pad_vocab_size``, ``VocabParallelEmbedding._get_indices``; ``divide(num_embeddings_padded, tp_size)`` asserts
  that tp divides the padded size). SGLang: ``sglang/srt/layers/vocab_parallel_embedding.py`` (the same rule, and
  ``padding_size *= tp_size`` when tp does not divide the padded size).
* **KV heads** beyond the TP degree: ``QKVParallelLinear`` (vLLM ``vllm/model_executor/layers/linear.py``, SGLang
  ``sglang/srt/layers/linear.py``) keeps ``num_kv_head_replicas = tp / kv`` copies when tp exceeds the KV heads:
  rank ``r`` holds KV head ``r // (tp / kv)``.
* **SGLang on CPU** (``sglang/srt/configs/update_config.py``, ``adjust_config_with_unaligned_cpu_tp``, called by
  ``ModelRunner`` when ``device == "cpu"``):

  - intermediate sizes (``intermediate_size``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``) are
    padded to a multiple of ``32 * tp`` (``DEFAULT_MOE_PADDING_SIZE``, ``update_intermediate_size``); the weight
    loader narrows the checkpoint to a rank's real rows and zeroes the rest
    (``narrow_padded_param_and_loaded_weight`` in ``sglang/srt/model_loader/weight_utils.py``): 136 at tp=2 is
    192, rank 0 holds rows 0-95, rank 1 rows 96-135 and 56 rows of zeros;
  - when tp divides neither the query nor the KV heads, KV heads are padded to a multiple of tp
    (``get_num_heads_padding_size``: tp, unquantized) and query heads to ``padded_kv * heads / kv``: the padding
    heads come last, so the last ranks may hold no real head at all. SGLang on CPU never replicates KV heads.

vLLM pads none of the dense sizes (its ``divide`` asserts that tp divides heads and intermediate sizes). Its CPU
fused-MoE kernels pad each rank's expert intermediate share after loading (``_pad_moe_intermediate``,
``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``): the share itself stays ``I / tp`` rows of the HF
tensor, so the layout is unchanged (the padding lies inside the rank's repacked parameter, which refit reaches
through vLLM's loaders there).

``engine_layout`` is ``rules.layout_from_spec`` with these splits as explicit boxes where they differ from
``torch.chunk``'s; ``check_engine_fits`` says whether the engine can run the model at the spec at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Shard

from refit.errors import SpecError
from refit.layout.hf_names import (
    STACKED_EXPERTS,
    VOCAB_PARALLEL,
    Role,
    is_weight,
    is_weight_or_bias,
    param_role,
)
from refit.layout.rules import EXPERT_COUNTS, ParamShape, layout_from_spec
from refit.layout.spec import ParallelSpec
from refit.layout.tensors import Box, ModelLayout, TensorLayout

VOCAB_PADDING = 64
"""vLLM's and SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``."""

SGLANG_CPU_INTERMEDIATE_PADDING = 32
"""SGLang's ``DEFAULT_MOE_PADDING_SIZE``: on CPU intermediate sizes are padded to a multiple of this times tp."""


@dataclass(frozen=True)
class EngineRules:
    """How one engine pads and replicates under tensor parallelism (module docstring).

    ``vocab_padding``: the vocabulary is padded to a multiple of it; ``vocab_pad_times_tp``: when tp does not divide
    that, the multiple becomes ``vocab_padding * tp`` (SGLang) instead of the engine refusing (vLLM).
    ``intermediate_padding``: intermediate sizes padded to a multiple of it times tp (None: not padded, tp must
    divide them). ``pad_heads``: heads padded to a multiple of tp where tp does not divide them (SGLang on CPU)
    rather than KV heads replicated."""

    name: str
    vocab_padding: int = VOCAB_PADDING
    vocab_pad_times_tp: bool = False
    intermediate_padding: int | None = None
    pad_heads: bool = False


ENGINES: dict[str, EngineRules] = {
    "vllm": EngineRules("vllm"),
    "sglang": EngineRules("sglang", vocab_pad_times_tp=True),
    "sglang-cpu": EngineRules(
        "sglang-cpu", vocab_pad_times_tp=True, intermediate_padding=SGLANG_CPU_INTERMEDIATE_PADDING, pad_heads=True
    ),
}
"""The engines refit models (``refit plan|verify --engine``): vLLM (CUDA and CPU alike for dense models), SGLang on
CUDA, SGLang on CPU."""


def engine_rules(name: str) -> EngineRules:
    """The rules of engine ``name``; ``SpecError`` naming the known ones otherwise."""
    rules = ENGINES.get(name) if isinstance(name, str) else None
    if rules is None:
        raise SpecError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    return rules


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_share(real: int, padded: int, tp: int, rank: int) -> tuple[int, int]:
    """The real units ``[lo, hi)`` of TP rank ``rank`` when ``real`` units, padded to ``padded``, are split evenly
    over ``tp`` (empty where the rank holds only padding)."""
    per = padded // tp
    return min(rank * per, real), min((rank + 1) * per, real)


@dataclass(frozen=True)
class EngineSizes:
    """The sizes one engine allocates at one TP degree, each ``(real, padded)``; ``kv_replicas`` > 1 where each KV
    head lies on that many consecutive ranks."""

    tp: int
    vocab: tuple[int, int] | None
    heads: tuple[int, int] | None
    kv_heads: tuple[int, int] | None
    kv_replicas: int
    intermediate_padding: int | None

    def intermediate(self, real: int) -> int:
        """The padded size of an intermediate dim of ``real`` units."""
        m = self.intermediate_padding
        return real if m is None else round_up(real, m * self.tp)


def engine_sizes(rules: EngineRules, config: Any, tp: int, vocab: int | None) -> EngineSizes:
    """The padded sizes ``rules``' engine allocates for ``config`` (an HF config) at ``tp``; ``vocab``: the rows of
    the vocab-parallel tensors (None: the model has none)."""
    padded_vocab = None
    if vocab is not None:
        padded_vocab = round_up(vocab, rules.vocab_padding)
        if rules.vocab_pad_times_tp and padded_vocab % tp:
            padded_vocab = round_up(vocab, rules.vocab_padding * tp)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_sizes, kv_sizes, replicas = None, None, 1
    if isinstance(heads, int) and isinstance(kv, int):
        if rules.pad_heads and (heads % tp or kv % tp):  # SGLang CPU: adjust_config_with_unaligned_cpu_tp
            padded_kv = round_up(kv, tp)
            head_sizes, kv_sizes = (heads, padded_kv * (heads // kv)), (kv, padded_kv)
        else:
            head_sizes, kv_sizes = (heads, heads), (kv, kv)
            if tp > kv and tp % kv == 0:
                replicas = tp // kv
    return EngineSizes(
        tp,
        None if vocab is None else (vocab, padded_vocab),
        head_sizes,
        kv_sizes,
        replicas,
        rules.intermediate_padding,
    )


Split = Callable[[int], tuple[int, int]]  # TP coordinate -> [lo, hi) along the sharded dim


def _unit_split(real: int, padded: int, unit: int, tp: int) -> Split | None:
    """``padded_share`` in elements of ``unit``; None where tp does not divide ``padded`` (the engine refuses it:
    ``check_engine_fits`` says so)."""
    if padded % tp:
        return None

    def split(c: int) -> tuple[int, int]:
        lo, hi = padded_share(real, padded, tp, c)
        return lo * unit, hi * unit

    return split


def _head_split(sizes: EngineSizes, n: int, kv: bool) -> Split | None:
    """The split of a dim of ``n`` elements holding whole (query or KV) heads, or None if the config has no heads."""
    real, padded = (sizes.kv_heads if kv else sizes.heads) or (None, None)
    if not real or n % real:
        return None
    unit = n // real
    if kv and sizes.kv_replicas > 1:
        return lambda c: ((c // sizes.kv_replicas) * unit, (c // sizes.kv_replicas + 1) * unit)
    return _unit_split(real, padded, unit, sizes.tp)


def tp_split(name: str, dim: int, n: int, sizes: EngineSizes) -> Split | None:
    """How the engine splits dim ``dim`` (``n`` elements) of tensor ``name`` over TP; None: as ``torch.chunk``."""
    role = param_role(name)
    if role in VOCAB_PARALLEL and is_weight(name) and dim == 0 and sizes.vocab is not None:
        return _unit_split(sizes.vocab[0], sizes.vocab[1], 1, sizes.tp)
    if is_weight_or_bias(name) and dim == 0 and role in (Role.Q_PROJ, Role.K_PROJ, Role.V_PROJ):
        return _head_split(sizes, n, kv=role is not Role.Q_PROJ)
    if is_weight(name) and dim == 1 and role is Role.O_PROJ:
        return _head_split(sizes, n, kv=False)
    intermediate = (
        (role in (Role.GATE_PROJ, Role.UP_PROJ) and is_weight_or_bias(name) and dim == 0)
        or (role is Role.DOWN_PROJ and is_weight(name) and dim == 1)
        or (role in STACKED_EXPERTS and dim == 2)
    )
    if intermediate and sizes.intermediate_padding is not None:
        return _unit_split(n, sizes.intermediate(n), 1, sizes.tp)
    return None


def _vocab_rows(params: Sequence[ParamShape]) -> int | None:
    return next((s[0] for n, s, _ in params if param_role(n) in VOCAB_PARALLEL and is_weight(n) and len(s)), None)


def engine_layout(params: Sequence[ParamShape], spec: ParallelSpec, config: Any, engine: str = "vllm") -> ModelLayout:
    """The layout engine ``engine`` (``ENGINES``) allocates for a model (``params``, its HF ``config``) at the
    destination ``spec``: ``layout_from_spec``'s, with each TP split the engine makes differently (padded vocabulary,
    padded intermediate sizes or heads, replicated KV heads) as explicit real-unit boxes."""
    base = layout_from_spec(params, spec)
    tp = spec.degree("tp")
    if tp == 1:
        return base
    sizes = engine_sizes(engine_rules(engine), config, tp, _vocab_rows(params))
    return ModelLayout(tuple(_engine_tensor(t, sizes) for t in base), base.world_size)


def _engine_tensor(t: TensorLayout, sizes: EngineSizes) -> TensorLayout:
    if "tp" not in t.mesh.dim_names:
        return t
    axis = t.mesh.dim_names.index("tp")
    p = t.placements[axis]
    if not isinstance(p, Shard):
        return t
    split = tp_split(t.name, p.dim, t.shape[p.dim], sizes)
    if split is None:
        return t
    boxes: dict[int, Box] = {}
    for r in t.ranks:
        box = list(t.box(r))
        box[p.dim] = split(t.mesh.coords(r)[axis])
        boxes[r] = tuple(box)
    if all(boxes[r] == t.box(r) for r in t.ranks):
        return t  # the engine's split is torch.chunk's: keep the mesh form (and the plan's digest)
    return TensorLayout(t.name, t.shape, t.dtype, t.mesh, t.placements, boxes, t.row_block)


def check_engine_fits(params: Sequence[ParamShape], spec: ParallelSpec, config: Any, engine: str = "vllm") -> None:
    """``SpecError`` unless engine ``engine`` runs the model (``params``, HF ``config``) at destination ``spec``:

    * tp divides the query heads and either divides the KV heads or is a multiple of them (replicas), unless the
      engine pads heads (SGLang on CPU);
    * tp divides the padded vocabulary (vLLM; SGLang pads further) and, unless the engine pads them, every
      intermediate size;
    * ep divides the routed experts (``rules.EXPERT_COUNTS``);
    * every other TP-split dim is even.

    The message names the engine, the degree, the config field or tensor and its size."""
    rules = engine_rules(engine)
    tp = spec.degree("tp")
    sizes = engine_sizes(rules, config, tp, _vocab_rows(params))
    where = f"engine {rules.name}"
    if sizes.heads is not None:  # padded sizes (SGLang on CPU) are multiples of tp by construction
        _check_heads(sizes, tp, where)
    if sizes.vocab is not None and sizes.vocab[1] % tp:
        raise SpecError(
            f"tp={tp} must divide the vocabulary padded to a multiple of {rules.vocab_padding} "
            f"({sizes.vocab[0]} -> {sizes.vocab[1]}) on {where}"
        )
    experts = next((f for f in EXPERT_COUNTS if getattr(config, f, None)), None)
    if experts is not None and getattr(config, experts) % spec.degree("ep"):
        raise SpecError(
            f"ep={spec.degree('ep')} must divide {experts}={getattr(config, experts)} (a rank holds whole experts)"
        )
    for t in engine_layout(params, spec, config, engine):
        if t.boxes is not None or param_role(t.name) in VOCAB_PARALLEL:
            continue  # split by the engine's own rule (checked above for the vocabulary)
        for dim, p in zip(t.mesh.dim_names, t.placements):
            degree = spec.degree(dim)
            if dim in ("tp", "ep") and isinstance(p, Shard) and t.shape[p.dim] % degree:
                raise SpecError(
                    f"{dim}={degree} must divide dim {p.dim} of {t.name} {list(t.shape)} on {where}: "
                    f"{t.shape[p.dim]} is not a multiple of {degree}"
                )


def _check_heads(sizes: EngineSizes, tp: int, where: str) -> None:
    heads, kv = sizes.heads[1], sizes.kv_heads[1]
    if heads % tp:
        raise SpecError(f"tp={tp} must divide num_attention_heads={heads} (a rank holds whole heads) on {where}")
    if kv % tp and tp % kv:
        raise SpecError(
            f"tp={tp} must divide num_key_value_heads={kv} or be a multiple of it (KV heads replicated) on {where}"
        )
