"""The trainer side: every trainer rank sends the boxes it holds (no funnel through rank 0).

    info = RefitTrainerInitInfo(rank=r, master_address=..., master_port=..., n_trainer=N, n_workers=W)
    engine = RefitTrainerEngine.trainer_init(info, client=LLMClient(llm) if r == 0 else None,
                                             source=ShardedModuleSource(model, N))
    # a vLLM server: client=HTTPVLLMWeightSyncClient("http://host:8000") (vllm.distributed.weight_transfer
    # .clients; REFIT_SECRET set on both sides); a Ray actor: client=RayVLLMWeightSyncClient(actor)
    # a Megatron-Core trainer: source=MegatronSource(gpt_model, hf_config) (refit.trainers.megatron)
    # a PEFT LoRA trainer: source=LoraAdapterSource(peft_model, N) (an adapter per version, vLLM enable_lora=True;
    # refit.engines.vllm.lora) or MergedLoraSource(peft_model, N) (the touched base weights, merged)
    ...optimizer step...
    engine.send_weights(version)

``send_weights`` runs on every trainer rank. Rank 0 (the sender) also drives
the engine's weight-sync calls through ``client``: start, update (in a thread,
while its own boxes go out), finish with ``weight_version``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from refit.engines import jobs
from refit.engines.calls import BackgroundCall
from refit.errors import ConfigError
from refit.layout.lora import LoraSpec
from refit.trainers.dtensor import layout_from_module, local_shards
from refit.transfer import Peer

from .client import check_client, private_channel, server_host
from .common import (
    RefitInitInfo,
    open_store,
    publish_src_layout,
    trainer_peer,
    wait_workers,
)


class ShardedModuleSource(WeightSource):
    """A trainer module (plain, or with DTensor parameters from FSDP2 / TP) as refit's source.

    refit reads its layout and local shards; nothing is gathered. Iterating it
    (vLLM's generic contract) yields full tensors, gathering DTensors.
    """

    def __init__(self, module: torch.nn.Module, world_size: int) -> None:
        self.module = module
        self.world_size = world_size

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, p in self.module.named_parameters():
            yield n, p.full_tensor() if hasattr(p, "full_tensor") else p

    def layout(self):
        return layout_from_module(self.module, self.world_size)

    def local(self) -> dict[str, torch.Tensor]:
        return local_shards(self.module)


@dataclass
class RefitTrainerInitInfo(RefitInitInfo, TrainerInitInfo):
    """A trainer rank's init info: the shared fields of ``RefitInitInfo`` (the same on every
    process of the job), this rank (``rank``, keyword-only, from vLLM's ``TrainerInitInfo``: rank 0
    sends and drives the engine), the device its shards live on, and ``extra``. ``worker_info()``
    is what the workers receive."""

    backend: ClassVar[str] = "refit"
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    def worker_info(self) -> RefitInitInfo:
        """The shared fields, for the workers (all checked when this info was made; a worker checks them
        again where it rebuilds them from the plain JSON its client carried)."""
        return RefitInitInfo(**{f.name: getattr(self, f.name) for f in fields(RefitInitInfo)})


class RefitTrainerEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """refit's trainer side of vLLM's weight transfer, one per trainer rank.

    Lifecycle: ``trainer_init`` on every trainer rank at once (collective with the workers: rank 0
    publishes the source layout and asks the engine to init; all join one gloo group and build the
    same plan); ``send_weights(version)`` after each optimizer step, on every rank, same order;
    ``shutdown``. Must agree on every process: the ``RefitInitInfo`` fields and the source layout.
    """

    init_info_cls = RefitTrainerInitInfo
    peer: Peer | None = None  # set by trainer_init; shutdown drops these three
    pg: Any = None
    store: Any = None

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client=None, source: WeightSource | None = None):
        """Join the job (collective over the trainer ranks and the workers; see the class docstring).

        ``client``: on rank 0, anything with vLLM's four weight-sync methods (``LLMClient(llm)``, vLLM's
        ``HTTPVLLMWeightSyncClient`` / ``RayVLLMWeightSyncClient``, or yours); other ranks may pass None.
        Refused before anything starts: a client lacking a method (``TypeError`` naming it), a client
        that cannot carry a secret refit made, a server on another host while the store is on loopback
        (``ConfigError``: ``rank0_refusal``, raised by ``job_secret``)."""
        check_args(init_info, client, source)
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        secret, job_id = job_secret(init_info, client)
        info = replace(init_info.worker_info(), secret=secret, job_id=job_id)
        src = source.layout()
        # rank 0 hosts the store; it also tells the workers to join, concurrently
        rpc = None
        if self.is_sender:
            rpc = BackgroundCall(client.init_weight_transfer_engine, vars(info))
        store = open_store(info, is_master=self.is_sender)
        if self.is_sender:
            publish_src_layout(store, src, lora_spec(source))
        try:  # an init call that failed (a worker's setup error, a refused request) ends the wait at once
            wait_workers(store, init_info.n_workers, info.timeout_s, failed=None if rpc is None else rpc.failed)
        except Exception:
            if rpc is not None:
                rpc.settle(info.timeout_s)  # the client call fails too; do not leave it behind
            raise
        prepare = getattr(source, "prepare", None)  # e.g. MergedLoraSource: merged weights recomputed per refit
        pg, self.peer = trainer_peer(
            info, store, src, init_info.rank, source.local(), info.transfer_config(), init_info.device, prepare
        )
        if rpc is not None:
            rpc.join()
        self.pg, self.store, self.version, self.timeout_s = pg, store, 0, info.timeout_s
        return self

    def send_weights(self, version: int | None = None) -> Any:
        version = self.version + 1 if version is None else version
        rpc = None
        if self.is_sender:
            self.client.start_weight_update()
            rpc = BackgroundCall(self.client.update_weights, {"version": version})
        try:
            stats = self.peer.run(version)
        except Exception:
            if rpc is not None:
                rpc.settle(self.timeout_s)  # the workers abort too, and so does their update call
            raise
        if rpc is not None:
            rpc.join()
            self.client.finish_weight_update(weight_version=str(version))
        self.version = version
        return stats

    def shutdown(self) -> None:
        """Release this rank's side: the Peer (its waiter thread, joined, and shared-memory barrier), the
        gloo group and the rendezvous store, all references dropped so that on rank 0 the store's
        server closes its listening socket. Not collective: call it on each rank after its last
        ``send_weights``. The workers' side is released by ``llm.shutdown_weight_transfer_engine()``
        (or when the engine exits). Idempotent; this engine cannot send afterwards."""
        if self.peer is not None:
            self.peer.close()
        self.peer = self.pg = self.store = None


def lora_spec(source: Any) -> LoraSpec | None:
    """The LoRA adapter ``source`` sends (its ``lora_spec()``, e.g. ``refit.trainers.peft.LoraAdapterSource``):
    the workers serve it through vLLM's LoRA support (``refit.engines.vllm.lora``); None for model weights."""
    read = getattr(source, "lora_spec", None)
    return read() if callable(read) else None


def check_args(info: RefitTrainerInitInfo, client: Any, source: Any) -> None:
    """``trainer_init``'s arguments, checked on this rank before anything starts (see ``trainer_init``)."""
    if not all(callable(getattr(source, a, None)) for a in ("layout", "local")):
        raise TypeError(
            "the refit backend needs a source with layout() and local(): ShardedModuleSource(module, "
            f"trainer_world_size) or refit.trainers.megatron.MegatronSource(model, hf_config); got {source!r}"
        )
    if source.world_size != info.n_trainer:
        raise ValueError(f"source world_size={source.world_size} != n_trainer={info.n_trainer}")
    if info.is_sender and client is None:
        raise ValueError("trainer rank 0 drives the engine and needs a client")
    if client is not None:
        check_client(client)


def rank0_refusal(info: RefitTrainerInitInfo, client: Any, secret: str | None) -> ConfigError | None:
    """Why trainer rank 0 must not start this job with ``client``, or None: ``secret`` (``job_secret``'s
    choice so far) is one refit would make, and the client has no private channel; or the client posts to
    a server on another host while ``master_address`` (where that server's workers connect) is loopback."""
    if not info.is_sender:
        return None
    host = server_host(client)
    if host is not None and not _is_loopback(host) and _is_loopback(info.master_address):
        return ConfigError(
            f"the engine server {client.base_url} is not on this host, but RefitTrainerInitInfo.master_address="
            f"{info.master_address!r} is loopback: its workers connect there; set master_address to trainer "
            "rank 0's address that the server's host can reach"
        )
    if secret == "" and not private_channel(client):
        return ConfigError(
            f"no job secret to give the engine behind {type(client).__name__}, and refit will not send one it "
            "made over a channel that may be plain HTTP: set REFIT_SECRET (or REFIT_SECRET_FILE) to the same "
            "value for the trainer and the vLLM server, or pass RefitTrainerInitInfo(secret=...) to send it "
            "(private network or TLS only)"
        )
    return None


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def job_secret(info: RefitTrainerInitInfo, client: Any = None) -> tuple[str, str]:
    """``refit.engines.jobs.job_secret`` with the vLLM adapter's rule (``rank0_refusal``): a secret refit
    makes goes to the workers only through a client with a private channel (in-process, Ray); with any
    other (HTTP) rank 0 raises ``ConfigError`` saying what to set, and the other ranks with it."""
    return jobs.job_secret(info, lambda chosen: rank0_refusal(info, client, chosen))
