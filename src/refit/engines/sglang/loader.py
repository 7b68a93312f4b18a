"""The SGLang side: refit's custom weight loader, run by SGLang in every TP scheduler process.

Start SGLang with ``custom_weight_loader=[LOADER]`` (``--custom-weight-loader refit.engines.sglang.loader.load``
for ``launch_server``) and ``REFIT_SECRET`` (or ``REFIT_SECRET_FILE``) in its environment. The trainer's
rank 0 then calls ``update_weights_from_tensor([(trigger, tensor)], load_format=LOADER)`` inside
``begin_weight_update()`` / ``end_weight_update()``; SGLang hands the trigger to ``load`` on every TP rank.

What crosses SGLang's own (pickled) channel is only a trigger: its name and an empty tensor.
``refit.init:{json}`` points at the job's rendezvous store (address, port, session, job id: no secret);
every value refit acts on is then read from that store, signed with the job secret from this process's
environment, and the pointer is checked against the signed init document (a pointer to any other store
finds no validly signed document and fails). ``refit.run`` moves the version the trainer signed under
``sglang/run``; ``refit.close`` releases this rank's side.

Lifecycle per TP rank (``RankSide``): init (read the source layout, learn this rank's share of every
tensor from SGLang's live modules, publish it, join the transfer group, build the plan, pre-flight);
run (receive this rank's boxes into shadow copies, vote, commit into the live parameters: ``commit=
"staged"``, so a failed refit leaves SGLang on its last version); close. A share whose live home is strided (the
real columns of a padded row-parallel or expert share, ``regions``) is received into a dense copy of it and copied
into the live parameter after each commit: padding is never written.

``load`` never raises: an exception in a custom loader kills SGLang's scheduler (measured), so a failure
is logged and published in the store instead (``error/{rank}`` at init, the abort channel and
``sglang/stats/{rank}`` at run), where the trainer ranks read it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import fields, replace
from typing import Any

import torch

from refit.config import TransferConfig
from refit.engines.vllm.common import (
    RefitInitInfo,
    gather_dst_layout,
    join_group,
    open_store,
    process_map,
    read_src_layout,
    wait_workers,
)
from refit.errors import ConfigError
from refit.transfer import Peer

from .regions import share

LOADER = "refit.engines.sglang.loader.load"
INIT = "refit.init:"
RUN = "refit.run"
CLOSE = "refit.close"
POINTER_KEYS = ("master_address", "master_port", "session", "job_id")
INIT_KEY = "sglang/init"  # the signed init document (RefitInitInfo's fields but the secret)
RUN_KEY = "sglang/run"  # the signed version of the refit to run now

log = logging.getLogger(__name__)
_SIDES: dict[int, RankSide] = {}  # this scheduler process's side, by id(model)


def transfer_config(info: RefitInitInfo) -> TransferConfig:
    """The config both sides of an SGLang refit run: the init info's, with ``commit="staged"``."""
    return replace(info.transfer_config(), commit="staged")


def trigger_tensor() -> torch.Tensor:
    """The tensor that travels with a trigger name: empty. SGLang's serializer shares a non-empty CPU tensor's
    storage through a file descriptor that only processes of the same family can fetch (a server started
    apart fails on it, and its scheduler dies); an empty one is rebuilt from nothing."""
    return torch.zeros(0)


def init_trigger(info: RefitInitInfo) -> str:
    """The trigger name pointing SGLang's ranks at ``info``'s store (no secret)."""
    return INIT + json.dumps({k: getattr(info, k) for k in POINTER_KEYS}, sort_keys=True)


def init_document(info: RefitInitInfo) -> dict[str, Any]:
    """What trainer rank 0 signs under ``INIT_KEY``: every ``RefitInitInfo`` field but the secret."""
    return {f.name: getattr(info, f.name) for f in fields(RefitInitInfo) if f.name != "secret"}


def parse_pointer(text: str) -> RefitInitInfo:
    """The store pointer of an init trigger, validated (``ConfigError`` naming what is wrong)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"refit init trigger is not JSON: {e}") from None
    if not isinstance(raw, dict) or sorted(raw) != sorted(POINTER_KEYS):
        raise ConfigError(f"refit init trigger must hold exactly {list(POINTER_KEYS)}, got {raw!r:.200}")
    if not isinstance(raw["master_address"], str) or not isinstance(raw["session"], str):
        raise ConfigError("refit init trigger: master_address and session must be text")
    return RefitInitInfo(**raw)  # validates the port and the job id


def read_init(pointer: RefitInitInfo, timeout_s: float):
    """(store, info): the job's store opened at ``pointer`` with this process's secret, and the signed init
    document, which must repeat the pointer (``ConfigError`` otherwise)."""
    store = open_store(pointer, is_master=False)
    doc = store.get(INIT_KEY, timeout_s)
    if not isinstance(doc, dict) or set(doc) != {f.name for f in fields(RefitInitInfo)} - {"secret"}:
        raise ConfigError(f"refit: the signed init document has unexpected fields: {sorted(doc)!r:.300}")
    info = RefitInitInfo(**doc)
    for k in POINTER_KEYS:
        if getattr(info, k) != getattr(pointer, k):
            raise ConfigError(f"refit: init trigger says {k}={getattr(pointer, k)!r}, the signed document {doc[k]!r}")
    return store, info


class RankSide:
    """One SGLang TP rank's side of the refit job (lifecycle in the module docstring).

    ``stats`` (published to the store as ``sglang/stats/{rank}`` after init and every run): ``rank``,
    ``refits``, ``version`` (last committed), ``bytes_received`` (all refits), ``bytes_per_refit`` (the
    plan's bytes for this rank), ``rules`` (tensors per share rule), ``error`` (the last failure or None).
    """

    def __init__(self, model: torch.nn.Module, rank: int, tp_size: int, pointer: RefitInitInfo) -> None:
        store, info = read_init(pointer, pointer.timeout_s)
        self.store, self.info, self.rank = store, info, rank
        self.peer: Peer | None = None
        self.stats: dict[str, Any] = {"rank": rank, "refits": 0, "version": None, "bytes_received": 0, "error": None}
        try:  # nothing has moved yet: a refusal reaches every trainer rank through the store
            if info.n_workers != tp_size:
                raise ConfigError(f"refit init info has n_workers={info.n_workers}, SGLang runs tp_size={tp_size}")
            src = read_src_layout(store, info.timeout_s)
            shares = {t.name: share(model, t.name, t.shape) for t in src}
            for t in src:
                have = shares[t.name].view.dtype
                if have != t.dtype:
                    raise ConfigError(f"{t.name}: SGLang holds {have}, the trainer sends {t.dtype}")
        except Exception as e:
            store.put(f"error/{rank}", f"{type(e).__name__}: {e}")
            raise
        store.put(f"dst/{rank}", {n: [list(x) for x in s.box] for n, s in shares.items()})
        # padded shares whose real part is strided in the live parameter: received densely, copied in after commits
        self.strided = {n: s.view for n, s in shares.items() if not s.view.is_contiguous()}
        self.dense = {n: v.contiguous() for n, v in self.strided.items()}
        wait_workers(store, info.n_workers, info.timeout_s, engine="SGLang")
        self.pg = join_group(info, store, info.n_trainer + rank)
        dst = gather_dst_layout(store, src, info.n_workers, info.timeout_s)
        self.peer = Peer(
            src,
            dst,
            info.n_trainer + rank,
            dst_tensors={n: self.dense.get(n, s.view) for n, s in shares.items()},
            procs=process_map(info, store, info.n_trainer + rank, next(model.parameters()).device),
            group=self.pg,
            config=transfer_config(info),
            device=next(model.parameters()).device,
            store=store,
            standalone=True,
        )
        rules: dict[str, int] = {}
        for s in shares.values():
            rules[s.rule] = rules.get(s.rule, 0) + 1
        self.stats.update(rules=rules, bytes_per_refit=self.peer.executor.bytes_received, strided=sorted(self.strided))
        self.publish()

    def publish(self) -> None:
        self.store.put(f"sglang/stats/{self.rank}", self.stats)

    def run(self) -> None:
        """Move the version the trainer signed under ``RUN_KEY`` (the abort channel tells the trainer of a failure)."""
        t0 = time.perf_counter()
        try:
            version = self.store.get(RUN_KEY, self.info.timeout_s)
            if isinstance(version, bool) or not isinstance(version, int):
                raise ConfigError(f"refit: the signed run version must be an integer, got {version!r}")
            stats = self.peer.run(version)
            for n, live in self.strided.items():
                live.copy_(self.dense[n])
        except Exception as e:
            self.stats["error"] = f"{type(e).__name__}: {e}"
            self.publish()
            raise
        self.stats.update(
            refits=self.stats["refits"] + 1,
            version=version,
            bytes_received=self.stats["bytes_received"] + stats.bytes_received,
            last_bytes=stats.bytes_received,
            transfer_s=time.perf_counter() - t0,
            error=None,
        )
        self.publish()

    def close(self) -> None:
        """Release this rank's Peer, group and store connection (not collective; idempotent)."""
        if self.peer is not None:
            self.peer.close()
        self.peer = self.pg = None


def load(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-loader entry point (``LOADER``): act on one trigger (module docstring); never raises."""
    try:
        if len(named_tensors) != 1:
            raise ValueError(f"refit's loader takes one trigger, got {len(named_tensors)} tensors")
        _act(model, str(named_tensors[0][0]))
    except Exception:  # noqa: BLE001 - raising here would kill SGLang's scheduler; the store carries it
        log.exception("refit: the SGLang weight loader failed (SGLang keeps its last weights)")


def _act(model: torch.nn.Module, name: str) -> None:
    key = id(model)
    if name.startswith(INIT):
        from sglang.srt.runtime_context import get_parallel  # SGLang's own record of this process's TP rank

        if key in _SIDES:
            _SIDES.pop(key).close()
        parallel = get_parallel()
        _SIDES[key] = RankSide(model, parallel.tp_rank, parallel.tp_size, parse_pointer(name[len(INIT) :]))
    elif name == RUN:
        if key not in _SIDES:
            raise RuntimeError("refit: a run trigger before the init trigger")
        _SIDES[key].run()
    elif name == CLOSE:
        side = _SIDES.pop(key, None)
        if side is not None:
            side.close()
    else:
        raise ValueError(f"refit's loader does not know the trigger {name[:80]!r}")
