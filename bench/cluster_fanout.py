"""Fan-out to 3 replicas on 3 other hosts against one model copy over one link (needs root and iproute2).

    sudo .venv/bin/python -m bench.cluster_fanout --rate 1gbit --refits 5

Four hosts, each link shaped to ``--rate`` both ways: trainer ``--src`` (default fsdp=2) on host a, one tp=1 replica
on each of hosts b, c and d, the Llama-shaped model of ``bench.cluster_dense`` (about 88 MB, float32). In one job,
one after another: the pipelined relay (``Fanout(relay=1)``, a chain b -> c -> d), the direct plan (``Fanout`` in
waves) and a packed gloo broadcast of the model from trainer rank 0. Each refit's time is the slowest process's
(every process starts it after a barrier); the first refit of each mode is a warm-up. Prints one JSON object with
each mode's times, median and ratio to one copy of the model over one link (``--out`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from bench.cluster_dense import llama_config
from refit.layout.models import param_shapes
from refit.tools.cluster import Cluster, LinkShape, parse_rate
from refit.tools.cluster.job import Job, python_argv

MODES = ("relay", "waves", "broadcast")


def run(rate: str, src: str, replicas: int, refits: int, config: str, chunk_bytes: int | None) -> dict:
    model_bytes = sum(math.prod(s) * 4 for _, s, _ in param_shapes(config))
    hosts = ["a"] + [chr(ord("b") + i) for i in range(replicas)]
    rate_bit = parse_rate(rate)
    n_src = math.prod(int(kv.split("=")[1]) for kv in src.split(","))
    placement = ["a"] * n_src + hosts[1:]
    chunk = ("--chunk-bytes", str(chunk_bytes)) if chunk_bytes else ()
    argv = python_argv(
        "refit.tools.cluster.fanout_rank",
        *("--src", src, "--replicas", str(replicas), "--model", config, "--refits", str(refits), *chunk),
        *("--modes", ",".join(MODES), "--hosts", ",".join(placement), "--deadline-s", "300"),
    )
    with Cluster(hosts, LinkShape(rate_bit)) as cluster:
        results = Job(cluster, placement, argv).wait(1800)
    copy_s = model_bytes / (rate_bit / 8)  # one copy of the model over one link
    out = {"rate": rate, "src": src, "replicas": replicas, "model_bytes": model_bytes, "copy_s": round(copy_s, 4)}
    for mode in MODES:
        if not all(all(r["modes"][mode]["exact"]) for r in results):
            raise SystemExit(f"{mode}: a refit was not exact: {[r['modes'][mode]['exact'] for r in results]}")
        per_refit = [max(r["modes"][mode]["seconds"][i] for r in results) for i in range(refits)]
        steady = statistics.median(per_refit[1:])
        out[mode] = {
            "refit_s": [round(t, 4) for t in per_refit],
            "median_s": round(steady, 4),
            "vs_copy": round(steady / copy_s, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--src", default="fsdp=2")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk-bytes", type=int, default=None, help="the relay's chunk (default: the model / 32)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(llama_config(a.layers)))
        row = run(a.rate, a.src, a.replicas, a.refits, str(config), a.chunk_bytes)
    print(json.dumps(row))
    if a.out:
        Path(a.out).write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
