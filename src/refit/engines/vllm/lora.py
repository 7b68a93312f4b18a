"""LoRA adapters refitted into vLLM's LoRA support: one adapter per version, loaded from memory.

    llm = LLM(model=..., enable_lora=True, max_lora_rank=r, weight_transfer_config={"backend": "refit"})
    engine = RefitTrainerEngine.trainer_init(info, client=LLMClient(llm), source=LoraAdapterSource(peft_model, n))
    ...optimizer step...
    engine.send_weights(v)
    llm.generate(prompts, params, lora_request=lora_request(spec.name, v))

The trainer sends only the adapter's A and B tensors (every vLLM worker receives them whole; vLLM's
LoRA layers take their tensor-parallel slices). The worker builds vLLM's ``LoRAModel`` from the
received tensors (``LoRAModel.from_lora_tensors``: no file, nothing unpickled) with adapter id
``adapter_id(v) = v + 1`` and registers it in the model's LoRA manager (``model.lora_manager``, which
vLLM sets), pinned, so vLLM's LRU never evicts it; the previous version's adapter is removed in the
same call. A request names a version with ``lora_request(name, v)``; its ``lora_path`` is
``refit://<name>/v<v>``, a marker no disk holds: a request for a version this engine no longer holds
fails in vLLM's loader (``LoRAAdapterNotFoundError`` naming that path), never silently.

vLLM clears every adapter after each weight update (``reset_lora_state``, run by the worker right after
``finish_weight_update``: base weights may have changed). refit's adapter changes no base weight, so
``VllmAdapters`` wraps that manager's ``remove_all_adapters`` on this one instance: after clearing, the
current version is registered again from the tensors in memory. ``shutdown`` restores the method.

Checked at init, before any byte moves (the worker publishes the error; every trainer rank raises it):
the engine runs LoRA (``enable_lora=True``), the adapter's rank fits ``max_lora_rank``, every adapted
module is one vLLM's LoRA layers support and this model has, with the input (and, unfused, output)
size the adapter's shapes say.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from refit.layout import ModelLayout
from refit.layout.lora import LoraSpec, adapter_names, check_adapter_tensors

MARKER = "refit://"


def adapter_id(version: int) -> int:
    """vLLM's ``lora_int_id`` of weight version ``version`` (ids must be >= 1)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an integer >= 0, got {version!r}")
    return version + 1


def lora_path(name: str, version: int) -> str:
    """The marker path of ``name``'s version ``version`` (no file: vLLM reads the adapter from memory)."""
    return f"{MARKER}{name}/v{version}"


def lora_request(name: str, version: int) -> Any:
    """The ``vllm.lora.request.LoRARequest`` that generates with adapter ``name`` at ``version``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(
        lora_name=f"{name}@v{version}", lora_int_id=adapter_id(version), lora_path=lora_path(name, version)
    )


def engine_modules(manager: Any) -> dict[str, tuple[int, int | None]]:
    """The HF modules vLLM's LoRA manager can adapt in this model: ``{hf module: (in, out or None)}``; a
    packed layer (``qkv_proj``) lists its parts (``q_proj``, ``k_proj``, ``v_proj``) with its input size and
    no output size (a part's size there depends on the tensor-parallel split of KV heads)."""
    packed = dict(manager.packed_modules_mapping)
    out: dict[str, tuple[int, int | None]] = {}
    for name, mod in manager.modules.items():
        base = getattr(mod, "base_layer", None)
        size_in = getattr(base, "input_size", None)
        if size_in is None:
            continue  # not a linear layer (embeddings, logits): refit sends no adapter there
        parent, _, leaf = name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        if leaf in packed:
            out.update({f"{prefix}{part}": (size_in, None) for part in packed[leaf]})
        else:
            out[name] = (size_in, getattr(base, "output_size", None))
    return out


def check_engine(spec: LoraSpec, lora_config: Any, modules: Mapping[str, tuple[int, int | None]], src: ModelLayout):
    """Refuse an adapter this engine cannot serve (``ValueError`` naming the setting, module or tensor and
    both numbers): LoRA off (``lora_config`` None), rank above ``max_lora_rank``, a module the engine's LoRA
    layers lack, a size that differs; and the source layout must be exactly the adapter's tensors."""
    if lora_config is None:
        raise ValueError(
            f"refit: the trainer sends LoRA adapter {spec.name!r} but this vLLM engine runs without LoRA: start it "
            f"with enable_lora=True and max_lora_rank >= {spec.rank}, or send merged weights (MergedLoraSource)"
        )
    if spec.rank > lora_config.max_lora_rank:
        raise ValueError(
            f"refit: LoRA adapter {spec.name!r} has rank {spec.rank} > this engine's max_lora_rank="
            f"{lora_config.max_lora_rank}"
        )
    shapes = {}
    for m in spec.modules:
        if m not in modules:
            raise ValueError(
                f"refit: LoRA module {m!r} of adapter {spec.name!r} is not one this vLLM engine can adapt "
                f"({len(modules)} modules, e.g. {sorted(modules)[:3]})"
            )
        size_in, size_out = modules[m]
        a_name, b_name = adapter_names(m)
        names = set(src.names)
        a_shape = src[a_name].shape if a_name in names else None
        b_shape = src[b_name].shape if b_name in names else None
        if a_shape is None or b_shape is None:
            raise ValueError(f"refit: the trainer's layout lacks {a_name if a_shape is None else b_name!r}")
        if a_shape[1] != size_in or (size_out is not None and b_shape[0] != size_out):
            raise ValueError(
                f"refit: LoRA module {m!r}: A {list(a_shape)}, B {list(b_shape)} do not fit the engine's layer "
                f"(input {size_in}, output {size_out})"
            )
        shapes[m] = (b_shape[0], a_shape[1])
    check_adapter_tensors(spec, {t.name: t.shape for t in src}, shapes)


class VllmAdapters:
    """A vLLM worker's LoRA adapter versions, built from tensors in memory (one per worker).

    Lifecycle: made at ``init_transfer_engine`` (``check_engine`` first); ``install(version, tensors)``
    after each refit received the adapter's tensors (copied: the receive buffers are reused), which
    registers ``adapter_id(version)`` and removes the previous version; ``close()`` at shutdown. Between
    refits vLLM may clear all adapters (after any weight update); the current version comes back at once.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, spec: LoraSpec, src: ModelLayout) -> None:
        lora_config = getattr(vllm_config, "lora_config", None)
        manager = getattr(model, "lora_manager", None)
        check_engine(spec, lora_config, engine_modules(manager) if manager is not None else {}, src)
        from vllm.lora.peft_helper import PEFTHelper

        self.spec, self.manager, self.lora_config = spec, manager, lora_config
        self.helper = PEFTHelper.from_dict(spec.peft_config())
        self.helper.validate_legal(lora_config)  # vLLM's own checks (features, rank)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.version: int | None = None
        self.restored = 0  # times the current version came back after vLLM cleared every adapter
        self.tensors: dict[str, torch.Tensor] = {}
        self._clear = manager.remove_all_adapters
        manager.remove_all_adapters = self._clear_then_restore  # this instance only; close() undoes it

    def install(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Serve ``tensors`` (adapter names -> received tensors, copied here) as ``adapter_id(version)``; the
        previous version is removed."""
        new_id = adapter_id(version)
        self.tensors = {n: t.detach().clone() for n, t in tensors.items()}
        old, self.version = self.version, version
        if old is not None and adapter_id(old) != new_id:
            self.manager.remove_adapter(adapter_id(old))
        self.manager.remove_adapter(new_id)  # a retried version replaces itself
        self._register()

    def _register(self) -> None:
        """Build vLLM's ``LoRAModel`` of the current version from memory (fresh tensors: vLLM folds the scale
        into B in place) and register it, pinned."""
        from vllm.lora.lora_model import LoRAModel

        lora = LoRAModel.from_lora_tensors(
            lora_model_id=adapter_id(self.version),
            tensors={n: t.clone() for n, t in self.tensors.items()},
            peft_helper=self.helper,
            device="cpu",
            dtype=self.lora_config.lora_dtype,
            model_vocab_size=self.vocab_size,
        )
        self.manager.add_adapter(lora)
        self.manager.pin_adapter(lora.id)

    def _clear_then_restore(self) -> None:
        self._clear()
        if self.version is not None:
            self._register()
            self.restored += 1

    def held(self) -> list[int]:
        """The adapter ids vLLM's manager holds now."""
        return sorted(self.manager.list_adapters())

    def close(self) -> None:
        """Give vLLM its own ``remove_all_adapters`` back (the current version stays registered until vLLM
        next clears its adapters). Idempotent."""
        if "remove_all_adapters" in vars(self.manager):
            del self.manager.remove_all_adapters
