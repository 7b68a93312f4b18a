"""refit as verl's checkpoint engine: the ``refit`` backend of ``verl.checkpoint_engine.CheckpointEngineRegistry``.

Importing this module registers ``RefitCheckpointEngine`` under ``"refit"``, the way verl registers ``nccl``,
``nixl`` and ``kimi_ckpt_engine``. verl imports it itself when the config says so::

    actor_rollout_ref.rollout.checkpoint_engine.backend=refit
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=refit.frameworks.verl
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refit.rollout_tp=2   # the rollout's TP size

Lifecycle (verl's ``CheckpointEngineManager.update_weights`` drives it, every step, on every trainer rank and
every rollout worker): ``prepare()`` -> ``build_topology`` (the driver) -> ``init_process_group(**kwargs)`` ->
``send_weights`` (trainer ranks) / ``receive_weights`` (rollout workers), concurrently -> ``finalize()``.
The first step builds refit's plan (trainer rank 0 publishes the source layout and the rollout layout in a
store it hosts); later steps only move bytes: the store, the gloo group and the plan outlive ``finalize``
while the topology stays the same.

Unlike verl's own backends nothing is gathered. verl hands ``send_weights`` a generator of full tensors
(``engine.get_per_tensor_param()``, which all-gathers each FSDP parameter as it is read); refit does not read
it. The trainer ranks send from the actor's local shards instead: ``bind_module(module)`` gives the engine the
actor's FSDP2/DTensor module (the hook verl lacks: see ``docs/integrations/verl.md``), and each rollout
worker receives only the boxes of its TP share, from every trainer rank that holds them.

Must agree on every process: ``rollout_tp``, ``timeout_s``, ``bucket_size`` (refit's buffer size) and the
topology ``build_topology`` made. The job secret is ``REFIT_SECRET`` where every process has it; otherwise
trainer rank 0 makes one and it travels in ``prepare``'s metadata through Ray (the channel verl already
trusts with its workers' code).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from refit.engines.vllm.common import DEFAULT_TIMEOUT_S, RefitInitInfo, join_group, open_store
from refit.errors import ConfigError
from refit.layout import Box, ModelLayout
from refit.layout.engines import engine_layout
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.trainers.dtensor import layout_from_module, local_shards
from refit.transfer import Peer
from refit.transport import auth
from refit.transport.control import free_port
from refit.transport.store import BIND_ENV

BACKEND = "refit"
ROLES = ("trainer", "rollout")
SESSION = "refit-verl"


@dataclass(frozen=True)
class Joined:
    """This process's place in the job ``init_process_group`` joined: what must stay the same for the plan of
    the last step to serve the next."""

    rank: int
    role: str
    n_trainer: int
    n_workers: int
    master_address: str
    master_port: int
    job_id: str


@dataclass
class Stats:
    """What this process moved: ``refits`` (completed), ``version`` (the last), ``bytes_per_refit`` (sent on a
    trainer rank, received on a rollout worker, in the last refit), ``bytes_total``, ``tensors`` (a rollout
    worker's local tensors)."""

    refits: int = 0
    version: int | None = None
    bytes_per_refit: int = 0
    bytes_total: int = 0
    tensors: int = 0
    shapes: dict[str, list[int]] = field(default_factory=dict)


@CheckpointEngineRegistry.register(BACKEND)
class RefitCheckpointEngine(CheckpointEngine):
    """refit's backend for verl: a trainer rank or a rollout worker of one weight sync job.

    ``bucket_size`` (verl's ``update_weights_bucket_megabytes``): the size of each of refit's staging
    buffers; ``is_master``: trainer rank 0, which hosts the store. ``engine_kwargs.refit``: ``rollout_tp``
    (the rollout replicas' TP size: rollout worker ``w`` is TP rank ``w % rollout_tp`` of replica
    ``w // rollout_tp``, verl's order), ``shard_aware_adapter`` (needed with ``rollout_tp > 1``: see
    ``receive_weights``), ``master_address`` (trainer rank 0's address the others reach; default
    ``REFIT_BIND_ADDRESS``, else loopback: one host), ``timeout_s``, ``num_buffers``.
    """

    def __init__(
        self,
        bucket_size: int = 64 << 20,
        is_master: bool = False,
        *,
        rollout_tp: int = 1,
        shard_aware_adapter: bool = False,
        master_address: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_buffers: int = 2,
    ) -> None:
        if isinstance(rollout_tp, bool) or not isinstance(rollout_tp, int) or rollout_tp < 1:
            raise ConfigError(f"engine_kwargs.refit.rollout_tp must be an integer >= 1, got {rollout_tp!r}")
        if rollout_tp > 1 and not shard_aware_adapter:
            raise ConfigError(
                f"engine_kwargs.refit.rollout_tp={rollout_tp}: each rollout worker receives only its TP share, "
                "which verl's server adapters (full tensors into vLLM's loaders) cannot load; set "
                "shard_aware_adapter=True only with an adapter that loads shards (see docs/integrations/verl.md)"
            )
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rollout_tp = rollout_tp
        self.master_address = master_address or os.environ.get(BIND_ENV) or "127.0.0.1"
        self.timeout_s = timeout_s
        self.num_buffers = num_buffers
        self.module: nn.Module | list[nn.Module] | None = None
        self.hf_config: Any = None  # the HF config of a bound Megatron model (``bind_module``)
        self.stats = Stats()
        self._meta: dict[str, Any] | None = None
        self._joined: Joined | None = None
        self._info: RefitInitInfo | None = None
        self._store: Any = None
        self._pg: Any = None
        self.peer: Peer | None = None
        self.shards: dict[str, torch.Tensor] = {}
        self.dst: ModelLayout | None = None

    # -- the trainer's hook --------------------------------------------------------------------------------------

    def bind_module(self, module: nn.Module | list[nn.Module], hf_config: Any = None) -> None:
        """The actor's module on this trainer rank, read in place: refit sends its local shards. Plain, FSDP2
        or TP (DTensor parameters; the rollout layout comes from its HF ``.config``), or Megatron-Core's
        ``GPTModel`` (or the list of this rank's virtual-pipeline chunks, wrapped or not, as verl's Megatron
        workers hold it) with ``hf_config``, the HF config its weights are
        (``refit.trainers.megatron.MegatronSource``: the first ``send_weights`` exchanges every trainer rank's
        holds over the default process group, which must be the trainer ranks', as in verl's Megatron
        workers). Call once on every trainer rank before the first ``send_weights``."""
        chunks = list(module) if isinstance(module, (list, tuple)) else [module]
        if not chunks or not all(isinstance(m, nn.Module) for m in chunks):
            raise TypeError(f"bind_module needs the actor's torch.nn.Module, got {type(module).__name__}")
        if _is_megatron(chunks[0]) and hf_config is None:
            raise ConfigError(
                f"refit: bind_module({type(chunks[0]).__name__}) needs hf_config=, the HF config its weights are "
                "(Megatron's own config does not name HF tensors)"
            )
        self.module, self.hf_config = module, hf_config

    # -- verl's contract -----------------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Trainer rank 0: where its store listens (the same port every step once open), the job id, and the
        job secret when ``REFIT_SECRET`` is not set here. Everyone else: ``{}``."""
        if not self.is_master:
            return {}
        if self._meta is None:
            secret = "" if auth.secret_from_env() is not None else auth.as_text(auth.new_secret())
            self._meta = {
                "backend": BACKEND,
                "master_address": self.master_address,
                "master_port": free_port(self.master_address),
                "job_id": uuid.uuid4().hex,
                "secret": secret,
            }
        return dict(self._meta)

    @classmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Trainer ranks ``0..T-1``, rollout workers ``T..T+R-1``; every process gets trainer rank 0's
        metadata (``metadata[0]``: verl lists the trainer ranks first)."""
        master = metadata[0] if metadata else {}
        if master.get("backend") != BACKEND:
            raise ConfigError(
                "refit: metadata[0] is not trainer rank 0's prepare() (is_master=True on trainer rank 0, trainer "
                f"ranks listed first); got keys {sorted(master)}"
            )

        def side(role: str, first: int, n: int) -> dict[str, list[Any]]:
            return {
                "rank": list(range(first, first + n)),
                "role": [role] * n,
                "n_trainer": [trainer_world_size] * n,
                "n_workers": [rollout_world_size] * n,
                "master_metadata": [master] * n,
            }

        return side("trainer", 0, trainer_world_size), side("rollout", trainer_world_size, rollout_world_size)

    def init_process_group(
        self, *, rank: int, role: str, n_trainer: int, n_workers: int, master_metadata: dict[str, Any]
    ) -> None:
        """Join the job's store and gloo group (collective over every trainer rank and rollout worker). A
        process that joined the same topology before keeps its group and plan."""
        if role not in ROLES:
            raise ConfigError(f"refit: role must be one of {ROLES}, got {role!r}")
        if n_workers % self.rollout_tp:
            raise ConfigError(
                f"refit: {n_workers} rollout workers are not whole replicas of rollout_tp={self.rollout_tp}"
            )
        m = master_metadata
        joined = Joined(rank, role, n_trainer, n_workers, m["master_address"], int(m["master_port"]), m["job_id"])
        if joined == self._joined:
            return
        self.close()
        self._info = RefitInitInfo(
            master_address=joined.master_address,
            master_port=joined.master_port,
            n_trainer=n_trainer,
            n_workers=n_workers,
            timeout_s=self.timeout_s,
            num_buffers=self.num_buffers,
            buffer_bytes=self.bucket_size,
            session=SESSION,
            secret=m.get("secret", ""),
            job_id=joined.job_id,
        )
        self._store = open_store(self._info, is_master=rank == 0)
        self._pg = join_group(self._info, self._store, rank)
        self._joined = joined

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None, **_):
        """A trainer rank: send the bound module's local shards as version ``global_steps`` (see ``_version``);
        returns this rank's metrics (verl merges them into its sync metrics). ``weights`` (verl's full-tensor
        generator) is closed unread: reading it would gather every parameter. ``weights`` may also be verl's
        training engine (its ``module`` is then bound)."""
        if self.module is None and isinstance(getattr(weights, "module", None), nn.Module):
            self.bind_module(weights.module)  # verl's training engine itself (what verl hands its delta backend)
        close = getattr(weights, "close", None)
        if callable(close):
            close()
        joined = self._require("trainer")
        if self.module is None:
            raise ConfigError(
                f"refit: trainer rank {joined.rank} has no module bound: call "
                "checkpoint_engine.bind_module(actor_module) once on every trainer rank (refit sends the local "
                "shards; it does not gather verl's full tensors)"
            )
        if self.peer is None:
            self.peer = self._trainer_peer(joined)
        version = self._version(global_steps)
        run = self.peer.run(version)
        self._record(run, version, sent=True)
        return {"refit/bytes_sent": run.bytes_sent, "refit/seconds": run.seconds, "refit/version": version}

    async def receive_weights(self, global_steps: int | None = None, **_) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """A rollout worker: receive version ``global_steps`` (see ``_version``), then yield each of its tensors.
        With ``rollout_tp`` 1 they are whole HF tensors (what verl's server adapters load); with more, each is
        this worker's TP share (the box ``self.dst.local_tensors`` names), for a shard-aware adapter."""
        joined = self._require("rollout")
        if self.peer is None:
            self.peer = self._rollout_peer(joined)
        version = self._version(global_steps)
        self._record(self.peer.run(version), version, sent=False)
        for name, tensor in self.shards.items():
            yield name, tensor

    def share(self) -> dict[str, Box]:
        """A rollout worker's TP share, after its first ``receive_weights``: each tensor's box (``(lo, hi)`` per
        dimension of the HF tensor) in the rollout layout; what a shard-aware adapter loads each yielded tensor
        into."""
        joined = self._require("rollout")
        if self.dst is None:
            raise RuntimeError(f"refit: rollout worker {joined.rank - joined.n_trainer} has received nothing yet")
        return {t.name: tuple(box) for t, box in self.dst.local_tensors(joined.rank - joined.n_trainer)}

    def finalize(self) -> None:
        """The end of one step. The group and the plan stay for the next step (verl rebuilds its topology every
        step; refit's holds while it is the same): ``close()`` releases them."""

    # -- the rest ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the Peer, the group and the store (not collective); the next step joins anew."""
        if self.peer is not None:
            self.peer.close()
        self.peer = self._pg = self._store = self._joined = None
        self.shards = {}

    def _require(self, role: str) -> Joined:
        if self._joined is None:
            raise RuntimeError("refit: init_process_group has not run on this process")
        if self._joined.role != role:
            raise RuntimeError(f"refit: process {self._joined.rank} joined as {self._joined.role}, not {role}")
        return self._joined

    def _version(self, global_steps: int | None) -> int:
        """The refit version of this update: verl's ``global_steps``, or the next after the last when it is None
        or not above it (verl may sync twice at one step); every process of the job computes the same."""
        last = self.stats.version if self.stats.version is not None else -1
        return last + 1 if global_steps is None else max(int(global_steps), last + 1)

    def _record(self, run: Any, version: int, sent: bool) -> None:
        moved = run.bytes_sent if sent else run.bytes_received
        s = self.stats
        s.refits, s.version, s.bytes_per_refit, s.bytes_total = s.refits + 1, version, moved, s.bytes_total + moved

    def _rollout_layout(self, src: ModelLayout, config: Any) -> ModelLayout:
        n_workers = self._joined.n_workers
        spec = parse_spec(f"tp={self.rollout_tp},dp={n_workers // self.rollout_tp}", "dst")
        return engine_layout([(t.name, t.shape, t.dtype) for t in src], spec, config, "vllm")

    def _peer(self, joined: Joined, src: ModelLayout, dst: ModelLayout, tensors: dict, trainer: bool) -> Peer:
        side = {"src_tensors": tensors} if trainer else {"dst_tensors": tensors}
        return Peer(
            src,
            dst,
            joined.rank,
            procs=ProcessMap.disjoint(joined.n_trainer, joined.n_workers),
            group=self._pg,
            config=self._info.transfer_config(),
            store=self._store,
            standalone=True,
            **side,
        )

    def _trainer_peer(self, joined: Joined) -> Peer:
        src, tensors = self._source(joined)
        config = self.hf_config if self.hf_config is not None else getattr(self.module, "config", None)
        if config is None:
            raise ConfigError("refit: the bound module has no HF .config to derive the rollout layout from")
        self.dst = self._rollout_layout(src, config)
        if joined.rank == 0:
            self._store.put("src", src.to_json())
            self._store.put("dst", self.dst.to_json())
        return self._peer(joined, src, self.dst, tensors, trainer=True)

    def _source(self, joined: Joined) -> tuple[ModelLayout, dict]:
        """The source layout over every trainer rank and this rank's tensors for it, read from the bound module."""
        chunks = self.module if isinstance(self.module, (list, tuple)) else [self.module]
        if not _is_megatron(chunks[0]):
            return layout_from_module(self.module, joined.n_trainer), local_shards(self.module)
        from refit.trainers.megatron import MegatronSource

        source = MegatronSource([_unwrapped(c) for c in chunks], self.hf_config)
        if source.world_size != joined.n_trainer:
            raise ConfigError(
                f"refit: the Megatron model's default process group has {source.world_size} ranks, the job "
                f"{joined.n_trainer} trainer ranks (Megatron's group must be the trainer ranks')"
            )
        return source.layout(), source.local()

    def _rollout_peer(self, joined: Joined) -> Peer:
        src = ModelLayout.from_json(self._store.get("src", self.timeout_s))
        self.dst = ModelLayout.from_json(self._store.get("dst", self.timeout_s))
        worker = joined.rank - joined.n_trainer
        self.shards = {
            t.name: torch.zeros([hi - lo for lo, hi in box], dtype=t.dtype) for t, box in self.dst.local_tensors(worker)
        }
        self.stats.tensors = len(self.shards)
        self.stats.shapes = {n: list(x.shape) for n, x in self.shards.items()}
        return self._peer(joined, src, self.dst, self.shards, trainer=False)


def _unwrapped(module: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``: each holds it
    as ``.module``), as verl's Megatron workers hold their actor."""
    while not hasattr(module, "decoder") and isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


def _is_megatron(module: nn.Module) -> bool:
    """Whether ``module`` is Megatron-Core's (its class defined under ``megatron.``), without importing it."""
    return type(module).__module__.startswith("megatron.")
