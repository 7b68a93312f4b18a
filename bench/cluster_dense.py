"""A dense refit across namespace hosts against its link floor (needs root and iproute2).

    sudo .venv/bin/python -m bench.cluster_dense --rate 1gbit --transport p2p,nixl --refits 5 [--trainer-nics 2]

Three hosts, each link shaped to ``--rate`` both ways: trainer ``--src`` (default fsdp=2) on host a, one tp=1
engine replica on each of hosts b and c, a Llama-shaped model of about 88 MB (float32; ``--layers``). With
``--trainer-nics n`` host a has n NICs, each a link of that rate, and its trainer ranks use the nearest one each
(``refit.tools.cluster.job.auto_nics``: rank i on NIC i when there are as many). The floor is the bytes the
busiest link must carry over its rate: host a's uplinks carry one copy of the model per replica between them,
each replica's link one copy. A refit's time is the slowest process's (the processes start each refit after a
barrier); the first refit is a warm-up. Prints one JSON object per transport, with the bytes each of host a's NICs
sent (``nic_tx_bytes``); ``--out`` appends them to a record, one line each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from refit.layout.models import param_shapes
from refit.tools.cluster import Cluster, LinkShape, parse_rate
from refit.tools.cluster.job import Job, auto_nics, python_argv


def llama_config(layers: int) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def run(transport: str, rate: str, src: str, replicas: int, refits: int, config: str, trainer_nics: int = 1) -> dict:
    model_bytes = sum(math.prod(s) * 4 for _, s, _ in param_shapes(config))
    hosts = ["a"] + [chr(ord("b") + i) for i in range(replicas)]
    rate_bit = parse_rate(rate)
    started, load = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()[0]
    with Cluster(hosts, LinkShape(rate_bit), nics={"a": trainer_nics}) as cluster:
        n_src = math.prod(int(kv.split("=")[1]) for kv in src.split(","))
        placement = ["a"] * n_src + hosts[1:]
        argv = python_argv(
            "refit.tools.cluster.rank",
            *("--src", src, "--dst", f"tp=1,dp={replicas}", "--model", config, "--refits", str(refits)),
            *("--transport", transport, "--hosts", ",".join(placement), "--deadline-s", "300"),
        )
        before = [cluster.counters("a", k)[1] for k in range(trainer_nics)]
        results = Job(cluster, placement, argv).wait(900)
        sent = [cluster.counters("a", k)[1] - before[k] for k in range(trainer_nics)]
        used = len(set(auto_nics(cluster, placement)[:n_src]))
    if not all(all(r["exact"]) for r in results):
        raise SystemExit(f"a refit was not exact: {[r['exact'] for r in results]}")
    per_refit = [max(r["seconds"][i] for r in results) for i in range(refits)]
    # host a's NICs in use carry one copy per replica between them; each replica's link one copy
    floor = max(replicas / used, 1) * model_bytes / (rate_bit / 8)
    steady = statistics.median(per_refit[1:])
    return {
        "date": started,
        "load_at_start": round(load, 2),
        "trainer_nics": trainer_nics,
        "nic_tx_bytes": sent,
        "transport": transport,
        "transports": results[0]["transports"],
        "rate": rate,
        "src": src,
        "replicas": replicas,
        "model_bytes": model_bytes,
        "floor_s": round(floor, 4),
        "refit_s": [round(t, 4) for t in per_refit],
        "median_s": round(steady, 4),
        "vs_floor": round(steady / floor, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--transport", default="p2p,nixl", help="comma-separated: p2p, nixl, auto")
    ap.add_argument("--src", default="fsdp=2")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trainer-nics", type=int, default=1, help="host a's NIC count (1..8), each a shaped link")
    ap.add_argument("--out", default=None, help="a record to append each transport's line to")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(llama_config(a.layers)))
        rows = [
            run(t, a.rate, a.src, a.replicas, a.refits, str(config), a.trainer_nics) for t in a.transport.split(",")
        ]
    for row in rows:
        print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
