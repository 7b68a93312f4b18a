"""What the trainer side and the worker side share: the init info, rendezvous, layout exchange.

The trainer publishes its source layout in the store as a ``refit.layout/1`` document
(``publish_src_layout`` / ``read_src_layout``); each worker publishes the box of every tensor it
loads (``dst/<worker>``), gathered into the destination layout on every process."""

from __future__ import annotations

import math
import os
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout import Box, Mesh, ModelLayout, TensorLayout
from refit.layout.lora import LoraSpec
from refit.plan import ProcessMap
from refit.transfer import Peer
from refit.transport import auth
from refit.transport.store import BIND_ENV, SignedStore, gloo_group, local_address_for
from refit.transport.store import open_store as open_store_at

DEFAULT_TIMEOUT_S = 300.0


LOAD_PATHS = ("auto", "direct", "loader")


@dataclass
class RefitInitInfo:
    """How one refit job's trainer ranks and vLLM workers meet and move bytes; each field declared once.

    The trainer side (``trainer.RefitTrainerInitInfo``) adds its own fields to these; the worker side
    receives exactly these (``RefitTrainerInitInfo.worker_info()``, sent as plain data by trainer
    rank 0 through the client and rebuilt with ``RefitInitInfo(**fields)``). Every field must be the
    same on all processes of the job. The transfer group has ``world_size = n_trainer + n_workers``
    ranks: trainer ranks ``0..n_trainer-1``, then workers ``n_trainer + (dp_index * tp * pp + worker
    rank)``. ``num_buffers`` / ``buffer_bytes`` / ``timeout_s`` / ``transport`` / ``commit`` /
    ``keep_previous`` / ``commit_budget_bytes`` / ``delta`` become one ``TransferConfig``
    (``transfer_config()``), validated there. ``transport``: ``"p2p"`` (the
    transfer group's gloo send/recv), ``"nixl"`` (every worker reads its boxes from the trainer ranks'
    registered memory through NIXL) or ``"auto"`` (every process publishes where it runs:
    ``process_map``; NIXL between hosts where installed, CUDA IPC between GPUs of one host, else P2P).
    ``delta``: ``TransferConfig.delta`` (``"off"``, ``"auto"``,
    ``"sparse"``, ``"bitmask"``): refits after the first send only the changed elements; on the loader path
    the worker's receive buffers keep the last version, so vLLM's loaders still see whole tensors.
    """

    master_address: str = "127.0.0.1"
    master_port: int = 0
    n_trainer: int = 1
    n_workers: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_buffers: int = 2
    buffer_bytes: int = 64 << 20
    session: str = "refit"
    load_path: str = "auto"  # worker side: "direct" (into live params), "loader" (vLLM's loaders) or "auto"
    secret: str = field(default="", repr=False)  # the job secret (text); "" = REFIT_SECRET(_FILE); see job_secret
    job_id: str = ""  # this job's scope in every tag (the trainer fills it: replays between jobs fail)
    commit: str = "in_place"  # "staged": all-or-nothing, and refits may overlap generation (``overlap.py``)
    keep_previous: bool = False  # staged, direct path: keep v-1 on the workers for ``refit_rollback``
    commit_budget_bytes: int | None = None  # the most a worker may add for its shadow (+ v-1); None: no bound
    transport: str = "p2p"  # TransferConfig.transport: "p2p", "nixl", "auto" (or "ipc": CUDA, one host)
    delta: str = "off"  # TransferConfig.delta: send only what changed since the version the worker holds

    def __post_init__(self) -> None:
        """Checked where it is made (trainer side, and again where a worker rebuilds it): ``ConfigError``
        naming the field and the value."""
        who = type(self).__name__
        if self.load_path not in LOAD_PATHS:
            raise ConfigError(f"{who}.load_path must be one of {', '.join(LOAD_PATHS)}, got {self.load_path!r}")
        for name in ("n_trainer", "n_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{who}.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int):
            raise ConfigError(f"{who}.master_port must be an integer port, got {self.master_port!r}")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"{who}.master_port must be in 0..65535, got {self.master_port}")
        for name in ("secret", "job_id", "master_address", "session"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{who}.{name} must be text, got {type(getattr(self, name)).__name__}")
        for name in ("master_address", "session"):
            if not getattr(self, name):
                raise ConfigError(f"{who}.{name} must not be empty")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"{who}.timeout_s must be a finite number of seconds > 0, got {t!r}")
        self.transfer_config()  # num_buffers, buffer_bytes: ConfigError naming the field

    @property
    def world_size(self) -> int:
        """Ranks of the transfer group: the trainer ranks, then the workers."""
        return self.n_trainer + self.n_workers

    def transfer_config(self) -> TransferConfig:
        """The ``TransferConfig`` both sides run the transfer with (``ConfigError`` on a bad field)."""
        return TransferConfig(
            num_buffers=self.num_buffers,
            buffer_bytes=self.buffer_bytes,
            preflight_timeout_s=self.timeout_s,
            transport=self.transport,
            name="xfer",
            commit=self.commit,
            keep_previous=self.keep_previous,
            commit_budget_bytes=self.commit_budget_bytes,
            delta=self.delta,
        )


@dataclass
class RefitUpdateInfo:
    """Per-version update info the trainer's rank 0 sends through the client: the weight ``version``
    every process of the refit runs (it must increase), ``extra`` (free-form, not read by refit) and
    ``mode``: ``"transfer"`` (receive the version now) or ``"commit"`` (make live the version the
    workers staged in the background, ``overlap.py``)."""

    version: int = 0
    extra: dict = field(default_factory=dict)
    mode: str = "transfer"  # "commit": make the version the workers staged (``refit_stage``) live

    def __post_init__(self) -> None:
        """Checked where a worker rebuilds it from what arrived (plain JSON over HTTP): ``ConfigError``."""
        if self.mode not in ("transfer", "commit"):
            raise ConfigError(f"RefitUpdateInfo.mode must be 'transfer' or 'commit', got {self.mode!r}")
        v = self.version
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"RefitUpdateInfo.version must be an integer >= 0, got {v!r}")
        if not isinstance(self.extra, dict):
            raise ConfigError(f"RefitUpdateInfo.extra must be a dict, got {type(self.extra).__name__}")


def open_store(info: RefitInitInfo, is_master: bool) -> SignedStore:
    """The rendezvous store (trainer rank 0 hosts it, its listener bound to ``master_address`` alone),
    under the session's prefix, signed with the job secret (``info.secret``, else ``REFIT_SECRET`` /
    ``REFIT_SECRET_FILE`` of this process) in the scope of the session and ``info.job_id``."""
    secret = info.secret.encode() if info.secret else auth.secret_from_env()
    if secret is None:
        raise ConfigError(
            "no job secret: RefitInitInfo.secret is empty and REFIT_SECRET / REFIT_SECRET_FILE are unset here"
        )
    raw = open_store_at(
        info.master_address,
        info.master_port,
        info.world_size,
        is_master,
        info.timeout_s,
        secret=secret,
        scope=info.job_id,
    )
    store = SignedStore(dist.PrefixStore(info.session, raw), secret, f"{info.session}:{info.job_id}")
    weakref.finalize(store, raw.close)  # its connections (rank 0: its server) close with the last reference
    return store


def join_group(info: RefitInitInfo, store: SignedStore, rank: int) -> dist.ProcessGroup:
    """A standalone gloo group of the trainer ranks and the workers (blocks until all join), listening only
    on ``REFIT_BIND_ADDRESS`` if set, else on this host's address on the route to ``master_address``
    (loopback when the store is on loopback)."""
    address = os.environ.get(BIND_ENV) or local_address_for(info.master_address, info.master_port or 9)
    return gloo_group(dist.PrefixStore("pg", store.raw), rank, info.world_size, info.timeout_s, address)


def wait_workers(
    store: SignedStore,
    n_workers: int,
    timeout_s: float,
    *,
    failed: Callable[[], BaseException | None] | None = None,
    engine: str = "vLLM",
) -> None:
    """Wait until every worker published its regions; raise at once with a worker's setup error, or with
    ``failed()``'s error once it returns one (trainer rank 0: the engine's init call failed, e.g. a server
    that refused the request or a worker that could not reach the store). A worker writes its error before
    its call fails, so ``failed()`` is read before the store: a worker's error, more precise, wins.
    ``engine`` names the workers' engine in the errors."""
    import time

    deadline = time.monotonic() + timeout_s
    pending = set(range(n_workers))
    while pending:
        call_error = failed() if failed is not None else None
        for w in sorted(pending):
            error = store.peek(f"error/{w}")
            if error is not None:
                raise RuntimeError(f"refit: {engine} worker {w} refused the transfer at init: {error}")
            if store.has(f"dst/{w}"):
                pending.discard(w)
        if call_error is not None:
            why = f"refit: the engine's init_weight_transfer_engine call failed: {call_error}"
            raise RuntimeError(why) from call_error
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"refit: {engine} workers {sorted(pending)} did not answer within {timeout_s:.0f}s")
        if pending:
            time.sleep(0.01)


def boxes_layout(
    entries: list[tuple[str, tuple[int, ...], torch.dtype, dict[int, Box]]], world_size: int
) -> ModelLayout:
    """A ModelLayout given by explicit per-rank boxes."""
    mesh = Mesh((world_size,), ("rank",), tuple(range(world_size)))
    return ModelLayout(
        tuple(TensorLayout(n, shape, dtype, mesh, (Replicate(),), boxes=boxes) for n, shape, dtype, boxes in entries),
        world_size,
    )


def publish_src_layout(store: SignedStore, src: ModelLayout, lora: LoraSpec | None = None) -> None:
    """Trainer rank 0: the LoRA adapter the source's tensors are (``None``: model weights), then the source
    layout, for the workers (``LoraSpec.to_json``, ``ModelLayout.to_json``)."""
    store.put("lora", lora.to_json() if lora is not None else {})
    store.put("src", src.to_json())


def read_lora_spec(store: SignedStore, timeout_s: float) -> LoraSpec | None:
    """A worker: the adapter the trainer sends (``publish_src_layout``), or None when it sends model weights;
    ``LoraSpec.from_json`` validates it."""
    doc = store.get("lora", timeout_s)
    return LoraSpec.from_json(doc) if doc != {} else None


def read_src_layout(store: SignedStore, timeout_s: float) -> ModelLayout:
    """A worker: the trainer's source layout (waits for it; ``ModelLayout.from_json`` validates it)."""
    return ModelLayout.from_json(store.get("src", timeout_s))


def location(device: str | torch.device) -> str:
    """Where this process's tensors live, as a ``ProcessMap.devices`` entry ``"<host>/<device>"``: the host
    is the host name and the kernel's boot id (two containers of one machine with their own names are
    two hosts); the device ``cuda:<GPU uuid>`` (the same GPU whatever ``CUDA_VISIBLE_DEVICES`` says) or
    ``cpu:<pid>`` (a CPU process shares its device with no other process)."""
    device = torch.device(device)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    host = f"{socket.gethostname()}-{boot}".replace("/", "_")
    if device.type == "cuda":
        return f"{host}/cuda:{torch.cuda.get_device_properties(device).uuid}"
    return f"{host}/{device.type}:{os.getpid()}"


def process_map(info: RefitInitInfo, store: SignedStore, proc: int, device: str | torch.device) -> ProcessMap:
    """The job's process map (trainer ranks, then workers). Where the transport depends on where the
    processes run (``transport`` "auto" or "ipc"), every process publishes its ``location`` as
    ``where/<proc>`` and the map carries them all (collective: waits up to ``timeout_s`` for each;
    ``ConfigError`` for one that is not ``"<host>/<device>"``); otherwise no devices."""
    procs = ProcessMap.disjoint(info.n_trainer, info.n_workers)
    if info.transport not in ("auto", "ipc"):
        return procs
    store.put(f"where/{proc}", location(device))
    where = [store.get(f"where/{p}", info.timeout_s) for p in range(info.world_size)]
    for p, w in enumerate(where):
        if not isinstance(w, str) or not 0 < len(w) <= 200 or not w.isprintable() or w.count("/") != 1:
            raise ConfigError(f"process {p} published location {str(w)[:80]!r}, not '<host>/<device>'")
    return procs.with_devices(where)


def gather_dst_layout(store: SignedStore, src: ModelLayout, n_workers: int, timeout_s: float) -> ModelLayout:
    """Every worker's published regions, as the destination layout (HF names, worker ranks)."""
    per_worker = [store.get(f"dst/{w}", timeout_s) for w in range(n_workers)]
    entries = []
    for t in src:
        boxes = {w: tuple(tuple(x) for x in regs[t.name]) for w, regs in enumerate(per_worker)}
        entries.append((t.name, t.shape, t.dtype, boxes))
    return boxes_layout(entries, n_workers)


def trainer_peer(
    info: RefitInitInfo,
    store: SignedStore,
    src: ModelLayout,
    rank: int,
    tensors: dict,
    config: TransferConfig,
    device: str | torch.device,
    prepare: Callable[[set[str] | None], None] | None = None,
) -> tuple[dist.ProcessGroup, Peer]:
    """A trainer rank's side, once every worker published its regions: join the transfer group, gather the
    destination layout and build this rank's ``Peer`` over ``tensors`` (its local shards; ``prepare``: the
    Peer's, called before each refit reads them). Collective with the workers (vLLM's or SGLang's), who
    build theirs from the same layouts."""
    pg = join_group(info, store, rank)
    dst = gather_dst_layout(store, src, info.n_workers, info.timeout_s)
    procs = process_map(info, store, rank, device)
    peer = Peer(
        src,
        dst,
        rank,
        src_tensors=tensors,
        procs=procs,
        group=pg,
        config=config,
        device=device,
        store=store,
        standalone=True,
        prepare=prepare,
    )
    return pg, peer
