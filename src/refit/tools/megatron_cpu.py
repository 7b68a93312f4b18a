"""Real Megatron-Core GPT models on CPU with gloo, for refit's tests and examples.

A tool module: refit's library never imports it, and it imports ``megatron.core`` at module top. Written for
megatron-core 0.19.2 with a CPU torch: ``pip install torch==2.13.0 numpy 'packaging>=24.2' triton``, then
``pip install --no-deps --ignore-requires-python megatron-core==0.19.2`` (``import megatron.core`` needs triton; it
imports without a GPU). Use, in every process of a gloo job::

    dist.init_process_group("gloo", ...)
    patch_for_cpu()
    init_parallel(tp=2, pp=2)
    model = build_gpt(PRESETS["tiny-llama"].config, "llama", seed=0)
    logits = forward_logits(model, tokens)  # [batch, seq, hf_vocab] on every rank
    losses = train_steps(model, tokens, steps=3)
    weights = gather_hf_state(model, hf_config)  # the whole model under HF names, on every rank (an oracle)

Every call after ``init_parallel`` is collective over the world: every process makes it, in the same order,
with the same arguments (the same ``tokens`` on every process: data-parallel replicas see the same batch).

What differs from Megatron's own training stack, and why:

- Pipeline stages are driven by hand (``dist.send``/``dist.recv`` of the hidden states and of their gradients),
  one micro-batch per step: Megatron's schedules hard-code ``device="cuda"``.
- Weights are re-drawn after construction from one generator per parameter, keyed by the seed and the
  parameter's global identity (``global_param_name``), then sliced as Megatron slices its master weights. So the
  same seed gives the same full model whatever the TP/PP/EP layout. Megatron's own CPU initialisation only
  guarantees that for tensor parallelism: it draws every master weight from the one global torch generator in
  construction order, so a later pipeline stage (which skips the earlier layers and the embedding) and an expert
  on a later EP rank (which skips the other ranks' experts) draw different numbers than the single-process model.
- Norm weights are ``1 + N(0, 0.02)`` and biases ``N(0, 0.02)`` instead of Megatron's constant ones and zeros, so a
  norm or bias that a refit loses or misplaces changes the logits.
- MoE layers train under tensor parallelism without sequence parallelism (which needs apex on CPU): Megatron refuses
  that (``patch_for_cpu`` lifts the refusal) and its experts then see each token once per TP rank
  (``finalize_grads`` divides their gradients by the TP size).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
"""The HF ``model_type``s that ``transformer_config`` maps (dense SwiGLU decoders and their MoE variants)."""

INIT_STD = 0.02
"""Standard deviation of the weights drawn by ``build_gpt`` (Megatron's default ``init_method_std``)."""


# ---------------------------------------------------------------------------------------------- CPU patches


def _cpu_device() -> str:
    return "cpu"


def _no_rng_fork(self, name: str = "model-parallel-rng"):
    return contextlib.nullcontext()


_original_setup_embeddings = LanguageModule.setup_embeddings_and_output_layer


def _setup_embeddings_on_cpu(self) -> None:
    # Megatron moves the tied embedding copy to CUDA (``weight.data.cuda()``) before all-reducing it between the
    # first and last pipeline stage; on CPU that raises. Run it with ``Tensor.cuda`` as the identity, for this call
    # only (reached when pipeline-parallel stages tie the embedding and output weights).
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda t, *args, **kwargs: t
    try:
        _original_setup_embeddings(self)
    finally:
        torch.Tensor.cuda = cuda


_original_moe_forward = MoELayer.forward


def _moe_forward_without_sp_guard(self, *args, **kwargs):
    # In training, MoELayer.forward refuses tensor parallelism without sequence parallelism ("performance may
    # degrade"), and sequence parallelism needs apex norms, absent on CPU. Without it the forward is exact and expert
    # gradients come out tp times too large, which ``finalize_grads`` divides out (tests/test_megatron_cpu.py trains
    # tp=2 x ep=2 and tp=2 x etp=2 to the single-process losses). Present the layer as not training for this call
    # only: in 0.19.2 its own ``training`` flag gates nothing else used here (activation recompute and shared-expert
    # overlap are off); its router, dispatcher and experts keep theirs.
    if not self.training or self.config.sequence_parallel:
        return _original_moe_forward(self, *args, **kwargs)
    self.training = False
    try:
        return _original_moe_forward(self, *args, **kwargs)
    finally:
        self.training = True


def patch_for_cpu() -> None:
    """Let Megatron-Core 0.19.2 run on a machine without CUDA. Idempotent; patches process-wide state.

    1. ``torch.cuda.current_device()`` answers ``"cpu"`` (rotary embeddings, the router and TP gathers place
       tensors on the current device).
    2. ``CudaRNGStatesTracker.fork`` is a ``contextlib.nullcontext()`` (attention forks the CUDA RNG; dropout is
       0 here, so there is no random state to keep apart).
    3. ``LanguageModule.setup_embeddings_and_output_layer`` runs with ``Tensor.cuda`` as the identity: with
       pipeline stages and tied embeddings it calls ``.cuda()`` on the output-layer copy.
    4. ``MoELayer.forward`` skips its training-time refusal of tensor parallelism without sequence parallelism
       (sequence parallelism needs apex norms, absent on CPU); ``finalize_grads`` corrects the expert gradients.
    """
    torch.cuda.current_device = _cpu_device
    CudaRNGStatesTracker.fork = _no_rng_fork
    LanguageModule.setup_embeddings_and_output_layer = _setup_embeddings_on_cpu
    MoELayer.forward = _moe_forward_without_sp_guard


# ---------------------------------------------------------------------------------------------- parallel state


def init_parallel(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """Create Megatron's model-parallel groups over the default (gloo) process group.

    The caller has called ``torch.distributed.init_process_group("gloo")``; every process calls this with the same
    degrees. Data parallelism takes the rest: ``dp = world / (tp * pp)``. Experts are cut ``ep`` ways across
    experts and ``etp`` ways inside each expert (``etp`` None: the same as ``tp``); ``ep * etp * pp`` divides the
    world. Groups of an earlier call are dropped first, so one job may run several layouts in turn.
    Raises ``ValueError`` naming the numbers when the degrees do not fit the world.
    """
    if not dist.is_initialized():
        raise ValueError("init_parallel needs torch.distributed.init_process_group('gloo') first")
    world = dist.get_world_size()
    etp_ = tp if etp is None else etp
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp_)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp={tp} x pp={pp} = {tp * pp}")
    if world % (ep * etp_ * pp):
        raise ValueError(
            f"world size {world} is not divisible by ep={ep} x etp={etp_} x pp={pp} = {ep * etp_ * pp} "
            "(the expert layout)"
        )
    if ps.model_parallel_is_initialized():
        _destroy_groups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp_,
        create_gloo_process_groups=False,  # the default group is gloo already
    )


def _megatron_groups() -> list[dist.ProcessGroup]:
    """The process groups Megatron's parallel state holds (module globals: a group, or a list of groups)."""
    found: dict[int, dist.ProcessGroup] = {}
    for value in vars(ps).values():
        for g in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(g, dist.ProcessGroup) and g is not dist.group.WORLD:
                found[id(g)] = g
    return list(found.values())


def _destroy_groups() -> None:
    """Drop Megatron's groups of the previous layout and destroy them: ``destroy_model_parallel`` only forgets
    them, and each gloo group keeps its threads and sockets (a job of 20 layouts held ~1,450 threads a process)."""
    groups = _megatron_groups()
    ps.destroy_model_parallel()
    for g in groups:
        dist.destroy_process_group(g)


# ---------------------------------------------------------------------------------------------- config


def _hf(hf_config: Mapping[str, Any], model_type: str):
    """The transformers config (its defaults filled in: eps, rope theta, tying) for a supported model type."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (one of {', '.join(MODEL_TYPES)})")
    from transformers import AutoConfig

    c = AutoConfig.for_model(model_type, **dict(hf_config))
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError(f"{model_type}: attention_bias / mlp_bias are not supported (Megatron's add_bias_linear)")
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{model_type}: rope_type {rope['rope_type']!r} is not supported (only 'default')")
    return c


def rope_theta(hf_config: Mapping[str, Any], model_type: str) -> float:
    """The rotary base of an HF config (``rope_parameters['rope_theta']``, or ``rope_theta`` before transformers 5)."""
    c = _hf(hf_config, model_type)
    rope = getattr(c, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _moe_fields(c, model_type: str) -> dict[str, Any]:
    """Megatron's MoE fields for an HF MoE config; every decoder layer must be an MoE layer (the local spec)."""
    if model_type == "mixtral":
        experts, ffn, pre_softmax = c.num_local_experts, c.intermediate_size, False  # top-k renormalised
    else:  # qwen3_moe: softmax over all experts, top-k, renormalised only with norm_topk_prob
        if c.mlp_only_layers or c.decoder_sparse_step != 1:
            raise ValueError(
                f"qwen3_moe with dense layers (mlp_only_layers={c.mlp_only_layers}, "
                f"decoder_sparse_step={c.decoder_sparse_step}) is not supported: every layer must be MoE"
            )
        experts, ffn, pre_softmax = c.num_experts, c.moe_intermediate_size, not c.norm_topk_prob
    return dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=ffn,
        moe_router_topk=c.num_experts_per_tok,
        # softmax after top-k over the k logits == softmax over all, top-k, renormalised
        moe_router_pre_softmax=pre_softmax,
        moe_router_score_function="softmax",
        moe_token_dispatcher_type="allgather",  # alltoall makes a CUDA stream
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )


def transformer_config(
    hf_config: Mapping[str, Any], model_type: str, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for an HF config (the fields of ``Preset.config`` or a config.json) of
    ``model_type`` in ``MODEL_TYPES``, at the given parallel degrees, for CPU float32.

    Mapped: sizes, heads, query groups (``num_key_value_heads``), ``kv_channels`` (``head_dim``, else
    hidden / heads), RMSNorm with the HF eps, SwiGLU, no linear biases except qwen2's q/k/v, per-head q/k RMSNorm for
    qwen3 and qwen3_moe, and MoE routing as the HF model routes (softmax; top-k renormalised for mixtral and for
    qwen3_moe with ``norm_topk_prob``; no load-balancing loss). CPU settings: ``use_cpu_initialization``, dropout 0,
    fusions off, no sequence parallelism. The rotary base is not a config field: pass ``rope_theta(...)`` to
    ``GPTModel`` (``build_gpt`` does). Megatron's own checks raise ``ValueError`` (e.g. heads not divisible by tp).
    """
    c = _hf(hf_config, model_type)
    moe = _moe_fields(c, model_type) if model_type in ("qwen3_moe", "mixtral") else {}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp,
        sequence_parallel=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        init_method_std=INIT_STD,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **moe,
    )


def padded_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's embedding rows: ``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp``
    (rows from ``vocab_size`` on are padding)."""
    m = make_vocab_size_divisible_by * tp
    return -(-vocab_size // m) * m


# ---------------------------------------------------------------------------------------------- model


def build_gpt(
    hf_config: Mapping[str, Any], model_type: str, *, seed: int = 0, make_vocab_size_divisible_by: int = 128
) -> GPTModel:
    """This rank's ``GPTModel`` under the layout set by ``init_parallel`` (collective: every process builds).

    Megatron's local (no Transformer Engine) spec with RMSNorm, rotary positions with the HF rope theta, the embedding
    on the first pipeline stage and the output layer on the last, tied when the HF config ties them. The vocabulary is
    padded (``padded_vocab_size``); ``model.hf_vocab_size`` keeps the HF one. Deterministic: every rank re-draws its
    parameters with ``init_parameters(model, seed)``, so a seed gives the same full (unsharded) weights whatever the
    TP/PP/EP layout; padding rows are zero.
    """
    tp = ps.get_tensor_model_parallel_world_size()
    config = transformer_config(
        hf_config,
        model_type,
        tp=tp,
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )
    c = _hf(hf_config, model_type)
    spec = get_gpt_layer_local_spec(
        config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=config.qk_layernorm
    )
    torch.manual_seed(seed)  # Megatron's own draws; overwritten below
    model = GPTModel(
        config,
        spec,
        vocab_size=padded_vocab_size(c.vocab_size, tp, make_vocab_size_divisible_by),
        max_sequence_length=c.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(c.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config, model_type),
    )
    model.hf_vocab_size = c.vocab_size
    init_parameters(model, seed)
    return model


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def global_param_name(model: GPTModel, name: str) -> str:
    """The name ``name`` (a local ``named_parameters()`` name) has in the single-process model: layer indices are
    global (``layer.layer_number - 1``), expert indices global (``mlp.local_expert_indices``), and the last stage's
    copy of a tied output weight is ``embedding.word_embeddings.weight``."""
    m = _LAYER.match(name)
    if m is None:
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            return "embedding.word_embeddings.weight"
        return name
    layer = model.decoder.layers[int(m.group(1))]
    out = f"decoder.layers.{layer.layer_number - 1}." + name[m.end() :]
    e = _EXPERT.search(out)
    if e is not None:
        expert = layer.mlp.local_expert_indices[int(e.group(1))]
        out = out[: e.start()] + f".mlp.experts.local_experts.{expert}." + out[e.end() :]
    return out


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _draw(key: str, shape: tuple[int, ...], num_layers: int, hf_vocab: int) -> torch.Tensor:
    """The full tensor for the global parameter ``key``, drawn from a generator seeded by ``key`` alone."""
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1)
    if key.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
        full = torch.zeros(shape)
        full[:hf_vocab] = torch.randn((hf_vocab, *shape[1:]), generator=g) * INIT_STD
        return full
    noise = torch.randn(shape, generator=g) * INIT_STD
    if key.endswith("layernorm.weight"):
        return 1.0 + noise
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return noise / math.sqrt(2.0 * num_layers)  # Megatron's scaled init for output projections
    return noise


def _shard(full: torch.Tensor, p: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's part of ``full``, cut as ``_initialize_affine_weight_cpu`` cuts a master weight: pieces of
    ``local / stride`` along ``partition_dim``, pieces ``rank, rank + world, ...`` concatenated."""
    if not getattr(p, "tensor_model_parallel", False) or world == 1:
        return full
    dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
    pieces = torch.split(full, p.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


def _full_shape(p: torch.Tensor, world: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= world
    return tuple(shape)


@torch.no_grad()
def init_parameters(model: GPTModel, seed: int) -> None:
    """Overwrite every parameter in place with its shard of a full tensor drawn from a generator seeded by
    ``(seed, global_param_name)``: weights ``N(0, INIT_STD)`` (``linear_proj`` and ``linear_fc2`` scaled by
    ``1/sqrt(2 * num_layers)``), embedding rows past ``model.hf_vocab_size`` zero, norm weights ``1 + N(0, INIT_STD)``,
    biases ``N(0, INIT_STD)``. Full shapes and cuts follow each parameter's ``partition_dim`` and
    ``partition_stride`` over the tensor-parallel group (the expert-tensor-parallel group for experts)."""
    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    for name, p in model.named_parameters():
        rank, world = etp if _is_expert(name) else tp
        key = f"{seed}:{global_param_name(model, name)}"
        full = _draw(key, _full_shape(p, world), model.config.num_layers, model.hf_vocab_size)
        p.copy_(_shard(full, p, rank, world))


# ---------------------------------------------------------------------------------------------- running


def _inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids ``[b, s]`` and the causal mask ``[b, 1, s, s]`` (True = masked) Megatron's local attention
    takes on CPU."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)
    return positions, mask


def _hidden_shape(model: GPTModel, tokens: torch.Tensor) -> tuple[int, int, int]:
    b, s = tokens.shape
    return (s, b, model.config.hidden_size)  # Megatron's activations are sequence-first


def _stage_forward(model: GPTModel, tokens: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Receive this stage's input from the previous stage (unless first), run the stage, send its output to the
    next (unless last). Returns the output (logits ``[b, s, padded_vocab / tp]`` on the last stage, hidden states
    ``[s, b, h]`` elsewhere) and the received input (None on the first stage)."""
    received = None
    if not ps.is_pipeline_first_stage():
        received = torch.empty(_hidden_shape(model, tokens))
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(grad)
        model.set_input_tensor(received)
    positions, mask = _inputs(tokens)
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return out, received


def hf_vocab_size(model: GPTModel) -> int:
    """The HF vocabulary of ``model``: ``model.hf_vocab_size`` as ``build_gpt`` sets it (rows past it are padding),
    else, for a ``GPTModel`` built elsewhere, Megatron's own ``vocab_size`` (every row a token)."""
    return getattr(model, "hf_vocab_size", model.vocab_size)


def _full_logits(model: GPTModel, out: torch.Tensor) -> torch.Tensor:
    """The last stage's logits gathered over TP, padding columns dropped (autograd passes through)."""
    return gather_from_tensor_model_parallel_region(out)[..., : hf_vocab_size(model)]


def _from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the last pipeline stage holds it, on every stage (a broadcast over the pipeline group)."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return t


@torch.no_grad()
def forward_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[batch, seq, hf_vocab_size(model)]`` of ``tokens`` (``[batch, seq]`` int64, the same on every rank),
    returned on every rank: stages run in turn, the last one gathers its vocabulary shards over TP and broadcasts.
    Collective over the world."""
    model.eval()
    out, _ = _stage_forward(model, tokens, grad=False)
    b, s = tokens.shape
    logits = _full_logits(model, out).contiguous() if ps.is_pipeline_last_stage() else None
    if logits is None:
        logits = torch.empty(b, s, hf_vocab_size(model))
    return _from_last_stage(logits)


def _backward(model: GPTModel, tokens: torch.Tensor, out: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor:
    """Backward through this stage: the loss on the last stage, else the gradient the next stage sends back; then
    the input's gradient to the previous stage. Returns the loss (zero except on the last stage)."""
    if ps.is_pipeline_last_stage():
        logits = _full_logits(model, out)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
    else:
        loss = torch.zeros(())
        grad = torch.empty_like(out)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if received is not None:
        dist.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    return loss.detach()


def _params(model: GPTModel) -> Iterator[tuple[str, torch.nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad)


def finalize_grads(model: GPTModel) -> None:
    """The gradient syncs of Megatron's ``finalize_model_grads`` and DDP that a plain (non-distributed-optimizer)
    step needs here. Collective over the world.

    - The tied embedding / output weight: summed between the first and last pipeline stage.
    - q/k-norm weights: summed over TP (each rank's heads give part of their gradient).
    - The data-parallel mean, as Megatron's DDP takes it: dense gradients summed over the data-parallel group,
      expert gradients over the expert-data-parallel group, both divided by the data-parallel size.
    - Expert gradients divided by the TP size as well: Megatron's expert side assumes each TP rank holds its own
      tokens (sequence parallelism); without it the TP ranks' identical tokens all reach the experts, so each
      expert's gradient is ``tp`` times its share (measured: exactly 2x at tp=2, ep=1 or 2, before this division).

    Other norms and the router get the full gradient on every TP rank already. A parameter without a gradient (an
    expert no token reached) gets a zero one first, so every rank makes the same collectives.
    """
    for _, p in _params(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if ps.get_pipeline_model_parallel_world_size() > 1 and model.share_embeddings_and_output_weights:
        if ps.is_rank_in_embedding_group():
            dist.all_reduce(model.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1 and model.config.qk_layernorm:
        for name, p in _params(model):
            if "q_layernorm" in name or "k_layernorm" in name:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    expert_dp = ps.get_expert_data_parallel_world_size()
    token_copies = 1 if model.config.sequence_parallel else tp
    for name, p in _params(model):
        if _is_expert(name):
            if expert_dp > 1:
                dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
            p.grad.div_(dp * token_copies)
        elif dp > 1:
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group(with_context_parallel=True))
            p.grad.div_(dp)


def train_steps(model: GPTModel, tokens: torch.Tensor, steps: int = 2, lr: float = 1e-2) -> list[float]:
    """``steps`` training steps on ``tokens`` (``[batch, seq]``, the same on every rank); returns each step's loss
    (before its update), on every rank. Collective over the world.

    A step: forward through the pipeline stages, mean cross-entropy of next-token prediction over the HF vocabulary
    on the last stage, backward through the stages (each sends its input's gradient back), ``finalize_grads``, then
    plain SGD in place on every local parameter (``p.data.add_(p.grad, alpha=-lr)``: storage and ``data_ptr`` stay
    the same, so views a refit holds see the new values). Gradients are cleared after each step.
    """
    model.train()
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        out, received = _stage_forward(model, tokens, grad=True)
        loss = _backward(model, tokens, out, received)
        finalize_grads(model)
        with torch.no_grad():
            for _, p in _params(model):
                p.data.add_(p.grad, alpha=-lr)
        losses.append(float(_from_last_stage(loss.reshape(1).clone())))
    model.zero_grad(set_to_none=True)
    return losses


# ---------------------------------------------------------------------------------------------- oracle


def _unshard(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from every TP rank's shard (rank order), undoing ``_shard``: rank ``r``'s ``k``-th piece of
    ``local / stride`` along ``dim`` is piece ``k * world + r`` of the full tensor."""
    pieces = [torch.split(s, s.shape[dim] // stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


@torch.no_grad()
def gather_state(model: GPTModel) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model as the single-process model names and holds it (``global_param_name``,
    full shapes), copied, on every rank. Collective over the world.

    Each TP-split parameter (``tensor_model_parallel``) is all-gathered over its TP group (the expert-TP group for
    experts) and joined along its ``partition_dim`` with its ``partition_stride``, as Megatron cuts its master
    weights; then every tensor is broadcast from the lowest rank holding it (pipeline stages and expert ranks
    hold different ones). Names, shapes and dtypes travel as JSON, tensors by ``broadcast``: nothing is
    pickled. Built from Megatron's own parameter attributes alone: an oracle independent of refit's
    ``MegatronSource``."""
    from refit.layout.tensors import dtype_from_name, dtype_name
    from refit.trainers.gather import all_gather_json

    tp = (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size())
    mine: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        group, world = etp if _is_expert(name) else tp
        full = p.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and world > 1:
            shards = [torch.empty_like(full) for _ in range(world)]
            dist.all_gather(shards, full.contiguous(), group=group)
            full = _unshard(shards, p.partition_dim, getattr(p, "partition_stride", 1))
        mine.setdefault(global_param_name(model, name), full)
    held = all_gather_json({n: [list(t.shape), dtype_name(t.dtype)] for n, t in mine.items()})
    out = {}
    for name in sorted({n for h in held for n in h}):
        owner = next(r for r, h in enumerate(held) if name in h)
        shape, dtype = held[owner][name]
        t = mine[name] if name in mine else torch.empty(shape, dtype=dtype_from_name(dtype))
        dist.broadcast(t, src=owner)
        out[name] = t
    return out


def gather_hf_state(model: GPTModel, hf_config) -> dict[str, torch.Tensor]:
    """The whole model's weights under HF names (``hf_state`` of ``gather_state``), on every rank, from any
    TP/PP/EP layout. Collective over the world. A test oracle, independent of refit's rules."""
    return _to_hf(gather_state(model), hf_config)


def hf_state(model: GPTModel, hf_config) -> dict[str, torch.Tensor]:
    """A single-process (tp=pp=ep=1) model's weights under HF names, by Megatron's layout written out by hand:
    ``linear_qkv`` is ``[q heads; k; v]`` per query group, ``linear_fc1`` ``[gate; up]``, the embedding padded past
    the HF vocabulary; experts stacked as transformers does (``gate_up_proj`` ``[E, 2, I, H]`` logical,
    ``down_proj`` ``[E, H, I]``). A test oracle, independent of refit's rules; ``gather_hf_state`` for a parallel
    model."""
    return _to_hf({n: p.detach() for n, p in model.named_parameters()}, hf_config)


def _to_hf(sd: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """``hf_state``'s conversion of single-process Megatron names and tensors ``sd``."""
    c, v = hf_config, hf_config.vocab_size
    heads, groups = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:v]}
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"][:v]
    for i in range(c.num_hidden_layers):
        mp, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        for m, h in _HF_RENAME.items():
            if mp + m in sd:
                out[hp + h] = sd[mp + m]
        for suffix in ("weight", "bias"):
            if mp + "self_attention.linear_qkv." + suffix in sd:
                t = sd[mp + "self_attention.linear_qkv." + suffix].reshape(groups, (heads // groups + 2) * hd, -1)
                q, k, val = torch.split(t, [heads // groups * hd, hd, hd], dim=1)
                for name, x in (("q", q), ("k", k), ("v", val)):
                    out[f"{hp}self_attn.{name}_proj.{suffix}"] = x.reshape(-1, t.shape[-1]).squeeze(-1)
        if mp + "mlp.linear_fc1.weight" in sd:
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = sd[mp + "mlp.linear_fc1.weight"].chunk(2)
        n_exp = sum(1 for n in sd if n.startswith(mp + "mlp.experts.") and n.endswith("linear_fc1.weight"))
        if n_exp:
            fc = [f"{mp}mlp.experts.local_experts.{e}.linear_fc" for e in range(n_exp)]
            gu = torch.stack([sd[f + "1.weight"] for f in fc])
            out[hp + "mlp.experts.gate_up_proj"] = gu.view(n_exp, 2, gu.shape[1] // 2, gu.shape[2])
            out[hp + "mlp.experts.down_proj"] = torch.stack([sd[f + "2.weight"] for f in fc])
    return out


_HF_RENAME = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
