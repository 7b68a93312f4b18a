"""Hugging Face parameter names: what a parameter is, which decoder layer and expert it belongs to, and
which fused engine parameter (vLLM, SGLang) it lands in. The one home of HF naming in refit: sharding
rules, engine regions, FP8 selection and trainers ask these functions instead of matching names.

A name is ``<module path>.<param>``; the module's last segment says what the parameter is:

=====================================================  ======================================================
``model.embed_tokens.weight``                           ``EMBED``
``lm_head.weight``                                      ``LM_HEAD``
``model.layers.3.self_attn.q_proj.weight`` (and bias)   ``Q_PROJ``; ``K_PROJ``, ``V_PROJ``, ``O_PROJ`` alike
``model.layers.3.self_attn.q_a_proj.weight``            MLA (DeepSeek-V3, Kimi-K2): ``Q_A_PROJ``, ``Q_B_PROJ``,
                                                        ``KV_A_PROJ`` (``kv_a_proj_with_mqa``), ``KV_B_PROJ``
``model.layers.3.mlp.gate_proj.weight``                 ``GATE_PROJ``, ``UP_PROJ``, ``DOWN_PROJ``: dense MLPs
                                                        and shared experts (``mlp.shared_expert(s).gate_proj``)
``model.layers.3.mlp.gate.weight``                      ``ROUTER`` (Mixtral ``block_sparse_moe.gate``;
                                                        DeepSeek's ``gate.e_score_correction_bias``)
``model.layers.3.mlp.shared_expert_gate.weight``        ``SHARED_EXPERT_GATE`` (Qwen2-MoE)
``model.layers.3.mlp.experts.gate_up_proj``             ``EXPERTS_GATE_UP``: experts stacked by transformers >= 5,
                                                        ``[E, 2I, H]``; ``experts.down_proj`` ``[E, H, I]``:
                                                        ``EXPERTS_DOWN``
``model.layers.3.mlp.experts.5.gate_proj.weight``       ``EXPERT_GATE``, ``EXPERT_UP``, ``EXPERT_DOWN``: one
                                                        expert (checkpoints; Mixtral's ``w1`` / ``w3`` / ``w2``)
``model.layers.3.self_attn.q_norm.weight``              ``Q_NORM``, ``K_NORM`` (Qwen3's per-head norms)
``model.layers.3.input_layernorm.weight``               ``NORM`` (any other ``*norm`` module in a layer)
``model.norm.weight``                                   ``FINAL_NORM`` (``norm`` outside the layers)
any other ``*_proj`` module                             ``PROJ``: a linear projection no rule knows
anything else                                           ``OTHER``
=====================================================  ======================================================

Fused engine parameters (``fused_target``): vLLM and SGLang load q/k/v into ``qkv_proj`` (shards
``"q"``, ``"k"``, ``"v"``), gate/up into ``gate_up_proj`` (shards 0, 1), and experts into the MoE
layer's ``w13_weight`` (gate: shard ``"w1"``, up: ``"w3"``) and ``w2_weight`` (down: ``"w2"``).
MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa`` (vLLM's ``fused_qkv_a_proj``) are not mapped: refit
sends them whole.

Everything here is pure: names in, facts out; nothing imports torch modules or reads a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from refit.errors import ModelError


class Role(str, Enum):
    """What kind of parameter an HF name denotes (see the module docstring's table)."""

    EMBED = "embed_tokens"
    LM_HEAD = "lm_head"
    Q_PROJ = "q_proj"
    K_PROJ = "k_proj"
    V_PROJ = "v_proj"
    O_PROJ = "o_proj"
    Q_A_PROJ = "q_a_proj"
    Q_B_PROJ = "q_b_proj"
    KV_A_PROJ = "kv_a_proj_with_mqa"
    KV_B_PROJ = "kv_b_proj"
    GATE_PROJ = "gate_proj"
    UP_PROJ = "up_proj"
    DOWN_PROJ = "down_proj"
    ROUTER = "router"
    SHARED_EXPERT_GATE = "shared_expert_gate"
    EXPERTS_GATE_UP = "experts.gate_up_proj"
    EXPERTS_DOWN = "experts.down_proj"
    EXPERT_GATE = "expert.gate_proj"
    EXPERT_UP = "expert.up_proj"
    EXPERT_DOWN = "expert.down_proj"
    Q_NORM = "q_norm"
    K_NORM = "k_norm"
    NORM = "norm"
    FINAL_NORM = "final_norm"
    PROJ = "proj"
    OTHER = "other"


# module names (a name's second-to-last segment) that say the role by themselves
_BY_MODULE: dict[str, Role] = {
    r.value: r
    for r in (
        Role.EMBED,
        Role.LM_HEAD,
        Role.Q_PROJ,
        Role.K_PROJ,
        Role.V_PROJ,
        Role.O_PROJ,
        Role.Q_A_PROJ,
        Role.Q_B_PROJ,
        Role.KV_A_PROJ,
        Role.KV_B_PROJ,
        Role.GATE_PROJ,
        Role.UP_PROJ,
        Role.DOWN_PROJ,
        Role.SHARED_EXPERT_GATE,
        Role.Q_NORM,
        Role.K_NORM,
    )
}
EXPERTS = "experts"
"""The module holding a MoE layer's experts (stacked parameters, or one numbered child per expert)."""
ROUTER_MODULE = "gate"
"""A MoE layer's router module (``mlp.gate``); dense MLPs name their gate ``gate_proj``."""
_STACKED: dict[str, Role] = {"gate_up_proj": Role.EXPERTS_GATE_UP, "down_proj": Role.EXPERTS_DOWN}
_PER_EXPERT: dict[str, Role] = {
    "gate_proj": Role.EXPERT_GATE,
    "up_proj": Role.EXPERT_UP,
    "down_proj": Role.EXPERT_DOWN,
    "w1": Role.EXPERT_GATE,  # Mixtral
    "w3": Role.EXPERT_UP,
    "w2": Role.EXPERT_DOWN,
}
LAYERS = "layers"
"""The module list of decoder layers: ``...layers.<i>.``."""

# Megatron-style tensor parallelism, as vLLM's linear layers split them
COLUMN_PARALLEL = frozenset(
    {
        Role.Q_PROJ,
        Role.K_PROJ,
        Role.V_PROJ,
        Role.Q_B_PROJ,
        Role.KV_B_PROJ,
        Role.GATE_PROJ,
        Role.UP_PROJ,
        Role.EXPERT_GATE,
        Role.EXPERT_UP,
    }
)
"""Output-dim split (weight and bias rows): ``ColumnParallelLinear``, ``QKVParallelLinear``,
``MergedColumnParallelLinear``. MLA's low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa`` are replicated."""
ROW_PARALLEL = frozenset({Role.O_PROJ, Role.DOWN_PROJ, Role.EXPERT_DOWN})
"""Input-dim split of the weight (columns); the bias is whole: ``RowParallelLinear``."""
VOCAB_PARALLEL = frozenset({Role.EMBED, Role.LM_HEAD})
"""Vocab rows split: ``VocabParallelEmbedding``, ``ParallelLMHead``."""
STACKED_EXPERTS = frozenset({Role.EXPERTS_GATE_UP, Role.EXPERTS_DOWN})
"""All experts of a layer in one tensor (logical shapes ``[E, 2, I, H]`` and ``[E, H, I]``)."""
LINEAR = COLUMN_PARALLEL | ROW_PARALLEL | STACKED_EXPERTS | {Role.Q_A_PROJ, Role.KV_A_PROJ, Role.PROJ}
"""Linear projections (attention, MLP, shared, routed and stacked experts); not embeddings, lm_head,
norms or routers."""
LAST_STAGE = frozenset({Role.LM_HEAD, Role.FINAL_NORM})
"""Outside the decoder layers and after them: on the last pipeline stage."""
HEAD_LOCAL_NORMS = frozenset({Role.Q_NORM, Role.K_NORM})
"""Norms replicated over TP that act on each rank's own heads (their gradients are partial sums)."""

# fused engine parameters (vLLM, SGLang)
QKV_PROJ = "qkv_proj"
GATE_UP_PROJ = "gate_up_proj"
W13 = "w13_weight"
W2 = "w2_weight"
_FUSED_DENSE: dict[Role, tuple[str, str | int]] = {
    Role.Q_PROJ: (QKV_PROJ, "q"),
    Role.K_PROJ: (QKV_PROJ, "k"),
    Role.V_PROJ: (QKV_PROJ, "v"),
    Role.GATE_PROJ: (GATE_UP_PROJ, 0),
    Role.UP_PROJ: (GATE_UP_PROJ, 1),
}
_FUSED_EXPERT: dict[Role, tuple[str, str | None]] = {
    Role.EXPERTS_GATE_UP: (W13, None),
    Role.EXPERTS_DOWN: (W2, None),
    Role.EXPERT_GATE: (W13, "w1"),
    Role.EXPERT_UP: (W13, "w3"),
    Role.EXPERT_DOWN: (W2, "w2"),
}
QKV_SHARDS = ("q", "k", "v")

MODULE_ALIASES: tuple[tuple[str, str], ...] = ((".mlp.", ".block_sparse_moe."),)
"""(transformers' segment, the checkpoint's and vLLM's): transformers >= 5 calls Mixtral's MoE block
``mlp``; its checkpoints and vLLM call it ``block_sparse_moe``."""


def split_name(name: str) -> tuple[str, str]:
    """(module path, parameter): ``"a.b.weight"`` -> ``("a.b", "weight")``; ``("", name)`` without a dot."""
    module, _, param = name.rpartition(".")
    return module, param


def layer_of(name: str) -> int | None:
    """The decoder layer index of ``name`` (the first ``layers.<i>.`` in it), or None outside the layers."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == LAYERS and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def expert_of(name: str) -> int | None:
    """The expert index of a per-expert name (``experts.<e>.``), or None (stacked or no expert)."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == EXPERTS and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def param_role(name: str) -> Role:
    """What kind of parameter ``name`` is, from its last two segments (one expert: its last four)."""
    parts = name.split(".")
    if len(parts) < 2:
        return Role.OTHER
    module, param = parts[-2], parts[-1]
    if module == EXPERTS and param in _STACKED:
        return _STACKED[param]
    if len(parts) >= 4 and parts[-4] == EXPERTS and parts[-3].isdigit() and module in _PER_EXPERT:
        return _PER_EXPERT[module]
    role = _BY_MODULE.get(module)
    if role is not None:
        return role
    if module == ROUTER_MODULE:
        return Role.ROUTER
    if module == "norm" and layer_of(name) is None:
        return Role.FINAL_NORM
    if module.endswith("norm"):
        return Role.NORM
    if module.endswith("_proj"):
        return Role.PROJ
    return Role.OTHER


def is_weight(name: str) -> bool:
    """Whether ``name`` is a module's ``weight`` (not its bias, nor a bare parameter)."""
    return name.endswith(".weight")


def is_weight_or_bias(name: str) -> bool:
    """Whether ``name`` is a module's ``weight`` or ``bias``."""
    return name.endswith((".weight", ".bias"))


@dataclass(frozen=True)
class FusedTarget:
    """Where HF parameter ``name`` lands in an engine that fuses parameters (vLLM, SGLang).

    ``module`` is the engine's module path, ``param`` its parameter there (``weight``, ``bias``,
    ``w13_weight``, ``w2_weight``), ``shard`` the part the HF tensor fills: ``"q"``/``"k"``/``"v"`` of
    ``qkv_proj``, ``0`` (gate) / ``1`` (up) of ``gate_up_proj``, ``"w1"`` (gate) / ``"w3"`` (up) /
    ``"w2"`` (down) of one expert (``expert_of(name)``) of ``w13_weight`` / ``w2_weight``, or None for
    stacked experts (the whole fused parameter: every expert, gate and up).
    """

    module: str
    param: str
    shard: str | int | None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"


def fused_target(name: str) -> FusedTarget | None:
    """The fused engine parameter HF parameter ``name`` is loaded into, or None where engines keep
    it as it is (o/down projections, norms, embeddings, MLA, routers...)."""
    role = param_role(name)
    module, param = split_name(name)
    parent = module.rpartition(".")[0]
    if role in _FUSED_DENSE:
        fused, shard = _FUSED_DENSE[role]
        return FusedTarget(f"{parent}.{fused}" if parent else fused, param, shard)
    if role in _FUSED_EXPERT:
        fused, shard = _FUSED_EXPERT[role]
        experts = module if role in STACKED_EXPERTS else parent.rpartition(".")[0]
        return FusedTarget(experts, fused, shard)
    return None


def num_layers(names: Iterable[str]) -> int:
    """The number of decoder layers ``names`` span: one more than the largest layer index (0 if none)."""
    idx = [i for i in map(layer_of, names) if i is not None]
    return max(idx) + 1 if idx else 0


def is_fused_gate_up(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``name`` of ``shape`` is HF's stacked experts' fused gate/up ``[E, 2I, H]``."""
    return param_role(name) is Role.EXPERTS_GATE_UP and len(shape) == 3


def logical_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape refit's layouts give HF parameter ``name``: HF's fused stacked-expert
    ``gate_up_proj`` ``[E, 2I, H]`` is ``[E, 2, I, H]`` (gate, then up); everything else as is."""
    if is_fused_gate_up(name, shape):
        e, two_i, h = shape
        if two_i % 2:
            raise ModelError(f"{name} {list(shape)}: the fused gate/up dim {two_i} is odd")
        return (e, 2, two_i // 2, h)
    return tuple(shape)


def module_aliases(path: str) -> list[str]:
    """Other names of transformers module ``path`` in checkpoints and vLLM (``MODULE_ALIASES``)."""
    return [path.replace(a, b) for a, b in MODULE_ALIASES if a in path]
