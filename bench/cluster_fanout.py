"""Fan-out to 3 replicas on 3 other hosts against one model copy over one link (needs root and iproute2).

    sudo .venv/bin/python -m bench.cluster_fanout --rate 1gbit --refits 5

Four hosts, each link shaped to ``--rate`` both ways: trainer ``--src`` (default fsdp=2) on host a, one tp=1 replica
on each of hosts b, c and d, the Llama-shaped model of ``bench.cluster_dense`` (about 88 MB, float32). In one job,
one after another: the pipelined relay (``Fanout(relay=1)``, a chain b -> c -> d), the direct plan (``Fanout`` in
waves) and a packed gloo broadcast of the model from trainer rank 0. Each refit's time is the slowest process's
(every process starts it after a barrier); the first refit of each mode is a warm-up. Prints one JSON object with
each mode's times, median and ratio to one copy of the model over one link, and ``refit.cost``'s prediction for it
on the same cluster (``predictions``; ``--out`` also writes it).

``--profile`` (the relay only): every process times its P2P steps (when each step's wait began and ended, by
wrapping ``P2PSchedule.wait`` in the bench's own rank wrapper, not the library); the last refit is reported per
process: its seconds, steps, seconds in waits, each wait's span from the refit's start, and the seconds
``Fanout.run`` spends before and after the executor's run (the store's votes).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.cluster_dense import llama_config
from refit.cost import Topology, predict
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.cluster import Cluster, LinkShape, parse_rate
from refit.tools.cluster.job import Job, python_argv
from refit.tools.cluster.netns import sh

MODES = ("relay", "waves", "broadcast")
TOPOLOGY = Path(__file__).parent / "topologies" / "cpu-cluster-1gbit.json"


def run(
    rate: str, src: str, replicas: int, refits: int, config: str, chunk_bytes: int | None, profile: bool = False
) -> dict:
    model_bytes = sum(math.prod(s) * 4 for _, s, _ in param_shapes(config))
    hosts = ["a"] + [chr(ord("b") + i) for i in range(replicas)]
    rate_bit = parse_rate(rate)
    n_src = math.prod(int(kv.split("=")[1]) for kv in src.split(","))
    placement = ["a"] * n_src + hosts[1:]
    chunk = ("--chunk-bytes", str(chunk_bytes)) if chunk_bytes else ()
    modes = ("relay",) if profile else MODES
    rank_args = (
        *("--src", src, "--replicas", str(replicas), "--model", config, "--refits", str(refits), *chunk),
        *("--modes", ",".join(modes), "--hosts", ",".join(placement), "--deadline-s", "300"),
    )
    argv = (
        python_argv("bench.cluster_fanout", "--rank", *rank_args)
        if profile
        else python_argv("refit.tools.cluster.fanout_rank", *rank_args)
    )
    with Cluster(hosts, LinkShape(rate_bit)) as cluster:
        results = Job(cluster, placement, argv).wait(1800)
        links = _link_stats(cluster, hosts) if profile else None
    copy_s = model_bytes / (rate_bit / 8)  # one copy of the model over one link
    out = {"rate": rate, "src": src, "replicas": replicas, "model_bytes": model_bytes, "copy_s": round(copy_s, 4)}
    predicted = predictions(config, src, replicas, rate_bit)
    for mode in modes:
        if not all(all(r["modes"][mode]["exact"]) for r in results):
            raise SystemExit(f"{mode}: a refit was not exact: {[r['modes'][mode]['exact'] for r in results]}")
        per_refit = [max(r["modes"][mode]["seconds"][i] for r in results) for i in range(refits)]
        steady = statistics.median(per_refit[1:])
        out[mode] = {
            "refit_s": [round(t, 4) for t in per_refit],
            "median_s": round(steady, 4),
            "vs_copy": round(steady / copy_s, 3),
            "predicted_s": round(predicted[mode], 4),  # refit.cost on this cluster (``predictions``)
            "predicted_vs_measured": round(predicted[mode] / steady, 3),
        }
    if profile:
        out["profile"] = [_summary(r["profile"]) for r in results]
        out["links"] = links
    return out


def predictions(config: str, src: str, replicas: int, rate_bit: int) -> dict[str, float]:
    """``refit.cost``'s seconds for each mode on this cluster: hosts as nodes of ``n_src`` "GPUs" (processes),
    one NIC of the link's rate each (``bench/topologies/cpu-cluster-1gbit.json`` at 1gbit; the same as
    ``refit plan --model CONFIG --src SRC --dst tp=1,dp=R --cluster T.json --relay 1``). The broadcast's
    row models a pipelined ring (NCCL's); gloo's broadcast is none."""
    shapes = param_shapes(config)
    trainer = layout_from_spec(shapes, parse_spec(src, "src"))
    one = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    every = layout_from_spec(shapes, parse_spec(f"tp=1,dp={replicas}", "dst"))
    topo = Topology.from_json(TOPOLOGY)
    topo = replace(topo, nodes=replicas + 1, gpus_per_node=trainer.world_size, nic_gbps=rate_bit / 8e9)
    got = {p.strategy: p.seconds for p in predict(trainer, every, topo, replicas=replicas, replica_dst=one, relay=1)}
    return {"relay": got["relay"], "waves": got["fanout"], "broadcast": got["broadcast"]}


def _link_stats(cluster: Cluster, hosts: list[str]) -> dict:
    """Per host, over the whole job: packets its shaping qdiscs dropped (its NIC's, what it sends; its bridge
    port's, what it receives) and TCP segments it sent again (``/proc/net/snmp``, inside its namespace)."""
    out = {}
    for h in hosts:
        host = cluster.host(h)
        tc = [sh("tc", "-s", "-n", ns, "qdisc", "show", "dev", dev).stdout for ns, dev in _ends(cluster, host)]
        snmp = sh("ip", "netns", "exec", host.netns, "cat", "/proc/net/snmp").stdout.splitlines()
        tcp = [line.split() for line in snmp if line.startswith("Tcp:")]
        out[h] = {
            "dropped_out_in": [sum(int(d) for d in re.findall(r"dropped (\d+)", t)) for t in tc],
            "tcp_retrans": int(dict(zip(tcp[0], tcp[1]))["RetransSegs"]),
        }
    return out


def _ends(cluster: Cluster, host) -> list[tuple[str, str]]:
    return [(host.netns, host.nic), (cluster.hub, host.port)]


# ---------------------------------------------------------------- --profile: inside each rank process
_EVENTS: list[tuple[str, float]] = []


def _rank_main(argv: list[str]) -> None:
    """A rank of ``refit.tools.cluster.fanout_rank`` whose P2P posts and waits are timed (``--profile``)."""
    from refit.executor import Executor
    from refit.fanout import Fanout
    from refit.tools.cluster import fanout_rank
    from refit.transport.p2p import P2PSchedule

    def timed(cls, name: str, tag: str):
        inner = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            _EVENTS.append((tag + "0", time.perf_counter()))
            try:
                return inner(self, *args, **kwargs)
            finally:
                _EVENTS.append((tag + "1", time.perf_counter()))

        setattr(cls, name, wrapper)

    timed(P2PSchedule, "wait", "wait")
    timed(Executor, "run", "run")
    timed(Fanout, "run", "fanout")
    report = fanout_rank.report
    fanout_rank.report = lambda value: report({**value, "profile": _EVENTS})
    fanout_rank.main(argv)


def _summary(events: list[tuple[str, float]]) -> dict:
    """The last refit's steps on one process (the events between its last ``run0`` and ``run1``): when each
    step's wait began and ended, from the refit's start."""
    start = max(i for i, (e, _) in enumerate(events) if e == "fanout0")
    ev = events[start:]
    t0 = next(t for e, t in ev if e == "run0")
    end = next(t for e, t in ev if e == "run1")
    waits = [(a - t0, b - t0) for (e, a), (_, b) in zip(ev, ev[1:]) if e == "wait0"]
    return {
        "run_s": round(end - t0, 4),
        "steps": len(waits),
        "in_waits_s": round(sum(b - a for a, b in waits), 4),
        "fanout_before_s": round(t0 - ev[0][1], 4),  # Fanout.run's work before the executor's and after it
        "fanout_after_s": round(next(t for e, t in ev if e == "fanout1") - end, 4),
        "start": t0,  # perf_counter: one clock for every namespace of the machine
        "waits_ms": [(round(a * 1e3, 1), round(b * 1e3, 1)) for a, b in waits],
    }


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        _rank_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--src", default="fsdp=2")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk-bytes", type=int, default=None, help="the relay's chunk (default: the model / 64)")
    ap.add_argument("--profile", action="store_true", help="the relay only, its P2P steps timed per process")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(llama_config(a.layers)))
        row = run(a.rate, a.src, a.replicas, a.refits, str(config), a.chunk_bytes, a.profile)
    print(json.dumps(row))
    if a.out:
        Path(a.out).write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
