"""Fan-out: a refit to R engine replicas in waves, replicas that already hold the exact version
becoming sources for the next wave.

Schedule: the trainer ranks are sources in every wave; each wave adds as many receivers as
there are holders (the trainer counting as one), so holders double per wave: 1 -> 7 replicas
takes 3 waves instead of 7 sends from the trainer. Each wave's source plan is refit's own
planner over the holders: a tensor box held by several holders goes to the least-loaded one,
ties spread by the receiver's index, so receivers spread over sources and bytes balance. A
wave's plan is a function of (layouts, schedule, processes known dead), the same on every
process; ``wave_plans(...)`` returns it as JSON-serializable data.

Versions: a replica commits the version (``<name>/holds/<proc>`` in the store) only when its
wave has finished everywhere; before a wave runs, every participant checks that each of its
sources holds exactly the version being sent (``FanoutError`` otherwise, naming the process and
both versions). No replica pulls from a replica on another version.

Relay (``Fanout(relay=d)``): one wave instead, a pipelined relay down a chain or tree of replicas
(``refit.fanout_relay``): the trainer host's uplink carries one copy however many replicas follow.

Failures: every wave ends with a status from each participant; the coordinator (the first
trainer process) waits for them up to ``deadline_s`` and publishes the outcome. A participant
that posted nothing is dead; if anyone died or failed, the survivors re-plan the wave without
the dead (its receivers onto the remaining holders) and run it again with a fresh Peer. A
receiver that died simply has no version; later waves plan without it. The trainer must
survive (it hosts the store). Every wave runs on one group (``group``, by default the default
group); an attempt after a failure uses a fresh P2P tag range, so a failed attempt's leftover
receives can never match its sends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from refit.commit import StagedCommit
from refit.config import TransferConfig
from refit.delta.served import Received
from refit.errors import FanoutError, RefitAborted
from refit.fanout_join import JOIN, agree_join
from refit.fanout_relay import check_relay_config, chunk_bytes_for, relay_plan
from refit.fanout_waves import Wave, build_wave, wave_schedule, waves_for
from refit.layout import ModelLayout
from refit.plan import Plan, build_plan
from refit.transfer import Peer, agree_scope
from refit.transport.store import SignedStore, signed


def relay_waves(
    trainer: ModelLayout,
    replica: ModelLayout,
    trainer_procs: list[int],
    replica_procs: list[list[int]],
    config: TransferConfig,
    degree: int = 1,
    dead: frozenset[int] = frozenset(),
    devices: Sequence[str] | None = None,
) -> list[Wave]:
    """A relay (``refit.fanout_relay``) as one wave to every replica without a dead process, in a tree of
    ``degree`` (1: a chain); ``config.buffer_bytes`` is its chunk. Its relays are not ``sources`` (they
    receive the version in the same wave); empty when every replica is dead."""
    alive = [j for j in range(len(replica_procs)) if not set(replica_procs[j]) & dead]
    if not alive:
        return []
    plan = relay_plan(trainer, replica, trainer_procs, replica_procs, alive, config, degree, devices)
    return [Wave(0, tuple(alive), (), plan.src_layout, plan.dst_layout, plan.procs, plan)]


def wave_plans(
    waves: list[Wave], plans: Mapping[int, Plan] | None = None, config: TransferConfig | None = None
) -> list[dict[str, Any]]:
    """JSON-serializable: per wave, receiver process -> source process -> tensor boxes."""
    out = []
    for w in waves:
        plan = (plans or {}).get(w.index) or w.plan or build_plan(w.src_layout, w.dst_layout, w.procs, config)
        links: dict[str, dict[str, list]] = {}
        for m in plan.messages:
            row = links.setdefault(str(w.procs.dst[m.dst]), {})
            row.setdefault(str(w.procs.src[m.src]), []).extend([p.tensor, [list(x) for x in p.box]] for p in m.pieces)
        for p in plan.local:
            row = links.setdefault(str(w.procs.dst[p.dst]), {})
            row.setdefault(str(w.procs.src[p.src]), []).append([p.tensor, [list(x) for x in p.box]])
        out.append(
            {"wave": w.index, "receivers": list(w.receivers), "sources": ["trainer", *w.sources], "links": links}
        )
    return out


@dataclass
class FanoutStats:
    """What one ``Fanout.run`` did on this process.

    ``waves``: waves it took part in that succeeded; ``attempts``: wave attempts it ran
    (retries included); ``dead``: processes known dead when it returned, sorted; ``seconds``:
    its wall time here; ``sources_seen``: per source replica process checked before an
    attempt, (wave, attempt, process, the version the store says it holds).
    """

    waves: int = 0
    attempts: int = 0
    dead: list[int] = field(default_factory=list)
    seconds: float = 0.0
    sources_seen: list[tuple[int, int, int, int]] = field(
        default_factory=list
    )  # (wave, attempt, source proc, its version)
    joined: list[int] = field(default_factory=list)  # late replicas that read the previous version from peers


class Fanout:
    """One process's part of a fan-out refit (the module docstring: schedule, versions, failures).

    ``tensors``: the trainer rank's shards (on a trainer process) or the replica rank's live
    tensors (on an engine process); the caller's, written in place on a receiver. ``trainer``
    / ``replica``: the trainer's layout and one replica's; ``trainer_procs[r]`` /
    ``replica_procs[j][r]``: the global process of each rank (``ValueError`` naming the counts
    when they do not match the layouts' world sizes). The first trainer process coordinates.

    Owns: one ``Peer`` per wave this process is a member of (rebuilt when the known-dead set
    changes, and under a new name and P2P tag range after a failed attempt), the processes it
    knows are dead, and ``version``: the last version this process committed (None before the
    first).

    Lifecycle: construct on every process at once (collective: each wave's Peer runs its
    pre-flight through ``store``, in wave order, for up to ``config.preflight_timeout_s``);
    ``run(version)`` on every process once per refit, with increasing versions; ``close()``.

    Must agree on every process: ``trainer``, ``replica``, ``trainer_procs``,
    ``replica_procs``, ``config`` (its ``name`` prefixes every store key, ``deadline_s`` bounds
    every wait), ``max_attempts``, ``devices``, ``group``, the ``store`` itself (hosted by a
    process that must outlive the refit) and each ``run``'s ``version``. Per process: ``proc``,
    ``tensors``, ``device``.

    Versions: a receiver commits a version when its wave's outcome is ok (the coordinator, before
    publishing that outcome, sets ``<config.name>/holds/<proc>``), a trainer process when ``run`` returns. A wave
    attempt starts only if every source replica process holds exactly the version being sent
    (``FanoutError`` otherwise). ``FanoutError`` also ends the refit when a trainer process dies,
    a wave fails ``max_attempts`` times, or a store wait runs out.

    Between calls: a trainer updates its tensors in place. ``hook`` (tests, fault injection):
    None, or ``hook(wave index, attempt)``, called on this process before each wave attempt.

    Relay (``relay=d`` >= 1): one wave to every replica, a pipelined relay down a tree where replica ``i``
    receives from replica ``(i - 1) // d`` (1: a chain), in chunks of ``relay_chunk_bytes`` (default: the
    model / 64); ``refit.fanout_relay``. P2P on CPU only, no delta (``ConfigError`` otherwise).

    On GPUs: ``devices`` (every global process's device), ``device`` (this process's),
    ``group`` (the NCCL group P2P links use; default: the default group) and
    ``config.transport`` (``"auto"``: CUDA IPC between processes of one host).
    """

    def __init__(
        self,
        trainer: ModelLayout,
        replica: ModelLayout,
        proc: int,
        trainer_procs: list[int],
        replica_procs: list[list[int]],
        tensors: Mapping[str, torch.Tensor],
        *,
        store: dist.Store | SignedStore | None = None,
        config: TransferConfig = TransferConfig(name="fanout"),
        max_attempts: int = 3,
        devices: Sequence[str] | None = None,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        relay: int = 0,
        relay_chunk_bytes: int | None = None,
    ) -> None:
        if relay:
            check_relay_config(config, devices)
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        store = signed(store)  # every value tagged with the job secret; forged ones are ignored
        if any(len(p) != replica.world_size for p in replica_procs):
            raise ValueError(
                f"Fanout: every replica needs {replica.world_size} processes, got {[len(p) for p in replica_procs]}"
            )
        if len(trainer_procs) != trainer.world_size:
            raise ValueError(f"Fanout: {len(trainer_procs)} trainer processes for {trainer.world_size} trainer ranks")
        everyone = [*trainer_procs, *(p for ps in replica_procs for p in ps)]
        if devices is not None and len(devices) <= max(everyone):
            raise ValueError(f"Fanout: devices names {len(devices)} processes; process ids go up to {max(everyone)}")
        self.devices, self.device, self.group = (tuple(devices) if devices is not None else None), device, group
        self.trainer, self.replica, self.proc = trainer, replica, proc
        self.trainer_procs, self.replica_procs = list(trainer_procs), [list(p) for p in replica_procs]
        if store is not None:  # fleet decisions in a scope of every process's fresh nonce: no replay commits
            store = agree_scope(store, f"{config.name}/fleet", proc, sorted(everyone), config.preflight_timeout_s)
        self.store, self.config, self.max_attempts = store, config, max_attempts
        # fleet commit (config "staged"): replicas receive into a shadow (waves move it, replica
        # sources serve from it); every replica makes it live in one commit step, or none does
        self.fleet = config.staged
        is_replica = proc not in self.trainer_procs
        self.buffers = (
            StagedCommit(tensors, keep_previous=config.keep_previous, budget=config.commit_budget_bytes)
            if self.fleet and is_replica
            else None
        )
        self.tensors = dict(self.buffers.shadow) if self.buffers is not None else dict(tensors)
        self.wave_config = (
            replace(config, commit="in_place", keep_previous=False, commit_budget_bytes=None) if self.fleet else config
        )
        self.relay = relay
        if relay:  # the chunk is the relay's message size; a step holds one send and one receive
            chunk = relay_chunk_bytes or chunk_bytes_for(replica.nbytes, config)
            self.wave_config = replace(self.wave_config, buffer_bytes=chunk, num_buffers=max(2, config.num_buffers))
        self.staged_version: int | None = None
        self._got: int | None = None  # the last version this process received in a wave
        self.coordinator = self.trainer_procs[0]
        self.dead: frozenset[int] = frozenset()
        self.version: int | None = None
        self.stale = False  # a replica process whose tensors no longer hold ``version`` (``invalidate``)
        self.hook = None  # tests: called with (wave index, attempt) before this process runs a wave
        self.fault_hook = None  # tests: the executor's fault hook (``Peer.run``) for every wave attempt here
        n = len(self.replica_procs)
        self.schedule = [list(range(n))] if relay else wave_schedule(n)
        self.waves = self._plan_waves()
        # topology work once: a Peer (and its process group) per wave this process is in
        self.failures: dict[int, int] = {}  # wave -> failed attempts so far (every member counts the same)
        # NIXL deltas: a replica notes what it receives and serves the same deltas in later waves (no base)
        self.received = Received() if is_replica else None
        self.peers: dict[int, tuple[tuple, Peer]] = {}
        for w in self.waves:
            if proc in w.members:
                self._peer_for(w)

    def invalidate(self) -> None:
        """A replica process: its tensors no longer hold its version (its engine reloaded them). With deltas, the
        next ``run`` first reads the previous version dense from its peer replicas (a join wave:
        ``refit.fanout_join``), then the delta in its wave; without deltas its wave sends it dense as always."""
        self.stale = True
        for peer in self._receiving():
            peer.invalidate()

    def _alive(self) -> list[int]:
        """Every process not known dead, trainer processes first."""
        return [p for p in [*self.trainer_procs, *(p for ps in self.replica_procs for p in ps)] if p not in self.dead]

    def _receiving(self) -> list[Peer]:
        """This process's Peers of the waves it receives in."""
        return [self.peers[w.index][1] for w in self.waves if self.proc in w.procs.dst and w.index in self.peers]

    def close(self) -> None:
        """Close every wave's Peer (helper threads, shared-memory barriers); tensors stay."""
        for _, peer in self.peers.values():
            peer.close()
        self.peers.clear()

    # -- helpers ---------------------------------------------------------------------------
    def _peer(self, wave: Wave) -> Peer:
        """This process's Peer for ``wave`` on ``self.group``; its name and P2P tag range
        depend on how many attempts of this wave failed so far (the same count on every member),
        so a failed attempt's leftover receives never match a later attempt's sends."""
        n = self.failures.get(wave.index, 0)
        src_t = self.tensors if self.proc in wave.procs.src else None
        dst_t = self.tensors if self.proc in wave.procs.dst else None
        cfg = replace(self.wave_config, name=f"{self.config.name}/w{wave.index}/f{n}")
        cfg = replace(cfg, delta="off") if wave.index == JOIN else cfg  # a join moves the previous version whole
        tag_base = ((1 + wave.index + 64 * n) % 1000) << 21
        return Peer(
            wave.src_layout,
            wave.dst_layout,
            self.proc,
            plan=wave.plan,
            src_tensors=src_t,
            dst_tensors=dst_t,
            procs=wave.procs,
            config=cfg,
            store=self.store,
            tag_base=tag_base,
            group=self.group,
            device=self.device,
        )

    def _peer_for(self, wave: Wave) -> Peer:
        key = (self.dead, self.failures.get(wave.index, 0), wave.receivers, wave.sources)
        built, peer = self.peers.get(wave.index, (None, None))
        if peer is not None and built == key and peer.broken is None:
            return peer
        if peer is not None:
            peer.close()
        peer = self._peer(wave)
        link = peer.executor.nixl
        if self.received is not None and link is not None and link.delta is not None:
            link.delta.serve_received(self.received, self.proc in wave.procs.src)
        self.peers[wave.index] = (key, peer)
        return peer

    def _key(self, version: int, wave: int, what: str) -> str:
        return f"{self.config.name}/fanout/v{version}/w{wave}/{what}"

    def _get(self, key: str, timeout_s: float) -> Any:
        try:
            return self.store.get(key, timeout_s)
        except (TimeoutError, RuntimeError, OSError) as e:  # no valid value in time, or the store is gone
            raise FanoutError(f"fan-out: process {self.proc} waited {timeout_s:.0f}s for {key} ({e})") from e

    def _check_sources(self, wave: Wave, version: int, attempt: int, stats: FanoutStats) -> None:
        for j in wave.sources:
            for p in self.replica_procs[j]:
                got = self._holds(p, version)
                stats.sources_seen.append((wave.index, attempt, p, got))
                if got != version:
                    raise FanoutError(
                        f"fan-out wave {wave.index}: source process {p} (replica {j}) holds version "
                        f"{got}, not {version}; refusing to pull from it"
                    )

    def _holds(self, p: int, version: int) -> int:
        """The version process ``p`` holds, waiting (up to the deadline) for it to be ``version``: a value
        replayed from an earlier version only delays the check, the last one read is returned."""
        key, deadline = f"{self.config.name}/holds/{p}", time.monotonic() + self.config.deadline_s
        got = _as_int(self._get(key, self.config.deadline_s))
        while got != version and time.monotonic() < deadline:
            time.sleep(0.01)
            got = _as_int(self._get(key, max(deadline - time.monotonic(), 0.01)))
        return got

    def _current(self, index: int) -> Wave | None:
        return next((w for w in self.waves if w.index == index), None)

    def _takes_part(self, wave: Wave | None) -> bool:
        return wave is not None and self.proc in wave.members

    # -- one refit -------------------------------------------------------------------------
    def run(self, version: int) -> FanoutStats:
        """Every process calls it with the same ``version`` (``ValueError`` unless it exceeds
        this process's last committed one); returns once this process's waves are done (a
        trainer process's: every wave). Fleet commit (``config.commit="staged"``): ``stage`` then
        ``commit``."""
        if self.fleet:
            stats = self.stage(version)
            self.commit()
            return stats
        stats = self._waves(version)
        if self.proc in self.trainer_procs or self._got == version:
            self.version = version
        return stats

    def stage(self, version: int) -> FanoutStats:
        """Fleet commit, part one (``config.commit="staged"``): the waves move ``version`` into every
        replica's shadow (the live tensors untouched: engines keep serving v-1), then the fleet
        decides: the coordinator collects every live process's "all of v is here" and publishes one
        decision. Returns when the fleet will commit; raises ``FanoutError`` on every process when it
        will not (a replica died, a wave failed, a process was silent past ``deadline_s``), and then
        no replica commits. ``commit()`` makes it live."""
        if not self.fleet:
            raise FanoutError("Fanout.stage needs TransferConfig(commit='staged') (fleet commit)")
        self.staged_version = None
        members = self._alive()
        try:
            stats = self._waves(version)
            status = "ok" if self.proc in self.trainer_procs or self._got == version else "not received"
        except (FanoutError, RefitAborted, RuntimeError, OSError) as e:
            stats, status = None, f"failed: {type(e).__name__}: {str(e)[:300]}"
        self.store.put(self._key(version, 0, f"fleet/staged/{self.proc}"), status)
        decision = self._fleet_decision(version, members)
        if not decision["commit"]:
            raise FanoutError(
                f"fleet commit of version {version} refused, every replica stays on its version: {decision['why']}"
            )
        if stats is None:  # cannot happen: a failed process posts a failure, and the fleet refuses
            raise FanoutError(f"fan-out: process {self.proc} failed version {version} but the fleet committed")
        self.staged_version = version
        return stats

    def commit(self, pause=None, resume=None) -> float:
        """Fleet commit, part two: make the staged version live here (``pause()``, shadow -> live,
        ``resume()``: the engine's hooks) and return the copy's seconds (0 on a trainer process).
        Every replica commits the same version in this step (the decision was one for the fleet)."""
        version = self.staged_version
        if version is None:
            raise FanoutError("Fanout.commit(): no staged version (stage(v) first; a refused stage leaves none)")
        seconds = self.buffers.commit(version, pause, resume) if self.buffers is not None else 0.0
        self.version, self.staged_version = version, None
        return seconds

    def rollback(self, pause=None, resume=None) -> None:
        """Restore, on this replica process, the version before the last fleet commit (needs
        ``config.keep_previous``; ``StagedCommit.rollback``), without the trainer. Call it on every
        replica process; a trainer process has nothing to restore (``FanoutError``)."""
        if self.buffers is None:
            raise FanoutError(
                "Fanout.rollback(): only replica processes of a fleet commit (commit='staged', keep_previous) hold v-1"
            )
        self.version = self.buffers.rollback(pause, resume)

    def _fleet_decision(self, version: int, members: list[int]) -> dict[str, Any]:
        """The coordinator waits up to ``deadline_s`` for every member's staged status and publishes
        ``{"commit", "why"}``; every process returns it."""
        key = self._key(version, 0, "fleet/decision")
        wait_s = 4 * self.config.deadline_s * self.max_attempts
        if self.proc != self.coordinator:
            got = self._get(key, wait_s)
            if not isinstance(got, dict) or not isinstance(got.get("commit"), bool):
                raise FanoutError(f"fan-out: the fleet decision under {key!r} is not a decision record")
            return got
        keys = {m: self._key(version, 0, f"fleet/staged/{m}") for m in members}
        posted = self.store.wait_all(keys.values(), self.config.deadline_s)
        bad = {m: str(posted.get(k, "silent (dead?)")) for m, k in keys.items() if posted.get(k) != "ok"}
        why = "; ".join(f"process {m}: {st}" for m, st in sorted(bad.items())) or "all staged"
        decision = {"commit": not bad, "why": why}
        self.store.put(key, decision)
        return decision

    def _waves(self, version: int) -> FanoutStats:
        if self.version is not None and version <= self.version:
            raise ValueError(f"version must increase: got {version} after {self.version}")
        t0, stats = time.perf_counter(), FanoutStats()
        wait_s = 4 * self.config.deadline_s * self.max_attempts
        if self.wave_config.deltas and not self.relay:
            self._join(version, stats)
        for k in range(len(self.schedule)):
            if self.proc == self.coordinator:
                wave = self._current(k)
                if wave is None:  # every receiver of this wave is dead
                    self.store.put(self._key(version, k, "final"), sorted(self.dead))
                    continue
            else:
                if not self._takes_part(self._current(k)):
                    continue
                if k > 0:  # the wave before must be over: learn who died in it
                    self._learn(_int_list(self._get(self._key(version, k - 1, "final"), wait_s)))
                wave = self._current(k)
                if not self._takes_part(wave):
                    continue
            self._run_wave(wave, version, stats)  # type: ignore[arg-type]
        stats.seconds, stats.dead = time.perf_counter() - t0, sorted(self.dead)
        return stats

    def _run_wave(self, wave: Wave, version: int, stats: FanoutStats) -> None:
        k, why = wave.index, None
        for attempt in range(self.max_attempts):
            stats.attempts += 1
            status = "ok"
            try:
                if self.hook is not None:
                    self.hook(k, attempt)
                self._check_sources(wave, version, attempt, stats)
                self._peer_for(wave).run(version, fault_hook=self.fault_hook)
            except FanoutError:
                raise
            except (RefitAborted, RuntimeError, OSError) as e:
                status = f"failed: {type(e).__name__}: {str(e)[:300]}"
            self.store.put(self._key(version, k, f"a{attempt}/status/{self.proc}"), status)
            outcome = self._outcome(wave, version, attempt)
            why = outcome.get("why")
            self._learn(outcome["dead"])
            if not outcome["ok"]:
                self.failures[k] = self.failures.get(k, 0) + 1
            if outcome["ok"]:
                if self.proc in wave.procs.dst:
                    self._got, self.stale = version, False
                stats.waves += 1
                return
            nxt = self._current(k)  # re-planned without the dead
            if self.proc == self.coordinator and nxt is None:
                self.store.put(self._key(version, k, "final"), sorted(self.dead))
            if not self._takes_part(nxt):
                return
            wave = nxt  # type: ignore[assignment]
        raise FanoutError(
            f"fan-out wave {k} of version {version} failed {self.max_attempts} times "
            f"(dead processes: {sorted(self.dead)}; last attempt: {_first_why(why)})"
        )

    def _join(self, version: int, stats: FanoutStats) -> None:
        """Before ``version``'s waves: agree on a join (``refit.fanout_join``) and, where there is one, its members
        run it (one attempt: where it fails the late replicas read dense from their wave's sources) and the
        coordinator publishes its outcome; a late replica that read it holds the previous version again."""
        members = self._alive()
        if self.proc not in members:
            return
        mine, key = None if self.stale else self.version, self._key(version, JOIN, "agree")
        args = (members, self.replica_procs, self.dead, self.config.deadline_s)
        late, sources, prev = agree_join(self.store, key, self.proc, mine, *args)
        if not late:
            return
        wave = build_wave(JOIN, late, sources, None, self.replica, [], self.replica_procs, self.devices)
        if self.proc in wave.members:
            status = "ok"
            try:
                self._check_sources(wave, prev, 0, stats)
                self._peer_for(wave).run(version)
            except (FanoutError, RefitAborted, RuntimeError, OSError) as e:
                status = f"failed: {type(e).__name__}: {str(e)[:300]}"
            self.store.put(self._key(version, JOIN, f"a0/status/{self.proc}"), status)
        elif self.proc != self.coordinator:
            return
        outcome = self._outcome(wave, version, 0, commit=False)
        self._learn(outcome["dead"])
        stats.joined = list(late) if outcome["ok"] else []
        if outcome["ok"] and self.proc in wave.procs.dst:  # it holds ``prev`` again: the delta to ``version`` next
            self.stale = False
            for peer in self._receiving():
                if peer.version == prev:
                    peer.stale = False

    def _outcome(self, wave: Wave, version: int, attempt: int, commit: bool = True) -> dict[str, Any]:
        """The coordinator collects every member's status (a member silent past the deadline is
        dead), commits the receivers' version when all is well (and ``commit``: not a join's), and publishes
        the outcome."""
        key = self._key(version, wave.index, f"a{attempt}/outcome")
        if self.proc != self.coordinator:
            return _outcome_record(self._get(key, 3 * self.config.deadline_s), key)
        keys = {m: self._key(version, wave.index, f"a{attempt}/status/{m}") for m in wave.members}
        # until every member has posted a validly tagged status, or the deadline: a key that merely
        # exists (a stranger's value) neither ends the wait nor counts as a status
        posted = self.store.wait_all(keys.values(), self.config.deadline_s)
        status = {m: str(posted[k]) for m, k in keys.items() if k in posted}
        dead = sorted(set(wave.members) - set(status))
        failed = sorted(m for m, st in status.items() if st != "ok")
        out = {
            "ok": not dead and not failed,
            "dead": dead,
            "failed": failed,
            "why": {str(m): status[m] for m in failed},
        }
        if out["ok"] and commit:  # the receivers hold the version: they may serve the next waves
            for p in wave.procs.dst:
                self.store.put(f"{self.config.name}/holds/{p}", version)
        self.store.put(key, out)
        if out["ok"]:
            self.store.put(self._key(version, wave.index, "final"), sorted(self.dead | set(dead)))
        return out

    def _learn(self, dead: list[int]) -> None:
        new = frozenset(dead) - self.dead
        if not new:
            return
        if new & set(self.trainer_procs):
            raise FanoutError(
                f"fan-out: trainer process(es) {sorted(new & set(self.trainer_procs))} died; the refit cannot complete"
            )
        self.dead |= new
        self.waves = self._plan_waves()

    def _plan_waves(self) -> list[Wave]:
        """The waves without the processes known dead: doubling waves, or one relay wave (``relay``)."""
        if self.relay:
            args = (self.wave_config, self.relay, self.dead, self.devices)
            return relay_waves(self.trainer, self.replica, self.trainer_procs, self.replica_procs, *args)
        return waves_for(self.trainer, self.replica, self.trainer_procs, self.replica_procs, self.dead, self.devices)


def _first_why(why: Any) -> str:
    """The first failing process's status of an outcome record's ``why``, shortened (or "no status")."""
    if not isinstance(why, dict) or not why:
        return "no status"
    proc = min(why, key=lambda p: int(p) if str(p).isdigit() else 0)
    return f"process {proc}: {str(why[proc])[:200]}"


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FanoutError(f"fan-out: a version record holds {value!r}, not a version number")
    return value


def _int_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise FanoutError(f"fan-out: a wave record holds {type(value).__name__}, not a list of processes")
    return [_as_int(v) for v in value]


def _outcome_record(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not {"ok", "dead"} <= set(value):
        raise FanoutError(f"fan-out: the outcome under {key!r} is not an outcome record")
    return {**value, "dead": _int_list(value["dead"])}
