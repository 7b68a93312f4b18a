"""One process of a refit across cluster hosts that the test steers round by round, for faults and strangers.

``python fault_rank.py SYNC_DIR [FIRST_ROUND]``, started by ``Job`` (trainer fsdp=2 as processes 0-1, engine
tp=1,dp=2 as processes 2-3; tiny-llama, float32, staged commit). Round ``k`` begins when the test writes
``SYNC_DIR/round.<k>`` (JSON):

* ``name``, ``deadline_s``: the Peer's ``config.name`` and deadline; a Peer is built for the first round, after
  an aborted refit, and whenever ``name`` changes, on a fresh gloo group of its own made through the job's store
  (``store.gloo_group``, not the default group): a process started later in a dead one's place (with its rank and
  ``FIRST_ROUND``, joining the store only) joins the next Peer beside the survivors;
* ``versions``: the versions to refit, in turn (a failure ends the round);
* ``hold``: ``[process, version]`` or null: that process stops half way through that version's steps, writes
  ``held.<k>`` and goes on once ``go.<k>`` appears (the test cuts a link, or kills a host, meanwhile);
* ``exit``: true ends the process.

After each round every process writes ``result.<k>.<rank>`` (JSON): per version its error (None: committed),
seconds, the version committed here, its pid and, on an engine, which seed its live tensors hold bit for bit. SIGUSR1
writes every thread's stack to ``stacks.<rank>`` (where a process hangs).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.cluster.job import RANK_ENV, STORE_ENV, WORLD_ENV, join_from_env
from refit.tools.verify import holds, reference_shards
from refit.transfer import Peer
from refit.transport import authstore
from refit.transport.store import bind_address, gloo_group, open_store, pin_interfaces

N_SRC, N_DST = 2, 2
GROUP_TIMEOUT_S = 60.0  # a gloo wait the deadline abandoned ends by then


def _await(path: Path, timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.05)


def _write(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # readers never see half a file


class Rank:
    """This process's tensors and its current Peer."""

    def __init__(self, rank: int, store) -> None:
        shapes = [(n, s, torch.float32) for n, s, _ in param_shapes("tiny-llama")]
        self.src = layout_from_spec(shapes, parse_spec("fsdp=2", "src"))
        self.dst = layout_from_spec(shapes, parse_spec("tp=1,dp=2", "dst"))
        self.rank, self.store, self.peer = rank, store, None
        self.groups: list = []  # every group made, kept: one an aborted refit left operations on is never freed
        self.last: int | None = None  # the last version committed here, by any of this process's Peers
        self.is_src = rank < N_SRC
        if self.is_src:
            self.tensors = reference_shards(self.src, rank, seed=0)
        else:
            shards = reference_shards(self.dst, rank - N_SRC)
            self.tensors = {n: torch.full_like(t, float("nan")) for n, t in shards.items()}

    def build(self, name: str, deadline_s: float) -> None:
        """A new Peer on a fresh gloo group (a failed refit may have left operations on the old one), made
        through the store under ``name``: every process of the round joins it, a replacement included."""
        if self.peer is not None:
            self.peer.close()
        where = dist.PrefixStore(f"fault/{name}", self.store)
        group = gloo_group(where, self.rank, N_SRC + N_DST, GROUP_TIMEOUT_S, bind_address())
        self.groups.append(group)
        procs = ProcessMap.disjoint(N_SRC, N_DST)
        config = TransferConfig(
            name=name, commit="staged", deadline_s=deadline_s, buffer_bytes=64 << 10, preflight_timeout_s=60.0
        )
        kw = {"src_tensors": self.tensors} if self.is_src else {"dst_tensors": self.tensors}
        self.peer = Peer(
            self.src,
            self.dst,
            self.rank,
            procs=procs,
            group=group,
            config=config,
            store=self.store,
            standalone=True,
            **kw,
        )

    def held_seed(self) -> int | None:
        """The seed (= version) the live engine tensors hold bit for bit, or None (mixed / none)."""
        if self.is_src:
            return None
        last = self.last
        for seed in {last, last - 1 if last else None, last + 1 if last else None} - {None}:
            if holds(self.tensors, self.dst, self.rank - N_SRC, seed=seed):
                return seed
        return None

    def refit(self, version: int, hold: list | None, sync: Path, k: int) -> dict:
        if self.is_src:
            for n, t in reference_shards(self.src, self.rank, seed=version).items():
                self.tensors[n].copy_(t)
        steps = self.peer.executor.steps
        middle = steps[len(steps) // 2] if steps else None

        def hook(where: str, info: dict) -> None:
            if where == "step" and info["step"] is middle:
                (sync / f"held.{k}").touch()
                _await(sync / f"go.{k}")

        mine = hold is not None and hold[0] == self.rank and hold[1] == version
        error, t0 = None, time.monotonic()
        try:
            self.peer.run(version, fault_hook=hook if mine else None)
        except Exception as e:  # noqa: BLE001 - the result to report
            error = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - t0
        if self.peer.version is not None:
            self.last = self.peer.version
        rejected = sum(self.peer.store.rejected.values()) if self.peer.store is not None else 0
        return {
            "version": version,
            "error": error,
            "seconds": elapsed,
            "committed": self.last,
            "holds": self.held_seed(),
            "rejected": rejected,
            "pid": os.getpid(),
        }


def _replacement_join() -> tuple[int, object]:
    """A process started in a dead one's place: the job's store only (the default group's world is gone)."""
    rank = int(os.environ[RANK_ENV])
    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    pin_interfaces(bind_address())
    return rank, open_store(host, int(port), int(os.environ[WORLD_ENV]), False, 120.0)


def main() -> None:
    sync = Path(sys.argv[1])
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    torch.set_num_threads(1)
    if k:  # a replacement, from round k on
        rank, store = _replacement_join()
    else:
        rank, _, store = join_from_env(timeout_s=120.0)
    faulthandler.register(signal.SIGUSR1, file=open(sync / f"stacks.{rank}", "w"), all_threads=True)  # noqa: SIM115
    me = Rank(rank, store)
    while True:
        _await(sync / f"round.{k}", 600.0)
        spec = json.loads((sync / f"round.{k}").read_text())
        if spec.get("exit"):
            break
        if me.peer is None or me.peer.broken is not None or me.peer.config.name != spec["name"]:
            me.build(spec["name"], spec["deadline_s"])
        rows = []
        for v in spec["versions"]:
            rows.append(me.refit(v, spec.get("hold"), sync, k))
            if rows[-1]["error"] is not None:
                break
        _write(sync / f"result.{k}.{rank}", rows)
        k += 1
    me.peer.close()
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    _write(sync / f"exited.{rank}", [ru.ru_utime, ru.ru_stime])
    authstore.leave()  # what exit does (os._exit skips it): process 0 serves the store until the others left
    os._exit(0)  # the default group's teardown waits on peers a fault may have removed


if __name__ == "__main__":
    main()
