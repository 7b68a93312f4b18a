"""One refit's settings: ``TransferConfig``, validated once where it is made and passed whole.

The planner reads the buffer budget and transport from it (``build_plan(src, dst, procs, config)``), the
executor its copy streams, CUDA graph, checksum and stage settings, a ``Peer`` its deadline, commit mode
and store namespace. Fields that shape the bytes on the wire must agree on every process of a refit
(``agreement()``; pre-flight compares them).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from refit.errors import ConfigError

PIECE_ALIGN = 64
"""Byte alignment of pieces inside a staging buffer (a buffer must hold at least one aligned slot)."""

TRANSPORTS = ("p2p", "ipc", "nixl", "auto")
COMMIT_MODES = ("in_place", "staged")
COMMIT_POLICIES = ("drain", "abort", "in_place")
"""What an engine does with in-flight requests at an overlapped refit's commit (``refit.commit``)."""
DELTA_MODES = ("off", "auto", "sparse", "bitmask", "words")
DELTA_BASES = ("device", "host")


@dataclass(frozen=True)
class TransferConfig:
    """How one refit moves bytes. Invalid values raise ``ConfigError`` naming the field and the value.

    * ``num_buffers`` x ``buffer_bytes``: the staging budget of a process (packed P2P messages).
    * ``transport``: ``"p2p"`` (torch.distributed send/recv), ``"ipc"`` (receivers pull from the
      sources' CUDA memory; every link must be CUDA on one host), ``"nixl"`` (receivers pull from the
      sources' registered memory through NIXL: every link, any host, no process group) or ``"auto"``
      (IPC between CUDA processes of one host, NIXL between hosts where it is installed, else P2P).
    * ``name``: the store namespace; give each Sender/Receiver pairing in one job its own.
    * ``copy_streams`` / ``cuda_graph``: CUDA IPC pulls spread over this many streams per source GPU,
      recorded once into a CUDA graph and replayed per refit.
    * ``deadline_s``: every blocking step of one refit gives up this long after the refit began;
      ``preflight_timeout_s``: how long setup waits for its peers' plans and IPC handles.
    * ``commit``: ``"in_place"`` (bytes land in the live tensors) or ``"staged"`` (all-or-nothing).
    * ``checksums``: a position-sensitive 64-bit checksum of every message / IPC piece, compared by the
      receiver (``ChecksumError`` names the peer or tensor): catches flipped, swapped and zeroed bytes.
      On CUDA with Triton it is computed in the copy that moves the bytes where it can (one kernel per
      P2P step, per IPC stage), plus one read of each IPC source to compare; one host sync per run.
    * ``pull_gbps``: CUDA IPC pulls into this process are paced to about this many GB/s of copied bytes
      (copies in bursts of at most 64 MiB, each followed by a sleep on its stream, counted in SM cycles;
      a same-GPU copy reads and writes, so its HBM traffic is about twice that; ``None``: full speed).
      For refit while generating with the engine on the trainer's GPU: a full-speed pull takes the
      memory bandwidth the engine's passes need, a paced one leaves them most of it and takes longer,
      beside them. Not the copies the checksum kernel fuses (``checksums``). A pace that would make
      this process's pulls outlast half of ``deadline_s`` is refused when the Peer is built.
    * ``stages``: all-IPC plans pull in this many stages so a source's prepare (FP8) overlaps the pulls.
    * ``keep_previous`` (staged only): keep the last committed version in a copy of this process's
      destination share, so ``Peer.rollback()`` restores it without the trainer resending.
    * ``commit_budget_bytes``: the most memory a destination process may add for the commit (the
      shadow, plus the previous version with ``keep_previous``); ``None``: no bound. A share that does
      not fit is refused when the Peer is built (``ConfigError`` naming both numbers).
    * ``delta``: P2P messages carry only the elements changed since the version the receiver holds
      (``"auto"``: dense, sparse, bitmask or words per message by the cost rule of ``refit.delta.rule``;
      ``"sparse"`` / ``"bitmask"``: that encoding whenever the receiver holds the base; ``"words"``: changed
      64-bit words (``refit.delta.words``) where a message's pieces have words, else sparse; under
      ``"auto"`` words where they have and the rule prefers them over the link, ``refit.delta.rule.prefer_words``;
      ``"off"``).
      ``delta_base``: where a source keeps the last version it sent (``"device"`` or pinned ``"host"``
      memory; extra memory: its P2P-sent shards). ``delta_link_gbps``: the link speed the rule weighs
      (default: by the link's kind, ``refit.delta.rule.LINKS``). Not with ``checksums``. Under
      ``"auto"`` a plan where no P2P message can pay as a delta (``refit.delta.rule.may_pay``: its best case
      must beat dense by ``PAY_MARGIN``; NVLink at the measured rates, one device) runs the plain P2P path:
      no base copy, no header exchange. Deltas travel on P2P links, NIXL links (``transport="nixl"``:
      ``refit.transport.nixl_delta``) and CUDA IPC links between two GPUs (``refit.transport.ipc_delta``; same-GPU
      links stay dense; in one stage, unpaced, the base on the device: ``transport="ipc"`` refuses the others,
      ``ipc_delta_refusal``, and under ``"auto"`` they run dense); under ``"auto"`` links between hosts use P2P,
      not NIXL.

    Must agree on every process of a refit: ``agreement()`` (the budget, transport, commit, checksums,
    stages, delta and, with deltas, ``delta_link_gbps``; plus the Peer's ``tag_base``). Pre-flight
    compares them and names a difference with both values. The others (name, timeouts, copy streams,
    CUDA graph, pull pacing) are each process's own.
    """

    num_buffers: int = 2
    buffer_bytes: int = 64 << 20
    preflight_timeout_s: float = 120.0
    transport: str = "p2p"
    name: str = "refit"
    copy_streams: int = 2
    cuda_graph: bool = True
    deadline_s: float = 300.0
    commit: str = "in_place"
    checksums: bool = False
    stages: int = 1
    keep_previous: bool = False
    commit_budget_bytes: int | None = None
    delta: str = "off"
    delta_base: str = "device"
    delta_link_gbps: float | None = None
    pull_gbps: float | None = None

    def __post_init__(self) -> None:
        for field, value, least in (
            ("num_buffers", self.num_buffers, 1),
            ("buffer_bytes", self.buffer_bytes, PIECE_ALIGN),
            ("copy_streams", self.copy_streams, 1),
            ("stages", self.stages, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"TransferConfig.{field} must be an integer >= {least}, got {value!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                f"TransferConfig.transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if self.commit not in COMMIT_MODES:
            raise ConfigError(f"TransferConfig.commit must be one of {', '.join(COMMIT_MODES)}, got {self.commit!r}")
        for field, value in (("deadline_s", self.deadline_s), ("preflight_timeout_s", self.preflight_timeout_s)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value > 0 and math.isfinite(value))
            ):
                raise ConfigError(f"TransferConfig.{field} must be a finite number of seconds > 0, got {value!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"TransferConfig.name must be a non-empty string, got {self.name!r}")
        for field, value in (
            ("cuda_graph", self.cuda_graph),
            ("checksums", self.checksums),
            ("keep_previous", self.keep_previous),
        ):
            if not isinstance(value, bool):
                raise ConfigError(f"TransferConfig.{field} must be True or False, got {value!r}")
        if self.keep_previous and self.commit != "staged":
            raise ConfigError(
                f"TransferConfig.keep_previous=True needs commit='staged' (got commit={self.commit!r}): "
                "only a staged commit leaves the previous version whole"
            )
        g = self.pull_gbps
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g < math.inf)):
            raise ConfigError(f"TransferConfig.pull_gbps must be None or a finite number of GB/s > 0, got {g!r}")
        budget = self.commit_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ConfigError(f"TransferConfig.commit_budget_bytes must be None or an integer >= 0, got {budget!r}")
        self._check_delta()

    def _check_delta(self) -> None:
        for field, value, allowed in (("delta", self.delta, DELTA_MODES), ("delta_base", self.delta_base, DELTA_BASES)):
            if value not in allowed:
                raise ConfigError(f"TransferConfig.{field} must be one of {', '.join(allowed)}, got {value!r}")
        g = self.delta_link_gbps
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g < math.inf)):
            raise ConfigError(f"TransferConfig.delta_link_gbps must be a finite number of GB/s > 0, got {g!r}")
        if self.delta != "off" and self.checksums:
            raise ConfigError(f"TransferConfig.delta={self.delta!r} does not work with checksums=True yet")
        if self.delta != "off" and self.transport == "ipc" and self.ipc_delta_refusal is not None:
            raise ConfigError(self.ipc_delta_refusal)

    @property
    def ipc_delta_refusal(self) -> str | None:
        """Why CUDA IPC links cannot carry this config's deltas (``transport="ipc"`` refuses it; under ``"auto"`` they
        run dense: all of them with ``stages``, a pacing receiver's or a host-base source's), or None: a delta's pull
        is one stage, unpaced, from a base on the device."""
        delta = f"TransferConfig.delta={self.delta!r} over CUDA IPC"
        if self.stages > 1:
            return f"{delta} pulls in one stage, not TransferConfig.stages={self.stages}"
        if self.pull_gbps is not None:
            return f"{delta} is not paced: TransferConfig.pull_gbps={self.pull_gbps!r} must be None"
        if self.delta_base != "device":
            return f"{delta} keeps its base on the device (the find reads it there), not delta_base={self.delta_base!r}"
        return None

    @property
    def cross_host(self) -> str:
        """The transport of a link between two hosts: ``"nixl"`` when asked for, or under ``"auto"`` where
        the ``nixl`` package is installed (``nixl_installed``) and deltas are off; else ``"p2p"`` (deltas
        are built on P2P links, and between hosts, over NICs, is where they pay)."""
        if self.transport == "nixl" or (self.transport == "auto" and not self.deltas and nixl_installed()):
            return "nixl"
        return "p2p"

    @property
    def deltas(self) -> bool:
        """P2P messages may carry only what changed (``delta`` is not ``"off"``)."""
        return self.delta != "off"

    @property
    def staged(self) -> bool:
        """Receivers write into a shadow copy and commit after every process holds the whole version."""
        return self.commit == "staged"

    def agreement(self) -> dict:
        """The fields every process of one refit must share (they shape the messages and the commit)."""
        return {
            "num_buffers": self.num_buffers,
            "buffer_bytes": self.buffer_bytes,
            "transport": self.transport,
            "commit": self.commit,
            "checksums": self.checksums,
            "stages": self.stages,
            "delta": self.delta,
            # under "auto" it decides whether the plan runs the delta protocol at all (``plan_may_pay``)
            "delta_link_gbps": self.delta_link_gbps if self.deltas else None,
        }


def nixl_installed() -> bool:
    """Whether the optional ``nixl`` package (``pip install 'refit-rl[nixl]'``) is installed here (found,
    not imported: the planner asks, and importing NIXL starts its logging)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False
