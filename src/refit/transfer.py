"""The two sides' API: ``Sender(...).push(version)`` on trainer ranks, ``Receiver(...).pull(version)`` on engine ranks.

Contract
--------
* Both sides are constructed with the same two ModelLayouts (source and
  destination), process map and ``TransferConfig``; each derives the Plan on its
  own, then pre-flight exchanges ``{digest, agreed settings, nonce}`` through the
  rendezvous store (no data collective; every later value of the session is
  tagged in a scope bound to all members' nonces: ``session_scope``): a mismatch raises ``PlanError`` on
  every process, naming the differing setting (``stages``, ``checksums``,
  ``tag_base``, ...) with both values, or both digests and the first differing
  tensor.
* ``push(v)`` / ``pull(v)`` are called once per refit, with the same ``v`` on
  every process; the local tensors must be updated in place between refits
  (as optimizers do), so the views bound at setup stay valid.
* A process may be both a sender and a receiver (colocated): use ``Peer``.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from refit.binding import bind_local
from refit.commit import StagedCommit
from refit.config import TransferConfig
from refit.delta.header import exchange_held
from refit.errors import PlanError, RefitError
from refit.executor import Comms, Executor, FaultHook, RunStats
from refit.layout import ModelLayout
from refit.plan import Plan, ProcessMap, build_plan
from refit.transport.authstore import calls_within
from refit.transport.control import AbortChannel, RefitAborted
from refit.transport.ipc_pace import check_pace
from refit.transport.store import SignedStore, signed


def _first_difference(side: str, mine: list, theirs: list) -> str | None:
    """Entries are ``canonical_tensor``'s ``[name, shape, dtype, ranks, boxes]``; describe the first that
    differs (its name, shape and dtype, else the first rank whose box differs)."""
    for a, b in zip(mine, theirs):
        if a[:3] != b[:3]:
            return f"first differing {side} tensor: here {a[:3]}, there {b[:3]}"
        if a[5:] != b[5:]:
            return f"{side} tensor {a[0]!r} is stored in blocks of {a[5:] or 'all'} rows here, {b[5:] or 'all'} there"
        if a[3:] != b[3:]:
            here, there = dict(zip(a[3], a[4])), dict(zip(b[3], b[4]))
            r = min(r for r in here.keys() | there.keys() if here.get(r) != there.get(r))
            return (
                f"{side} tensor {a[0]!r} is sharded differently: {side} rank {r} holds "
                f"{here.get(r, 'nothing')} here, {there.get(r, 'nothing')} there"
            )
    if len(mine) != len(theirs):
        return f"{side} tensor counts differ: here {len(mine)}, there {len(theirs)}"
    return None


def _process_difference(mine: dict, theirs: dict) -> str | None:
    """``Plan.canonical()``'s process map and devices: describe the first difference."""
    for i, side in enumerate(("source", "destination")):
        a, b = mine["procs"][i], theirs["procs"][i]
        if len(a) != len(b):
            return f"the process map has {len(a)} {side} ranks here, {len(b)} there"
        for r, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"the process map differs: {side} rank {r} is process {x} here, process {y} there"
    a, b = mine["devices"], theirs["devices"]
    if (a is None) != (b is None) or (a is not None and len(a) != len(b)):
        return f"devices differ: {len(a) if a else 'none'} given here, {len(b) if b else 'none'} there"
    for p, (x, y) in enumerate(zip(a or (), b or ())):
        if x != y:
            return f"devices differ: process {p} is on {x} here, on {y} there"
    return None


def publish_failure(store: SignedStore | None, proc: int, error: BaseException, tag: str = "refit") -> None:
    """Tell the peers waiting in pre-flight that this process failed its setup, and why."""
    if store is not None:
        store.put(f"{tag}/preflight/{proc}", {"error": f"{type(error).__name__}: {error}"})


def publish_plan(
    plan: Plan, proc: int, store: SignedStore, tag: str = "refit", tag_base: int = 0, agree: Mapping | None = None
) -> str:
    """Publish what the peers' pre-flight checks: ``{tag}/preflight/{proc}/plan`` holds ``plan.canonical()``
    (read only on a mismatch, to name it), then ``{tag}/preflight/{proc}`` the digest, the settings
    that must agree (``config.agreement()``, ``tag_base`` and the caller's ``agree``, e.g. an expert map's digest)
    and a fresh random nonce (returned: the session's scope is bound to every member's, ``session_scope``). Plain
    JSON, tagged with the job secret."""
    store.put(f"{tag}/preflight/{proc}/plan", plan.canonical())
    agreed = {**plan.config.agreement(), "tag_base": tag_base, **(agree or {})}
    nonce = secrets.token_hex(16)
    store.put(f"{tag}/preflight/{proc}", {"digest": plan.digest, "agreed": agreed, "nonce": nonce})
    return nonce


def session_scope(nonces: Mapping[int, str]) -> str:
    """The scope a session's aborts, votes and commit records are tagged in: a digest of every member's
    pre-flight nonce. Each process takes its own nonce from memory, never from the store, so every
    scope it uses is one no earlier job or session used: a recorded value replayed into it does not
    verify. A nonce swapped in the store only splits the members' scopes (then nobody's votes verify
    for the others and nobody commits: denial of service, as deleting keys is)."""
    text = ",".join(f"{p}={nonces[p]}" for p in sorted(nonces))
    return "session:" + hashlib.sha256(text.encode()).hexdigest()


def _record(store: SignedStore, tag: str, p: int, timeout_s: float) -> dict:
    """Process ``p``'s pre-flight record (a validly tagged JSON object), waiting up to ``timeout_s``."""
    try:
        theirs = store.get(f"{tag}/preflight/{p}", timeout_s)
    except TimeoutError as e:
        raise PlanError(f"pre-flight: process {p} did not publish its plan within {timeout_s:.0f}s ({e})") from e
    if not isinstance(theirs, dict):
        raise PlanError(f"pre-flight: process {p} published {type(theirs).__name__}, not a plan record")
    return theirs


def agree_scope(store: SignedStore, tag: str, proc: int, members: list[int], timeout_s: float) -> SignedStore:
    """``store`` scoped to a fresh nonce of every process of ``members`` (``session_scope``), for values
    outside a ``Peer`` (a ``Fanout``'s fleet decisions): each process publishes its own nonce under
    ``{tag}/nonce/{proc}`` and waits up to ``timeout_s`` for the others' (``PlanError`` naming the silent)."""
    nonce = secrets.token_hex(16)
    store.put(f"{tag}/nonce/{proc}", nonce)
    keys = {p: f"{tag}/nonce/{p}" for p in members if p != proc}
    got = store.wait_all(keys.values(), timeout_s)
    silent = [p for p, k in keys.items() if not isinstance(got.get(k), str)]
    if silent:
        raise PlanError(
            f"{tag}: processes {silent} did not publish their nonce within {timeout_s:.0f}s "
            f"({sum(store.rejected[keys[p]] for p in silent)} value(s) with invalid tags seen there)"
        )
    return store.scoped(session_scope({**{p: got[k] for p, k in keys.items()}, proc: nonce}))


def check_peers(
    proc: int, peers: list[int], store: SignedStore, timeout_s: float, tag: str = "refit"
) -> dict[int, str]:
    """Compare what ``proc`` published with what every peer published (waiting up to ``timeout_s`` for
    each); raise PlanError naming the first difference: a peer's setup error, an agreed setting with
    both values, else both digests and the first differing tensor, process or device. Only values
    tagged with the job secret count: a forged error or plan is ignored. Returns the peers' nonces."""
    mine, nonces = _record(store, tag, proc, timeout_s), {}
    for p in peers:
        if p == proc:
            continue
        theirs = _record(store, tag, p, timeout_s)
        if "error" in theirs:
            raise PlanError(f"pre-flight: process {p} failed its setup: {theirs['error']}")
        if not isinstance(theirs.get("agreed"), dict) or "digest" not in theirs:
            raise PlanError(
                f"pre-flight: process {p} published a plan record of another refit version: {sorted(theirs)}"
            )
        a, b = mine["agreed"], theirs["agreed"]
        for k in [*a, *(k for k in b if k not in a)]:
            if a.get(k) != b.get(k):
                raise PlanError(f"pre-flight: process {proc} has {k}={a.get(k)!r}, process {p} has {k}={b.get(k)!r}")
        if theirs["digest"] != mine["digest"]:
            raise PlanError(
                f"pre-flight: plan digest of process {proc} is {mine['digest']}, of process {p} is "
                f"{theirs['digest']}; {_plan_difference(store, tag, proc, p, timeout_s)}"
            )
        nonces[p] = str(theirs.get("nonce", ""))
    return nonces


def _plan_difference(store: SignedStore, tag: str, proc: int, p: int, timeout_s: float) -> str:
    """Why the plans ``proc`` and ``p`` published differ: the first differing tensor, process or device."""
    here = store.get(f"{tag}/preflight/{proc}/plan", timeout_s)
    there = store.get(f"{tag}/preflight/{p}/plan", timeout_s)
    return (
        _first_difference("source", here["src"], there["src"])
        or _first_difference("destination", here["dst"], there["dst"])
        or _process_difference(here, there)
        or "layouts, process map, devices and settings agree; the messages differ (another refit version?)"
    )


def preflight(
    plan: Plan,
    proc: int,
    store: SignedStore | None,
    timeout_s: float,
    tag: str = "refit",
    tag_base: int = 0,
    agree: Mapping | None = None,
) -> SignedStore | None:
    """Publish this process's plan digest, agreed settings and nonce (``publish_plan``); check every
    peer's against them (``check_peers``); return ``store`` scoped to the session (``session_scope``),
    the store every later value of the session goes through.

    Runs through the rendezvous store only, so a mismatch can never become a
    hang inside a data collective; every process raises the same kind of error.
    """
    peers = sorted({*plan.procs.src, *plan.procs.dst})
    if store is None or len(peers) == 1:
        return store
    nonce = publish_plan(plan, proc, store, tag, tag_base, agree)
    nonces = check_peers(proc, peers, store, timeout_s, tag)
    return store.scoped(session_scope({**nonces, proc: nonce}))


class Peer:
    """One process's part in a refit: the source rank it hosts, the destination rank, or both.

    ``run(version)`` moves one version. Every blocking step gives up at
    ``config.deadline_s``; the first process to fail publishes why through the
    store and every process raises :class:`RefitAborted` with that message.
    ``version`` is the last version committed here. Commit modes:

    * ``"in_place"`` (default, no extra memory): bytes land in the live
      tensors as they arrive. After an abort the destination is ``torn``
      (part new, part old): do not serve it; retry the version.
    * ``"staged"``: bytes land in a shadow copy of this process's destination
      tensors (extra memory: its share of the model; twice that with
      ``config.keep_previous``; bounded by ``config.commit_budget_bytes``); once
      every process of the refit holds all of it (a vote through the store),
      each copies the shadow into the live tensors. After an abort the live
      tensors are still the last committed version, bit for bit. ``run(v)`` is
      ``stage(v)`` (transfer and vote: the engine may keep running on the live
      tensors) then ``commit(pause, resume)`` (the only write to them, between
      the engine's hooks); ``rollback()`` restores v-1 with ``keep_previous``.

    Lifecycle: construction is collective — it builds the plan, checks this
    process's tensors, then blocks in pre-flight until every process of the
    refit has published its plan (up to ``config.preflight_timeout_s``), then
    sets up the executor (IPC handles go through the store). ``run(v)`` once
    per refit on every process, with the same increasing ``v``; ``close()``
    when done (stops the waiter thread, unlinks the shared-memory barrier).
    Must agree on every process: the layouts, process map, ``config.agreement()``
    and ``tag_base`` (pre-flight raises ``PlanError`` naming what differs).
    Between calls: the local tensors change in place only (views bound at setup
    stay valid); sources hold their final weights when ``run`` begins (or make
    them so in ``prepare``).

    After an abort the transfer group may hold unfinished operations: retry
    with a new Peer, either on a fresh group or on the same group with a new
    ``config.name`` and a fresh ``tag_base`` range (as ``Fanout`` does), so a
    receive left posted by the failed attempt never matches.

    CUDA tensors over P2P need an NCCL ``group``. For delta refits make it with
    high-priority streams (``pg_options=ProcessGroupNCCL.Options(
    is_high_priority_stream=True)``, as ``refit.tools.launch`` does): a chunk's
    payload sends then start beside the next chunk's find, not after it.
    """

    def __init__(
        self,
        src_layout: ModelLayout,
        dst_layout: ModelLayout,
        proc: int,
        *,
        src_tensors: Mapping[str, torch.Tensor] | None = None,
        dst_tensors: Mapping[str, torch.Tensor] | None = None,
        procs: ProcessMap | None = None,
        group: dist.ProcessGroup | None = None,
        sync_group: dist.ProcessGroup | None = None,
        config: TransferConfig | None = None,
        device: torch.device | str = "cpu",
        plan: Plan | None = None,
        store: dist.Store | SignedStore | None = None,
        standalone: bool = False,
        prepare: Callable[[set[str] | None], None] | None = None,
        tag_base: int = 0,
        private_dst: bool = False,
        agree: Mapping[str, str] | None = None,
    ) -> None:
        """``config``: default ``TransferConfig()``. ``tag_base``: P2P tags start there (see ``Executor``).
        ``agree``: more values pre-flight compares (``refit.eplb``: the expert map's digest).
        ``private_dst``: the destination tensors are receive buffers nothing reads before the commit (a
        loader's, as the vLLM loader path's): a staged refit writes them directly, without a shadow.
        ``prepare(names)``: called on a source process in every ``run`` before its tensors
        ``names`` (``None``: all) are read (e.g. an ``Fp8Quantizer`` refreshing the FP8 copies the
        plan sends); with ``config.stages`` > 1 on an all-IPC plan, once per stage, overlapping
        the pulls of the stage before. A failure there aborts the refit like any other."""
        config = config if config is not None else TransferConfig()
        if store is None and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        store = signed(store)  # the job's secret (``ConfigError`` if this process was given none)
        try:
            self.plan = plan or build_plan(src_layout, dst_layout, procs, config)
            local = bind_local(self.plan, proc, src_tensors, dst_tensors)  # checked once, here
            check_pace(self.plan, proc, config)
        except Exception as e:
            publish_failure(store, proc, e, config.name)
            raise
        self.config, self.proc = config, proc
        self.live = dict(dst_tensors or {})
        try:  # the shadow (and v-1 with keep_previous), within the user's commit budget
            self.buffers = (
                StagedCommit(self.live, keep_previous=config.keep_previous, budget=config.commit_budget_bytes)
                if config.staged and self.live and not private_dst
                else None
            )
        except Exception as e:
            publish_failure(store, proc, e, config.name)
            raise
        self.shadow = self.buffers.shadow if self.buffers is not None else {}
        self.private_dst = private_dst
        # the executor's setup may exchange IPC handles: only once the plans agree
        store = preflight(self.plan, proc, store, config.preflight_timeout_s, config.name, tag_base, agree)
        self.executor = Executor(
            self.plan,
            proc,
            local=local.with_destination(self.shadow) if self.shadow else local,
            config=config,
            comms=Comms(group=group, sync_group=sync_group, store=store, standalone=standalone),
            device=device,
            prepare=prepare,
            tag_base=tag_base,
        )
        self.store = store
        self.members = sorted({*self.plan.procs.src, *self.plan.procs.dst})
        name, world = f"{config.name}/run", len(self.members)
        self.channel = AbortChannel(store, name, proc, world, self.members) if store is not None else None
        self.version: int | None = None  # the last version committed here
        self.torn = False  # in_place: an aborted refit left the destination part new, part old
        self.stale = False  # the destination no longer holds ``version`` (``invalidate``): no delta onto it
        self.broken: str | None = None  # why this Peer can no longer run (an aborted refit)
        self.last: RunStats | None = None
        self.staged_version: int | None = None  # staged and voted, not yet committed (``stage``)
        self._attempts: dict[int, int] = {}

    def run(self, version: int, *, fault_hook: FaultHook | None = None) -> RunStats:
        """Move ``version`` (greater than the last one committed here; the same on every process) and
        commit it: ``stage`` then ``commit`` for ``"staged"``; bytes straight into the live tensors for
        ``"in_place"``. ``fault_hook``: called inside the executor's steps (tests, ``refit verify --inject``)."""
        stats = self.stage(version, fault_hook=fault_hook)
        self.commit()
        return stats

    def stage(self, version: int, *, fault_hook: FaultHook | None = None) -> RunStats:
        """Move ``version`` without touching the live tensors (``"staged"``: into the shadow; the engine
        may keep running on them meanwhile), then vote: returns once every process of the refit holds
        all of it. ``commit()`` then makes it live. On failure every process raises the same
        ``RefitAborted`` and the live tensors are unchanged. (``"in_place"``: the bytes land in the live
        tensors, there is no vote, and ``commit()`` only records the version.)"""
        if self.broken is not None:
            raise RefitAborted(
                f"this Peer's transfer group was left unusable by an aborted refit ({self.broken}); "
                "build a new Peer (fresh group, new config.name) to retry"
            )
        if self.version is not None and version <= self.version:
            raise ValueError(f"version must increase: got {version} after {self.version}")
        attempt = self._attempts.get(version, 0)
        self._attempts[version] = attempt + 1
        deadline = time.monotonic() + self.config.deadline_s
        ch = self.channel
        check_abort = (lambda: ch.raise_if_aborted(version, attempt)) if ch is not None else None
        self.staged_version = None
        with calls_within(deadline):  # store calls end by the deadline, also when its host is cut off
            try:
                held = self._held(version, attempt, deadline)
                stats = self.executor.run(deadline, check_abort, fault_hook, version=version, held=held)
                if self.config.staged and ch is not None:
                    ch.vote(version, attempt, deadline, self.members)  # every process holds all of this version
            except RefitAborted as e:
                self._fail(str(e))
                raise
            except Exception as e:  # noqa: BLE001 - every process raises the same message
                msg = f"refit of version {version} aborted: process {self.proc}: {type(e).__name__}: {e}"
                if ch is not None:
                    msg = ch.abort(version, attempt, msg)
                self._fail(msg)
                raise RefitAborted(msg) from e
        delta = self.executor.delta
        if delta is not None and delta.base is not None:
            with self.executor.on_stream():  # the run's changes are on its stream
                delta.base.commit(version)  # the base is what was sent only once every process holds it
        if self.executor.nixl is not None:
            with self.executor.on_stream():  # a NIXL source's deferred base updates, on the run's stream
                self.executor.nixl.commit(version)
        self.staged_version, self.last = version, stats
        return stats

    def commit(self, pause: Callable[[], None] | None = None, resume: Callable[[], None] | None = None) -> float:
        """Make the version ``stage`` moved live here: ``pause()``, shadow -> live (one copy per tensor),
        ``resume()`` (the engine's hooks; ``StagedCommit.commit``). Returns the seconds of the copy (0 on
        a process with no destination tensors, or ``"in_place"``). ``RefitError`` if nothing is staged."""
        version = self.staged_version
        if version is None:
            raise RefitError("commit(): no staged version (call stage(v) first; a failed stage leaves none)")
        seconds = 0.0
        if self.buffers is not None:
            seconds = self.buffers.commit(version, pause, resume)
        self.version, self.staged_version, self.torn, self.stale = version, None, False, False
        return seconds

    def rollback(self, pause: Callable[[], None] | None = None, resume: Callable[[], None] | None = None) -> None:
        """Restore the version before the last commit into the live tensors, without the trainer
        (``TransferConfig(keep_previous=True)``; ``StagedCommit.rollback``). Local to this process: call it
        on every destination process of the fleet. ``RefitError`` when nothing can be restored."""
        if self.buffers is None:
            raise RefitError(
                "rollback() needs destination tensors and TransferConfig(commit='staged', keep_previous=True)"
            )
        self.version = self.buffers.rollback(pause, resume)
        self.staged_version = None

    def invalidate(self) -> None:
        """This process's destination tensors no longer hold ``version`` (e.g. the engine reloaded them):
        its senders send the next refit dense (a delta needs the exact base version)."""
        self.stale = True

    def _held(self, version: int, attempt: int, deadline: float) -> dict[int, int | None] | None:
        """Delta mode: the version this process holds (``None`` if stale) and, for a source, the version
        each of its P2P receivers holds, through the signed store (``exchange_held``)."""
        delta = self.executor.delta
        held = None if self.stale or self.torn else self.version
        if delta is None:  # NIXL deltas exchange what their receivers hold themselves (``NixlLink.start``)
            return {self.proc: held} if self.config.deltas else None
        if self.store is None:
            delta.told = None  # no exchange: no quiet refits either
            return {self.proc: held}
        key = f"{self.config.name}/delta/{version}/{attempt}/held"
        left = max(0.0, deadline - time.monotonic())
        quiet = delta.quiet_senders()
        out, delta.told = exchange_held(self.store, key, self.proc, held, delta.receives, delta.receivers, left, quiet)
        return out

    def close(self) -> None:
        """Stop this Peer's helper thread and shared-memory barrier (its tensors stay as they are)."""
        self.executor.close()

    def _fail(self, msg: str) -> None:
        self.broken = msg
        if self.executor.delta is not None:
            self.executor.delta.fail()
        if self.executor.nixl is not None:
            self.executor.nixl.fail()
        if self.live and not self.shadow and not self.private_dst:
            self.torn = True


class Sender(Peer):
    """Trainer side: ``Sender(src, dst, proc, tensors=local_shards).push(version)``; the keywords are ``Peer``'s."""

    def __init__(
        self,
        src_layout: ModelLayout,
        dst_layout: ModelLayout,
        proc: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        procs: ProcessMap | None = None,
        group: dist.ProcessGroup | None = None,
        sync_group: dist.ProcessGroup | None = None,
        config: TransferConfig | None = None,
        device: torch.device | str = "cpu",
        plan: Plan | None = None,
        store: dist.Store | SignedStore | None = None,
        standalone: bool = False,
        prepare: Callable[[set[str] | None], None] | None = None,
        tag_base: int = 0,
    ) -> None:
        super().__init__(
            src_layout,
            dst_layout,
            proc,
            src_tensors=tensors,
            procs=procs,
            group=group,
            sync_group=sync_group,
            config=config,
            device=device,
            plan=plan,
            store=store,
            standalone=standalone,
            prepare=prepare,
            tag_base=tag_base,
        )

    def push(self, version: int) -> RunStats:
        """Send this trainer rank's share of ``version`` (``Peer.run``); every receiver pulls the same one."""
        return self.run(version)


class Receiver(Peer):
    """Engine side: ``Receiver(src, dst, proc, tensors=live_shards).pull(version)`` writes in place; the
    keywords are ``Peer``'s (no ``prepare``: it runs on sources only)."""

    def __init__(
        self,
        src_layout: ModelLayout,
        dst_layout: ModelLayout,
        proc: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        procs: ProcessMap | None = None,
        group: dist.ProcessGroup | None = None,
        sync_group: dist.ProcessGroup | None = None,
        config: TransferConfig | None = None,
        device: torch.device | str = "cpu",
        plan: Plan | None = None,
        store: dist.Store | SignedStore | None = None,
        standalone: bool = False,
        tag_base: int = 0,
    ) -> None:
        super().__init__(
            src_layout,
            dst_layout,
            proc,
            dst_tensors=tensors,
            procs=procs,
            group=group,
            sync_group=sync_group,
            config=config,
            device=device,
            plan=plan,
            store=store,
            standalone=standalone,
            tag_base=tag_base,
        )

    def pull(self, version: int) -> RunStats:
        """Receive ``version`` into the live tensors (``Peer.run``); committed when it returns."""
        return self.run(version)
