"""Refits into an EPLB engine whose expert map changes between refits: one plan per map, cached by its digest.

``EplbPeer(src, dst, proc, ...)`` takes the logical layouts (trainer, engine: ``layout.eplb``'s module docstring) and
this process's tensors: the trainer's logical shards, the engine's physical expert tensors (``[P / ep, ...]``) and
every other tensor. ``run(version, expert_map)`` moves one version into the slots ``expert_map`` places: the first
refit under a map builds its ``Peer`` (slot layouts, plan, bound views, pre-flight, the executor's setup: once per
map); a later refit under a map seen before re-uses that ``Peer`` and only moves bytes. Every process of the refit
passes the same map: pre-flight compares the maps' digests beside the plan's (``Peer(agree=...)``), so a trainer and
an engine that disagree both raise ``PlanError`` naming both digests, before any byte moves.

Each map's ``Peer`` runs under its own store namespace (``config.name`` + ``/map<k>``, ``k`` counting the maps
built, alike on every process); ``max_maps`` bounds the cache (least recently used first out; a staged commit keeps
one shadow of the slots per cached map). Before a ``Peer`` that did not make the last refit here runs again, it is
told so (``Peer.invalidate``: another map's refit rewrote its slots, so a delta refit sends them dense).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.executor import RunStats
from refit.layout import ModelLayout
from refit.layout.eplb import EplbLayouts, ExpertMap, eplb_layouts
from refit.plan import ProcessMap
from refit.transfer import Peer, publish_failure
from refit.transport.control import RefitAborted
from refit.transport.store import SignedStore, signed


class EplbPeer:
    """One process's part in refits into an EPLB engine (module docstring). ``src_tensors``: this process's
    trainer shards of the logical tensors (``None`` on an engine-only process); ``dst_tensors``: its engine tensors,
    stacked experts as physical slots (``EplbLayouts.dst_shapes``); both change in place only between refits (each
    map's views of them are taken once). The other keywords are ``Peer``'s.
    ``plans_built`` counts the maps set up here (a map seen again and still cached builds nothing)."""

    def __init__(
        self,
        src_layout: ModelLayout,
        dst_layout: ModelLayout,
        proc: int,
        *,
        src_tensors: Mapping[str, Any] | None = None,
        dst_tensors: Mapping[str, torch.Tensor] | None = None,
        procs: ProcessMap | None = None,
        group: dist.ProcessGroup | None = None,
        config: TransferConfig | None = None,
        device: torch.device | str = "cpu",
        store: dist.Store | SignedStore | None = None,
        tag_base: int = 0,
        max_maps: int = 8,
    ) -> None:
        config = config if config is not None else TransferConfig()
        if config.keep_previous:
            raise ConfigError("EplbPeer: keep_previous=True is not supported (a rollback cannot cross a map change)")
        if isinstance(max_maps, bool) or not isinstance(max_maps, int) or max_maps < 1:
            raise ConfigError(f"EplbPeer: max_maps must be an integer >= 1, got {max_maps!r}")
        self.src_layout, self.dst_layout, self.proc = src_layout, dst_layout, proc
        self.procs = procs if procs is not None else ProcessMap.disjoint(src_layout.world_size, dst_layout.world_size)
        self.src_tensors, self.dst_tensors = src_tensors, dst_tensors
        self.group, self.config, self.device, self.tag_base, self.max_maps = group, config, device, tag_base, max_maps
        if store is None and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        self.store = signed(store)
        self.peers: OrderedDict[str, Peer] = OrderedDict()  # map digest -> its Peer, least recently used first
        self.layouts: dict[str, EplbLayouts] = {}
        self.plans_built = 0
        self.version: int | None = None
        self.broken: str | None = None
        self._last: Peer | None = None

    def run(self, version: int, expert_map: ExpertMap) -> RunStats:
        """Move ``version`` (greater than the last one here; the same on every process) into the slots of
        ``expert_map`` (the same on every process) and commit it (``Peer.run``). Returns the run's statistics;
        ``self.plan(expert_map)`` is its plan."""
        if self.broken is not None:
            raise RefitAborted(f"this EplbPeer was left unusable by an aborted refit ({self.broken})")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version must increase: got {version} after {self.version}")
        peer = self._peer(expert_map)
        if self._last is not None and peer is not self._last:
            peer.invalidate()  # another map's refit rewrote its slots since it last ran
        try:
            stats = peer.run(version)
        except RefitAborted as e:
            self.broken = str(e)
            raise
        self.version, self._last = version, peer
        return stats

    def plan(self, expert_map: ExpertMap):
        """The plan of a map this process has set up (``KeyError`` otherwise)."""
        return self.peers[expert_map.digest].plan

    def _peer(self, expert_map: ExpertMap) -> Peer:
        if not isinstance(expert_map, ExpertMap):
            raise ConfigError(f"expert_map must be a refit.layout.eplb.ExpertMap, got {type(expert_map).__name__}")
        key = expert_map.digest
        if key in self.peers:
            self.peers.move_to_end(key)
            return self.peers[key]
        config = replace(self.config, name=f"{self.config.name}/map{self.plans_built}")
        self.plans_built += 1  # counted on every attempt, alike on every process: the next map's namespace is fresh
        try:  # a map that does not fit fails here: published, so the peers' pre-flight names it at once
            layouts = eplb_layouts(self.src_layout, self.dst_layout, expert_map)
            src, dst = self._local(layouts)
        except Exception as e:
            publish_failure(self.store, self.proc, e, config.name)
            raise
        peer = Peer(
            layouts.src,
            layouts.dst,
            self.proc,
            src_tensors=src,
            dst_tensors=dst,
            procs=self.procs,
            group=self.group,
            config=config,
            device=self.device,
            store=self.store,
            tag_base=self.tag_base,
            agree={"expert_map": key},
        )
        if len(self.peers) >= self.max_maps:
            _, old = self.peers.popitem(last=False)
            self.layouts = {k: v for k, v in self.layouts.items() if k in self.peers}
            old.close()
        self.peers[key], self.layouts[key] = peer, layouts
        return peer

    def _local(self, layouts: EplbLayouts) -> tuple[dict | None, dict | None]:
        """This process's tensors as the slot plan takes them (``EplbLayouts.src_tensors`` / ``dst_tensors``)."""
        src = dst = None
        if self.proc in self.procs.src and self.src_tensors is not None:
            src = layouts.src_tensors(self.procs.src.index(self.proc), self.src_tensors)
        if self.proc in self.procs.dst and self.dst_tensors is not None:
            dst = layouts.dst_tensors(self.procs.dst.index(self.proc), self.dst_tensors)
        return src, dst

    def close(self) -> None:
        """Close every cached map's ``Peer``."""
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()
        self.layouts.clear()
