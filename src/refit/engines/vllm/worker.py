"""The worker side: a vLLM ``WeightTransferEngine`` that receives only this worker's share.

Lifecycle (driven by vLLM's weight-sync calls):
  init_transfer_engine  join the transfer group, read the trainer's source
                        layout, publish this worker's regions (from vLLM's
                        modules), choose the load path, build the plan,
                        pre-flight with everyone;
  start_weight_update   loader path: vLLM's layerwise reload begins;
  update_weights        receive this worker's boxes: direct path, straight
                        into the live (fused) parameters; loader path, into
                        buffers handed to vLLM's loaders (a full-shaped tensor
                        whose only valid part is the box the loader reads);
                        tensors the mapping does not know arrive whole and go
                        through vLLM's ``load_weights`` on both paths;
  finish_weight_update  loader path: layerwise reload finalizes (vLLM
                        re-processes weights); the LLM then sets the version.

A LoRA adapter (the trainer's source has ``lora_spec()``): every worker receives
the adapter's tensors whole into buffers, and ``update_weights`` installs them
as that version's adapter in vLLM's LoRA manager (``lora.VllmAdapters``); no
base weight is touched, no reload runs.

Load paths: ``direct`` needs vLLM to keep every parameter as loaded (CUDA,
unquantized; the CPU backend repacks linear weights and drops the originals);
``auto`` takes it where every mapped tensor has a live target and the loader
path otherwise; ``direct`` asked for where a target is missing fails at init,
naming the parameter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit.engines.calls import BackgroundCall
from refit.layout import box_shape
from refit.transfer import Peer

from .common import (
    RefitInitInfo,
    RefitUpdateInfo,
    gather_dst_layout,
    join_group,
    open_store,
    process_map,
    read_lora_spec,
    read_src_layout,
    wait_workers,
)
from .lora import VllmAdapters
from .regions import live_target, loader_tensors, region


def check_supported(vllm_config, model: torch.nn.Module) -> None:
    """Refuse engines refit cannot load into, naming the parameter (quantized weights for now)."""
    quant = getattr(vllm_config, "quant_config", None)
    if quant is None:
        return
    for name, mod in model.named_modules():
        method = getattr(mod, "quant_method", None)
        if method is not None and "Unquantized" not in type(method).__name__:
            param = next((f"{name}.{p}" for p, _ in mod.named_parameters(recurse=False)), name)
            raise ValueError(
                f"refit backend: parameter {param!r} uses {type(method).__name__} "
                f"({type(quant).__name__}); refit serves unquantized engines only (FP8 comes later)"
            )


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """refit's worker side of vLLM's weight transfer, one per vLLM worker: the lifecycle in the
    module docstring; it receives only this worker's share (``regions``) of every tensor."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.peer: Peer | None = None
        self.adapters: VllmAdapters | None = None  # a LoRA adapter's versions (the trainer sends one)
        self.stats: dict[str, Any] = {"bytes_received": 0, "refits": 0, "version": None}

    def _worker_rank(self) -> int:
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        w = self._worker_rank()
        n_workers = init_info.n_workers
        if not 0 <= w < n_workers:
            raise ValueError(f"worker rank {w} is outside the {n_workers} workers of init_info {init_info}")
        store = open_store(init_info, is_master=False)
        try:  # nothing has moved yet: a refusal reaches every trainer rank through the store
            check_supported(self.vllm_config, self.model)
            src = read_src_layout(store, init_info.timeout_s)
            lora = read_lora_spec(store, init_info.timeout_s)
            if lora is not None:  # an adapter: every worker takes it whole, vLLM's LoRA layers slice it
                self.adapters = VllmAdapters(self.model, self.vllm_config, lora, src)
                regions = {t.name: [[0, n] for n in t.shape] for t in src}
                rules, targets, self.direct = {"lora": len(src)}, {}, False
            else:
                regions, rules, targets, missing = self._weight_regions(src)
                self.direct = self._choose_path(init_info.load_path, missing)
        except Exception as e:
            store.put(f"error/{w}", f"{type(e).__name__}: {e}")
            raise
        store.put(f"dst/{w}", regions)
        wait_workers(store, n_workers, init_info.timeout_s)
        pg = join_group(init_info, store, init_info.n_trainer + w)
        dst = gather_dst_layout(store, src, n_workers, init_info.timeout_s)
        # direct: received bytes land in the live parameters; the rest (and everything on the
        # loader path) in buffers handed to vLLM's loaders
        self.targets = targets if self.direct else {}
        self.buffers = {
            t.name: torch.empty(box_shape(b), dtype=t.dtype, device=self.device)
            for t, b in dst.local_tensors(w)
            if t.name not in self.targets
        }
        self.boxes = {t.name: b for t, b in dst.local_tensors(w)}
        self.shapes = {t.name: t.shape for t in dst}
        config = init_info.transfer_config()
        if config.keep_previous and not self.direct:
            raise ValueError(
                "refit backend: keep_previous=True needs the direct path (vLLM's parameters as loaded); on the "
                "loader path the live weights are vLLM's repacked ones and v-1 is not kept"
            )
        self.peer = Peer(
            src,
            dst,
            init_info.n_trainer + w,
            dst_tensors={**self.buffers, **self.targets},
            private_dst=not self.targets,  # loader path: the buffers are nobody's live weights
            procs=process_map(init_info, store, init_info.n_trainer + w, self.device),
            group=pg,
            config=config,
            device=self.device,
            store=store,
            standalone=True,
        )
        self.pg, self.store, self.staging = pg, store, None
        self.stats["rules"] = rules
        self.stats["load_path"] = "direct" if self.direct else "loader"
        self.stats["direct_tensors"] = len(self.targets)
        self.stats["bytes_per_refit"] = self.peer.executor.bytes_received
        self.stats["transports"] = sorted({m.transport for m in self.peer.plan.messages})

    def _weight_regions(self, src) -> tuple[dict, dict, dict, list[str]]:
        """This worker's box of every model weight (``regions``), how many each mapping rule served, the live
        targets of the direct path, and why the others have none (``missing``)."""
        regions, rules, targets, missing = {}, {}, {}, []
        for t in src:
            box, rule = region(self.model, t.name, t.shape)
            regions[t.name] = [list(x) for x in box]
            rules[rule] = rules.get(rule, 0) + 1
            view, why = live_target(self.model, t.name, t.shape, box, rule)
            if view is not None and view.dtype == t.dtype:
                targets[t.name] = view
            elif rule != "full":  # tensors the mapping does not know may go through load_weights
                missing.append(f"{t.name}: {why if view is None else f'dtype {view.dtype}, trainer sends {t.dtype}'}")
        return regions, rules, targets, missing

    def _choose_path(self, asked: str, missing: list[str]) -> bool:
        """True for the direct path."""
        if asked == "loader":
            return False
        if asked == "direct" and missing:
            raise ValueError(
                f"refit backend: load_path='direct' needs vLLM's parameters as loaded, but "
                f"{len(missing)} tensor(s) have no live target, first {missing[0]} "
                f"(use load_path='loader' or 'auto')"
            )
        return not missing  # "auto" (any other value was refused when the init info was made)

    def start_weight_update(self) -> None:
        if self.direct or self.adapters is not None:
            return  # bytes go straight into the live parameters, or into an adapter's buffers
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What vLLM's ``load_weights`` takes: checkpoint names, full shapes (only the box valid)."""
        for name, buf in self.buffers.items():
            yield from loader_tensors(self.model, name, self.shapes[name], self.boxes[name], buf)

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """``mode="transfer"``: receive the version now (the engine is paused around the whole call);
        ``mode="commit"``: make live the version ``stage`` received in the background (the engine is
        paused around this call only)."""
        if self.peer is None:
            raise RuntimeError("refit: update_weights before init_weight_transfer_engine")
        t0 = time.perf_counter()
        if update_info.mode == "commit":
            stats = self._staged(update_info.version)
            transfer_s = self.stats.get("stage_s", 0.0)
        else:
            stats = self.peer.stage(update_info.version)
            transfer_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        commit_s = self.peer.commit()  # direct path: shadow -> live parameters (staged); else records v
        if self.adapters is not None:  # a new adapter version, built from memory; the previous one retired
            self.adapters.install(update_info.version, self.buffers)
            self.stats["lora_adapters"] = self.adapters.held()
        elif self.buffers:
            self.model.load_weights(self._full_tensors())  # loader path: the commit is vLLM's loaders
        self.stats.update(
            bytes_received=self.stats["bytes_received"] + stats.bytes_received,
            refits=self.stats["refits"] + 1,
            version=update_info.version,
            transfer_s=transfer_s,
            load_s=time.perf_counter() - t1,
            commit_s=commit_s,
        )

    def stage(self, version: int) -> None:
        """Start receiving ``version`` into the shadow (direct path) or the loader's buffers in a
        background thread and return at once: vLLM keeps generating on the live weights meanwhile
        (nothing live is written). Needs ``commit="staged"``. ``stage_status()`` says when every
        process holds all of it; ``update_weights(mode="commit")`` then makes it live."""
        if self.peer is None:
            raise RuntimeError("refit: refit_stage before init_weight_transfer_engine")
        if not self.peer.config.staged:
            raise RuntimeError("refit: overlapped refits need RefitInitInfo(commit='staged')")
        if self.staging is not None and self.staging[1].thread.is_alive():
            raise RuntimeError(f"refit: version {self.staging[0]} is still being staged")
        t0 = time.perf_counter()

        def run() -> None:
            self._staged_stats = self.peer.stage(version)
            self.stats["stage_s"] = time.perf_counter() - t0

        self.staging = (version, BackgroundCall(run))

    def stage_status(self) -> dict[str, Any]:
        """Plain data: ``version`` being (or last) staged, ``done`` (every process holds all of it, or it
        failed), ``error`` (why it failed; the live weights are untouched then)."""
        if self.staging is None:
            return {"version": None, "done": False, "error": None}
        version, call = self.staging
        error = call.failed()
        return {"version": version, "done": not call.thread.is_alive(), "error": None if error is None else str(error)}

    def _staged(self, version: int):
        """The stats of the staged ``version``, once its background receive has finished."""
        if self.staging is None or self.staging[0] != version:
            raise RuntimeError(f"refit: commit of version {version}, but {self.stage_status()['version']} was staged")
        self.staging[1].join(self.peer.config.deadline_s)
        self.staging = None
        return self._staged_stats

    def rollback(self) -> int | None:
        """Restore the version before the last commit (direct path, ``keep_previous``; the engine must be
        paused around the call); returns it."""
        if self.peer is None:
            raise RuntimeError("refit: refit_rollback before init_weight_transfer_engine")
        self.peer.rollback()
        self.stats["version"] = self.peer.version
        return self.peer.version

    def finish_weight_update(self) -> None:
        if self.direct or self.adapters is not None:
            return
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Release this worker's side (``llm.shutdown_weight_transfer_engine()``, or vLLM's worker
        shutdown): the Peer (its waiter thread, joined), the gloo group, the store connection and the
        receive buffers, all references dropped. Not collective; idempotent. The live weights stay as
        the last refit left them; ``stats`` stay readable; a new ``init_transfer_engine`` may follow."""
        if self.peer is not None:
            self.peer.close()
        if self.adapters is not None:
            self.adapters.close()  # vLLM's own remove_all_adapters back; the last version still serves
        self.peer = self.pg = self.store = self.adapters = None
        self.buffers, self.targets = {}, {}
