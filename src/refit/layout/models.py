"""Model presets (HF configs) and their parameter shapes, with no weights allocated."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from refit.errors import ModelError
from refit.jsonio import MAX_JSON_BYTES, read_json
from refit.layout import shape_cache
from refit.layout.hf_names import logical_shape
from refit.layout.rules import ParamShape


@dataclass(frozen=True)
class Preset:
    """A named model: its HF ``model_type``, the dtype its weights are trained in, and the config fields
    (``transformers``' ``AutoConfig.for_model(model_type, **config)``) from which shapes are derived."""

    model_type: str
    dtype: torch.dtype
    config: dict[str, Any]


_TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

_DSV3 = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_group=8,
    topk_group=4,
    max_position_embeddings=163840,
    tie_word_embeddings=False,
)

PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("llama", torch.float32, dict(_TINY)),
    "tiny-qwen2": Preset("qwen2", torch.float32, {**_TINY, "intermediate_size": 320}),
    "tiny-qwen3": Preset("qwen3", torch.float32, {**_TINY, "intermediate_size": 192}),
    "tiny-qwen3-moe": Preset(
        "qwen3_moe",
        torch.float32,
        {
            **_TINY,
            "intermediate_size": 192,
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
    # shared experts beside the routed ones (a dense MLP and a sigmoid gate)
    "tiny-qwen2-moe": Preset(
        "qwen2_moe",
        torch.float32,
        {
            **_TINY,
            "intermediate_size": 192,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 96,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": False,
        },
    ),
    # the sizes engines pad or replicate, in one model (one engine start covers them all): a vocabulary of 1003
    # (engines pad it to 1024 and split the padded size), an intermediate size of 136 (SGLang on CPU pads it to a
    # multiple of 32 x tp: 192 at tp=2), 2 KV heads (replicated at tp=4)
    "tiny-llama-odd": Preset(
        "llama",
        torch.float32,
        {**_TINY, "vocab_size": 1003, "intermediate_size": 136, "num_hidden_layers": 2},
    ),
    "tiny-mixtral": Preset(
        "mixtral",
        torch.float32,
        {
            **{k: v for k, v in _TINY.items() if k != "head_dim"},
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3-30b-a3b": Preset(
        "qwen3_moe",
        torch.bfloat16,
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-235b-a22b": Preset(
        "qwen3_moe",
        torch.bfloat16,
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
    # MLA attention (q_a/kv_a low-rank projections), 3 dense layers then 256 routed experts + 1 shared
    "deepseek-v3": Preset("deepseek_v3", torch.bfloat16, dict(_DSV3)),
    # Kimi-K2: DeepSeek-V3's architecture with 384 experts, 64 heads, 1 dense layer (about 1.03T parameters)
    "kimi-k2": Preset(
        "deepseek_v3",
        torch.bfloat16,
        {
            **_DSV3,
            "vocab_size": 163840,
            "first_k_dense_replace": 1,
            "n_routed_experts": 384,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "n_group": 1,
            "topk_group": 1,
            "max_position_embeddings": 131072,
        },
    ),
    "llama-3.1-8b": Preset(
        "llama",
        torch.bfloat16,
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-8b": Preset(
        "qwen3",
        torch.bfloat16,
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
}


def load_config(model: str):
    """A transformers config for a preset name or a path to an HF ``config.json`` (or its folder)."""
    from transformers import AutoConfig

    if model in PRESETS:
        p = PRESETS[model]
        return AutoConfig.for_model(p.model_type, **p.config)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ModelError(f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) nor a config.json path")
    raw = read_json(path, "model config", ModelError)
    _check_raw_config(path, raw)
    with _refusals(path):
        return AutoConfig.for_model(raw.pop("model_type"), **raw)


MAX_TENSOR_ELEMENTS = 1 << 40
"""The most elements one tensor of a model may have (about 10^12: 2 TB in bf16, beyond any GPU's memory)."""

MAX_LAYERS = 100_000
"""The most decoder layers a model config may name (today's largest models have about 100)."""


@contextmanager
def _refusals(path: str) -> Iterator[None]:
    """transformers' refusal of a config (a field of the wrong type, heads that do not divide the hidden
    size, ...) as one ``ModelError`` line naming the file and the field where transformers names one."""
    from huggingface_hub.errors import StrictDataclassError, StrictDataclassFieldValidationError

    try:
        yield
    except StrictDataclassFieldValidationError as e:
        cause = e.__cause__ or e
        field = getattr(e, "field", None) or str(e).partition("'")[2].partition("'")[0]
        raise ModelError(f"model config {path!r}: field {field!r}: {_one_line(cause)}") from None
    except (StrictDataclassError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"model config {path!r} is refused by transformers: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
"""config.json fields that size a tensor or count heads, experts or layers: integers >= 1 where given."""

MODEL_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The weight dtypes a config.json may name (``torch_dtype`` or ``dtype``): those transformers can build a
model in. FP8 engines are ``--fp8``; integer dtypes are quantized checkpoints refit does not read."""


def _check_raw_config(path: str, raw: Any) -> None:
    """What a config.json must be before transformers reads it: an object with a known ``model_type``,
    positive integer sizes and a usable dtype (``ModelError`` naming the field and the value)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(raw, dict):
        raise ModelError(f"model config {path!r} must hold a JSON object, got a {type(raw).__name__}")
    kind = raw.get("model_type")
    if kind is None:
        raise ModelError(f'model config {path!r} has no \'model_type\' field (e.g. "llama", "qwen3")')
    if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
        known = len(list(CONFIG_MAPPING.keys()))
        examples = ", ".join(sorted({p.model_type for p in PRESETS.values()}))
        raise ModelError(
            f"model config {path!r}: unknown model_type {kind!r} (transformers knows {known} types, e.g. {examples})"
        )
    _check_fields(path, raw)


def _check_fields(path: str, raw: dict) -> None:
    """Sizes are integers within [1, ``MAX_TENSOR_ELEMENTS``] (layers: ``MAX_LAYERS``), the largest
    tensors they imply within ``MAX_TENSOR_ELEMENTS``, and the dtype is one of ``MODEL_DTYPES``, where
    given: checked before transformers builds anything (a billion layers would take minutes)."""
    for name in _SIZE_FIELDS:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelError(f"model config {path!r}: {name} must be an integer >= 1, got {_short(value)}")
        limit = MAX_LAYERS if name == "num_hidden_layers" else MAX_TENSOR_ELEMENTS
        if value is not None and value > limit:
            raise ModelError(f"model config {path!r}: {name} is {_short(value)}, over the limit of {limit:,}")
    _check_products(path, raw)
    for name in ("torch_dtype", "dtype"):
        value = raw.get(name)
        if value is not None and (not isinstance(value, str) or value not in MODEL_DTYPES):
            raise ModelError(f"model config {path!r}: {name} must be one of {', '.join(MODEL_DTYPES)}, got {value!r}")


def _short(value: Any) -> str:
    """``repr(value)``, cut to 40 characters (a 10^40 size or a long string stays one short line)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"about 10^{len(str(abs(value))) - 1}"
    return text if len(text) <= 40 else text[:37] + "..."


_PRODUCTS = (
    ("vocab_size", "hidden_size"),
    ("intermediate_size", "hidden_size"),
    ("num_attention_heads", "head_dim", "hidden_size"),
    ("num_experts", "moe_intermediate_size", "hidden_size"),
    ("num_local_experts", "intermediate_size", "hidden_size"),
    ("n_routed_experts", "moe_intermediate_size", "hidden_size"),
)
"""Fields whose product is the size of one tensor (the embedding, an MLP projection, an expert stack)."""


def _check_products(path: str, raw: dict) -> None:
    for names in _PRODUCTS:
        values = [raw.get(n) for n in names]
        if all(isinstance(v, int) for v in values) and math.prod(values) > MAX_TENSOR_ELEMENTS:
            raise ModelError(
                f"model config {path!r}: {' x '.join(names)} = {math.prod(values):,} elements in one tensor, "
                f"over the limit of {MAX_TENSOR_ELEMENTS:,}"
            )


def check_tensor_sizes(model: str, shapes: list[ParamShape]) -> None:
    """Every tensor of ``model`` within ``MAX_TENSOR_ELEMENTS`` (``ModelError`` naming the first that is not)."""
    for name, shape, _ in shapes:
        n = math.prod(shape)
        if n > MAX_TENSOR_ELEMENTS:
            raise ModelError(
                f"model {model!r}: tensor {name!r} of shape {list(shape)} has {n:,} elements, "
                f"over the limit of {MAX_TENSOR_ELEMENTS:,}"
            )


def model_dtype(model: str, config) -> torch.dtype:
    """A preset's dtype, else the config's ``dtype`` (``torch_dtype`` before transformers 5), else float32."""
    if model in PRESETS:
        return PRESETS[model].dtype
    # read torch_dtype from the instance: transformers 5 answers the attribute with a deprecation warning
    d = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def build_model(config, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int | None = 0):
    """An HF causal LM from ``config``; on ``"meta"`` no memory is allocated."""
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def param_shapes(model: str, dtype: torch.dtype | None = None) -> list[ParamShape]:
    """(name, shape, dtype) of every logical tensor of ``model``, from shapes alone (tied ones once).

    Logical tensors are the HF parameters; stacked MoE experts keep HF's names
    (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) with the fused
    gate/up dim split in two: ``gate_up_proj`` is ``[E, 2, I, H]`` (HF holds
    ``[E, 2I, H]``, gate rows then up rows: the same memory), ``down_proj``
    ``[E, H, I]`` (``hf_names.logical_shape``). So tensor parallelism inside experts (``Shard(2)``) splits
    gate and up alike, as Megatron's fc1 and vLLM's ``w13`` do, and a rank's
    share is one dense block in HF's tensor, in Megatron's and in vLLM's.
    """
    text = _config_text(model)
    key = shape_cache.shapes_key(text, dtype) if text is not None else None
    shapes = shape_cache.read(key) if key else None
    if shapes is None:
        config = load_config(model)
        dt = dtype or model_dtype(model, config)
        with _refusals(model):
            meta = build_model(config, dt, device="meta", seed=None)
        shapes = [(n, logical_shape(n, tuple(p.shape)), p.dtype) for n, p in meta.named_parameters()]
        check_tensor_sizes(model, shapes)
        if key:
            shape_cache.write(key, shapes)
    return shapes


def _config_text(model: str) -> str | None:
    """What ``model``'s shapes derive from, as text (a preset's fields, a config file's bytes); None for a name
    that is neither (``load_config`` refuses it)."""
    if model in PRESETS:
        p = PRESETS[model]
        return json.dumps([p.model_type, p.config, str(p.dtype)], sort_keys=True)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_JSON_BYTES:
            return None  # load_config says why
        with open(path, "rb") as f:
            return f.read(MAX_JSON_BYTES + 1).decode("utf-8", "replace")
    except OSError:
        return None
