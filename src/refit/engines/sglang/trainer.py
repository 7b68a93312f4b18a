"""The trainer side: every trainer rank sends the boxes it holds straight to the SGLang TP ranks that need them.

    os.environ["REFIT_SECRET"] = ...   # on every trainer rank and in the SGLang processes' environment
    engine = sgl.Engine(..., custom_weight_loader=[refit.engines.sglang.LOADER])   # rank 0 (or launch_server)
    info = SGLangTrainerInitInfo(rank=r, master_address=..., master_port=..., n_trainer=N, n_workers=tp)
    trainer = RefitSGLangTrainer.trainer_init(info, source=ModuleSource(model, N),
                                              client=EngineClient(engine) if r == 0 else None)
    ...optimizer step...
    trainer.send_weights(version)

``send_weights`` runs on every trainer rank. Rank 0 also drives SGLang through ``client``: it signs the
version into the store, opens SGLang's weight-update session and triggers refit's loader (in a thread,
while its own boxes go out), closes the session and, once every process committed, sets SGLang's
``weight_version``. A failed refit raises ``RefitAborted`` on every trainer rank; SGLang keeps its last
version (staged commit) and its ``weight_version`` is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from refit.engines.calls import BackgroundCall
from refit.engines.jobs import job_secret
from refit.engines.vllm.common import (
    RefitInitInfo,
    open_store,
    publish_src_layout,
    trainer_peer,
    wait_workers,
)
from refit.errors import ConfigError
from refit.trainers.dtensor import layout_from_module, local_shards
from refit.transfer import Peer
from refit.transport import auth

from .client import SGLangClient
from .loader import CLOSE, INIT_KEY, RUN, RUN_KEY, init_document, init_trigger, transfer_config


class ModuleSource:
    """A trainer module (plain, or with DTensor parameters from FSDP2 / TP) as refit's source: its layout and
    local shards, nothing gathered. Any object with ``world_size``, ``layout()`` and ``local()`` will do
    (e.g. ``refit.trainers.megatron.MegatronSource``)."""

    def __init__(self, module: torch.nn.Module, world_size: int) -> None:
        self.module, self.world_size = module, world_size

    def layout(self):
        return layout_from_module(self.module, self.world_size)

    def local(self) -> dict[str, torch.Tensor]:
        return local_shards(self.module)


@dataclass
class SGLangTrainerInitInfo(RefitInitInfo):
    """A trainer rank's init info: the shared ``RefitInitInfo`` fields (the same on every trainer rank;
    ``n_workers`` is SGLang's ``tp_size``; ``load_path`` is not used), this trainer ``rank`` (0 drives
    SGLang) and the ``device`` its shards live on. ``secret``: must equal what the SGLang processes read
    from ``REFIT_SECRET`` / ``REFIT_SECRET_FILE``; empty means this rank's own environment."""

    rank: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.n_trainer:
            raise ConfigError(f"SGLangTrainerInitInfo.rank must be in 0..{self.n_trainer - 1}, got {self.rank!r}")

    def shared(self) -> RefitInitInfo:
        """The fields every process of the job holds (the transfer config checked here)."""
        transfer_config(self)
        return RefitInitInfo(**{k: getattr(self, k) for k in RefitInitInfo.__dataclass_fields__})


class RefitSGLangTrainer:
    """refit's trainer side for SGLang, one per trainer rank.

    Lifecycle: ``trainer_init`` on every trainer rank at once (collective with SGLang's TP ranks: rank 0
    hosts the store, signs the init document and the source layout, and triggers SGLang's init; all join one
    gloo group and build the same plan); ``send_weights(version)`` after each optimizer step, on every rank,
    same increasing versions; ``shutdown``. Must agree on every process: the ``RefitInitInfo`` fields and the
    source layout. ``last_stats``: on rank 0, each SGLang rank's published stats after the last refit.
    """

    def __init__(self, info: RefitInitInfo, rank: int, client: SGLangClient | None) -> None:
        self.info, self.rank, self.client = info, rank, client
        self.peer: Peer | None = None
        self.pg = self.store = None
        self.version = 0
        self.last_stats: list[dict] = []

    @classmethod
    def trainer_init(
        cls, init_info: SGLangTrainerInitInfo, *, source: Any, client: SGLangClient | None = None
    ) -> RefitSGLangTrainer:
        if not all(callable(getattr(source, a, None)) for a in ("layout", "local")):
            raise TypeError(f"refit needs a source with layout() and local(), e.g. ModuleSource(module, n): {source!r}")
        if source.world_size != init_info.n_trainer:
            raise ConfigError(f"source world_size={source.world_size} != n_trainer={init_info.n_trainer}")
        if callable(getattr(source, "lora_spec", None)):
            raise ConfigError(
                "refit's SGLang backend does not serve LoRA adapters: send the touched weights merged instead "
                "(refit.trainers.peft.MergedLoraSource)"
            )
        if init_info.rank == 0 and client is None:
            raise ConfigError("trainer rank 0 drives SGLang and needs a client (EngineClient or HTTPClient)")
        if not init_info.secret and auth.secret_from_env() is None:
            raise ConfigError(
                "no job secret: set REFIT_SECRET (or REFIT_SECRET_FILE) on every trainer rank and in the SGLang "
                "processes' environment; refit never sends it through SGLang"
            )
        secret, job_id = job_secret(init_info)
        self = cls(replace(init_info.shared(), secret=secret, job_id=job_id), init_info.rank, client)
        self._join(source, init_info.device)
        return self

    def _join(self, source: Any, device: str) -> None:
        """Open the store, (rank 0) publish and trigger SGLang's init, join the group, build the Peer."""
        info, src = self.info, source.layout()
        store = open_store(info, is_master=self.rank == 0)
        call = None
        if self.rank == 0:
            store.put(INIT_KEY, init_document(info))
            publish_src_layout(store, src)
            self.client.begin_weight_update()
            call = BackgroundCall(self.client.trigger, init_trigger(info))
        try:
            wait_workers(store, info.n_workers, info.timeout_s, engine="SGLang")
            prepare = getattr(source, "prepare", None)  # e.g. MergedLoraSource: merged weights recomputed per refit
            self.pg, self.peer = trainer_peer(
                info, store, src, self.rank, source.local(), transfer_config(info), device, prepare
            )
        except Exception:
            if call is not None:  # SGLang's ranks give up at their timeout; keep this rank's error
                call.settle(info.timeout_s)
                _quietly(self.client.end_weight_update)
            raise
        if call is not None:
            call.join(info.timeout_s)
            self.client.end_weight_update()
        self.store = store

    def send_weights(self, version: int | None = None, *, fault_hook=None):
        """Send ``version`` (default: the last one + 1) on every trainer rank; returns this rank's ``RunStats``.
        Rank 0 sets SGLang's ``weight_version`` to ``str(version)`` once every process committed.
        ``fault_hook``: ``Peer.run``'s (fault drills and tests)."""
        if self.peer is None:
            raise RuntimeError("refit: send_weights after shutdown (or before trainer_init)")
        version = self.version + 1 if version is None else version
        call = None
        if self.rank == 0:
            self.store.put(RUN_KEY, version)
            self.client.begin_weight_update()
            call = BackgroundCall(self.client.trigger, RUN)
        try:
            stats = self.peer.run(version, fault_hook=fault_hook)
        except Exception:
            if call is not None:  # SGLang's ranks abort too; close the session, keep this error
                call.settle(self.info.timeout_s)
                _quietly(self.client.end_weight_update)
            raise
        if call is not None:
            call.join(self.info.timeout_s)
            self.client.end_weight_update()
        if self.rank == 0:
            self.last_stats = self.engine_stats()
            self.client.set_weight_version(str(version))
        self.version = version
        return stats

    def engine_stats(self) -> list[dict]:
        """Each SGLang rank's stats as it signed them into the store (``loader.RankSide.stats``)."""
        return [self.store.get(f"sglang/stats/{w}", self.info.timeout_s) for w in range(self.info.n_workers)]

    def shutdown(self) -> None:
        """Release this rank's side (rank 0 first tells SGLang's ranks to release theirs). Idempotent."""
        if self.rank == 0 and self.peer is not None and self.client is not None:
            try:
                self.client.begin_weight_update()
                self.client.trigger(CLOSE)
                self.client.end_weight_update()
            except Exception:  # noqa: BLE001 - the engine may be gone; this side still closes
                pass
        if self.peer is not None:
            self.peer.close()
        self.peer = self.pg = self.store = None


def _quietly(fn, *args) -> None:
    """Call ``fn`` on an error path: its own failure must not hide the error being raised."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass
