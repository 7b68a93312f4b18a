"""``refit verify --inject MODE``: a real multi-process refit with one fault, and what it must do.

Every process commits version 1 (checked bit for bit), then the fault strikes
during version 2:

* ``kill-receiver`` / ``kill-sender``: destination rank 0 / the last source
  rank dies (SIGKILL) half way through the transfer's steps;
* ``corrupt``: one byte of a message flips after it arrived at destination
  rank 0, before the checksum check (checksums on);
* ``swap`` / ``zero``: likewise, the message's largest piece has its first two
  64-byte blocks exchanged / is zeroed (what an order-insensitive sum misses);
* ``shape-mismatch``: the next transfer's setup gets a source tensor of the
  wrong shape on source rank 0;
* ``slow-receiver``: destination rank 0 stalls for 1.5x the deadline half way.

Handled as specified means: every surviving process raises the same error,
naming what happened, within the deadline (plus setup); no process hangs; and
every surviving engine rank still holds version 1, bit for bit (commit mode
``staged``).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, replace

import torch

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout import ModelLayout
from refit.plan import ProcessMap
from refit.tools.launch import World, run_local
from refit.tools.verify import holds, reference_shards
from refit.transfer import Peer

MODES = ("kill-receiver", "kill-sender", "corrupt", "swap", "zero", "shape-mismatch", "slow-receiver")
CORRUPTING = ("corrupt", "swap", "zero")  # received bytes change; retrying the version must succeed
# what the survivors' common error must say, per mode
EXPECT = {
    "kill-receiver": ("process {victim}",),
    "kill-sender": ("process {victim}",),
    "corrupt": ("checksum mismatch",),
    "swap": ("checksum mismatch",),
    "zero": ("checksum mismatch",),
    "shape-mismatch": ("has shape",),
    "slow-receiver": ("deadline", "process {victim}"),
}
# the side of the process each mode strikes, and what it does there (the CLI's words)
VICTIM_ROLE = {
    "kill-receiver": "engine",
    "kill-sender": "trainer",
    "corrupt": "engine",
    "swap": "engine",
    "zero": "engine",
    "shape-mismatch": "trainer",
    "slow-receiver": "engine",
}
HAPPENED = {
    "kill-receiver": "engine process {victim} was killed half way through version 2",
    "kill-sender": "trainer process {victim} was killed half way through version 2",
    "corrupt": "a byte flipped on engine process {victim} after the wire, before the checksum check",
    "swap": "two pieces were swapped on engine process {victim} after the wire, before the checksum check",
    "zero": "a piece was zeroed on engine process {victim} after the wire, before the checksum check",
    "shape-mismatch": "trainer process {victim} set up version 2 with a tensor of the wrong shape",
    "slow-receiver": "engine process {victim} stalled for 1.5x the deadline half way through version 2",
}
_TRANSPORT_NOISE = re.compile(
    r"\s*\[[^\]\s]+\.(?:cc|cpp|h):\d+\]\s*|\s*This is typically caused by.*?GLHF!\s*\S*", re.DOTALL
)


def plain_error(text: str) -> str:
    """``text`` on one line without gloo's internals (its source file and line, its advice to read the
    remote worker's logs); refit's own words (who, which step, which tensors) stay."""
    return " ".join(_TRANSPORT_NOISE.sub(" ", text).split())


@dataclass(frozen=True)
class InjectResult:
    """What one ``inject`` run did: the fault ``mode``, the process it hit (``victim``) and the
    deadline used, with one row per process, by rank (None: it died).

    A row: ``role``, ``rank``, ``victim``; ``error`` (what version 2 raised there, None if
    nothing) and ``elapsed_s``; ``version`` (the last it committed) and ``v1_exact`` (an engine
    still holds version 1 bit for bit); ``retried_version`` and ``v2_exact_after_retry`` (None
    unless a corrupting mode (``CORRUPTING``) retried version 2). ``problems()`` lists where the run fell short of the
    module docstring's specification (empty: handled as specified); ``last_line()`` is the
    CLI's line.
    """

    mode: str
    victim: int  # the process the fault hit
    rows: list[dict | None]  # per process: None if it died
    deadline_s: float

    @property
    def errors(self) -> list[str]:
        return [r["error"] for r in self.rows if r is not None and r["error"] is not None]

    def problems(self) -> list[str]:
        """Ways the run fell short of the specification (empty: handled as specified)."""
        out = []
        survivors = [(p, r) for p, r in enumerate(self.rows) if r is not None]
        for p, r in survivors:
            if r["error"] is None:
                out.append(f"process {p} finished version 2 without an error")
            elif r["elapsed_s"] > self.deadline_s + 30:
                out.append(f"process {p} took {r['elapsed_s']:.1f}s to fail (deadline {self.deadline_s}s)")
            if r["role"] == "engine" and not (r["version"] == 1 and r["v1_exact"]):
                out.append(f"engine process {p} holds version {r['version']} (bit-exact v1: {r['v1_exact']})")
        distinct = sorted(set(self.errors))
        # a refit's abort reaches everyone as one message; a setup failure as the failing
        # process's own error and the peers' pre-flight report of it
        if len(distinct) > 1 and self.mode != "shape-mismatch":
            out.append(f"survivors raised {len(distinct)} different errors: {distinct}")
        for e in distinct:
            for want in (w.format(victim=self.victim) for w in EXPECT[self.mode]):
                if want not in e:
                    out.append(f"an error does not say {want!r}: {e}")
        for p, r in survivors:
            if self.mode in CORRUPTING and (r["retried_version"] != 2 or r["v2_exact_after_retry"] is False):
                out.append(
                    f"process {p}: retrying version 2 gave version {r['retried_version']} "
                    f"(bit-exact: {r['v2_exact_after_retry']})"
                )
        if self.mode.startswith("kill") and self.rows[self.victim] is not None:
            out.append(f"process {self.victim} was to die but returned")
        return out

    def role(self, process: int) -> str:
        """``"trainer"`` or ``"engine"``: a row's role, or the victim's for a process that died."""
        row = self.rows[process]
        return row["role"] if row is not None else VICTIM_ROLE[self.mode]

    def last_line(self) -> str:
        """One line: DETECTED or NOT HANDLED, what the fault did, the survivors' shortest error (without the
        transport's internals), a dead trainer, each engine's version, problems."""
        engines = ", ".join(
            f"process {p}: "
            + ("dead" if r is None else f"v{r['version']}" + (" (bit-exact)" if r["v1_exact"] else " (DIFFERS)"))
            for p, r in enumerate(self.rows)
            if self.role(p) == "engine"
        )
        dead = "".join(
            f" | trainer process {p}: dead" for p, r in enumerate(self.rows) if r is None and self.role(p) == "trainer"
        )
        probs = self.problems()
        head = "DETECTED" if not probs else "NOT HANDLED"
        what = plain_error(min(self.errors, key=len)) if self.errors else "no error raised"
        happened = HAPPENED[self.mode].format(victim=self.victim)
        return f"{head} {self.mode}: {happened}; the survivors raised: {what}{dead} | engines: {engines}" + (
            f" | problems: {'; '.join(plain_error(p) for p in probs)}" if probs else ""
        )


def _victim(procs: ProcessMap, mode: str) -> int:
    """Destination rank 0's process, or the last source rank's (process 0 hosts the rendezvous
    store; its death takes the side channel with it, a case of its own: every process then
    reports the store lost)."""
    return procs.dst[0] if VICTIM_ROLE[mode] == "engine" else procs.src[-1]


@dataclass
class _Process:
    """One process of the run: its role, its tensors and the Peer that committed version 1."""

    world: World
    procs: ProcessMap
    is_src: bool
    rank: int
    tensors: dict[str, torch.Tensor]
    peer: Peer

    @property
    def tensors_kw(self) -> dict:
        return {"src_tensors": self.tensors} if self.is_src else {"dst_tensors": self.tensors}


def _version_1(world: World, src: ModelLayout, dst: ModelLayout, config: TransferConfig, seed: int) -> _Process:
    """Every process commits version 1 (engines start from NaN)."""
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    is_src = world.src_rank is not None
    rank = world.src_rank if is_src else world.dst_rank
    tensors = reference_shards(src if is_src else dst, rank, seed)
    if not is_src:
        for t in tensors.values():
            t.fill_(float("nan"))
    kw = {"src_tensors": tensors} if is_src else {"dst_tensors": tensors}
    peer = Peer(src, dst, world.rank, procs=procs, config=config, **kw)
    peer.run(1)
    return _Process(world, procs, is_src, rank, tensors, peer)


def _fault_hook(proc: _Process, victim: int, mode: str, config: TransferConfig):
    """The executor's fault hook for ``mode``: it strikes on ``victim`` only, half way through the steps."""
    world, peer = proc.world, proc.peer
    steps = len(peer.executor.steps)
    middle = peer.executor.steps[steps // 2] if steps else None

    later = set(map(id, peer.executor.steps[steps // 2 :]))
    corrupted = []

    def fault(where: str, info: dict) -> None:
        if world.rank != victim:
            return
        if where == "step" and info["step"] is middle and mode in ("kill-receiver", "kill-sender"):
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "step" and info["step"] is middle and mode == "slow-receiver":
            time.sleep(1.5 * config.deadline_s)
        if (
            where == "received"
            and mode in CORRUPTING
            and not corrupted
            and id(info["step"]) in later
            and info["step"].recvs
        ):
            _damage(info["step"].recvs[0], mode)  # after the wire, before the check
            corrupted.append(True)

    return fault


def _damage(op, mode: str) -> None:
    """``corrupt``: flip a bit of the message's last byte; ``swap``: exchange the first two 64-byte blocks
    of its largest piece (half its length each if shorter); ``zero``: zero that piece."""
    if mode == "corrupt":
        op.tensor.view(torch.uint8)[-1] ^= 0x10
        return
    data = max((bv for bv, _ in op.pack), key=lambda v: v.numel() * v.element_size()) if op.pack else op.tensor
    b = data.reshape(-1).view(torch.uint8)
    if mode == "zero":
        b.zero_()
        return
    k = min(64, b.numel() // 2)
    first = b[:k].clone()
    b[:k] = b[k : 2 * k]
    b[k : 2 * k] = first


def _version_2(
    proc: _Process, src: ModelLayout, dst: ModelLayout, config: TransferConfig, mode: str, victim: int
) -> tuple[str | None, float]:
    """Version 2 with the fault; returns the error it raised here (None: none) and how long it took."""
    world, procs, is_src, tensors, peer = proc.world, proc.procs, proc.is_src, proc.tensors, proc.peer
    fault = _fault_hook(proc, victim, mode, config)
    error, t0 = None, time.monotonic()
    try:
        if mode == "shape-mismatch":
            bad = dict(tensors)
            if world.rank == victim:
                name = next(iter(bad))
                bad[name] = torch.zeros(*[n + 1 for n in bad[name].shape], dtype=bad[name].dtype)
            kw2 = {"src_tensors": bad} if is_src else {"dst_tensors": tensors}
            Peer(src, dst, world.rank, procs=procs, config=replace(config, name=f"{config.name}-2"), **kw2).run(2)
        else:
            peer.run(2, fault_hook=fault)
    except Exception as e:  # noqa: BLE001 - the result to report
        error = str(e)
    return error, time.monotonic() - t0


def _retry(proc: _Process, src: ModelLayout, dst: ModelLayout, config: TransferConfig) -> int:
    """Nobody died: retrying version 2 must succeed, on a fresh group (the aborted refit may have left
    messages in flight on the old one) and under a new name. Returns the version it reached."""
    world = proc.world
    fresh = torch.distributed.new_group(list(range(world.world_size)), backend="gloo")
    again = Peer(
        src,
        dst,
        world.rank,
        procs=proc.procs,
        group=fresh,
        config=replace(config, name=f"{config.name}-retry"),
        **proc.tensors_kw,
    )
    again.run(2)
    again.close()
    return again.version


def _wait_for_survivors(world: World, dead: set[int], config: TransferConfig) -> None:
    """The store lives in process 0: it stays until every survivor (all but ``dead``) is done with it."""
    store = world.store
    store.put(f"inject/done/{world.rank}", True)
    if world.rank == 0:
        keys = [f"inject/done/{r}" for r in range(world.world_size) if r not in dead]
        until = time.monotonic() + 2 * config.deadline_s + 30
        while len(store.get_all(keys)) < len(keys) and time.monotonic() < until:
            time.sleep(0.01)


def _worker(world: World, src: ModelLayout, dst: ModelLayout, config: TransferConfig, mode: str, seed: int):
    proc = _version_1(world, src, dst, config, seed)
    is_src, rank, tensors = proc.is_src, proc.rank, proc.tensors
    v1_exact = None if is_src else holds(tensors, dst, rank, seed)
    if is_src:  # version 2: the trainer's new weights, in place
        for name, t in reference_shards(src, rank, seed + 1).items():
            tensors[name].copy_(t)
    victim = _victim(proc.procs, mode)
    error, elapsed = _version_2(proc, src, dst, config, mode, victim)
    proc.peer.close()
    exact = None  # after the failed refit: still version 1, bit for bit?
    if not is_src:
        exact = holds(tensors, dst, rank, seed)
    retried = _retry(proc, src, dst, config) if mode in CORRUPTING and error is not None else None
    _wait_for_survivors(world, {victim} if mode.startswith("kill") else set(), config)
    v2_exact = None
    if retried is not None and not is_src:
        v2_exact = holds(tensors, dst, rank, seed + 1)
    return {
        "role": "trainer" if is_src else "engine",
        "rank": rank,
        "error": error,
        "elapsed_s": elapsed,
        "version": proc.peer.version,
        "v1_exact": bool(v1_exact and exact) if not is_src else None,
        "victim": victim,
        "retried_version": retried,
        "v2_exact_after_retry": v2_exact,
    }


def inject(
    src: ModelLayout,
    dst: ModelLayout,
    mode: str,
    *,
    deadline_s: float = 10.0,
    seed: int = 0,
    config: TransferConfig | None = None,
) -> InjectResult:
    """One refit of ``src`` to ``dst`` on this machine (gloo, one process per rank) with fault
    ``mode`` in version 2 (``ConfigError`` for a mode not in ``MODES``). The transfer config
    (``config``, default 2 buffers of 64 KiB) is run with staged commit, checksums on,
    ``deadline_s``, a pre-flight timeout of ``max(30, deadline_s)`` and name ``"inject"``."""
    if mode not in MODES:
        raise ConfigError(f"--inject must be one of {', '.join(MODES)}, got {mode!r}")
    base = config or TransferConfig(num_buffers=2, buffer_bytes=64 << 10)
    cfg = replace(
        base,
        commit="staged",
        checksums=True,
        deadline_s=deadline_s,
        name="inject",
        preflight_timeout_s=max(30.0, deadline_s),
    )
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    victim = _victim(procs, mode)
    dead = {victim} if mode.startswith("kill") else set()
    rows = run_local(
        _worker,
        src.world_size,
        dst.world_size,
        src,
        dst,
        cfg,
        mode,
        seed,
        backend="gloo",
        timeout_s=max(120.0, 4 * deadline_s + 60),
        expect_dead=dead,
    )
    return InjectResult(mode, victim, rows, deadline_s)
