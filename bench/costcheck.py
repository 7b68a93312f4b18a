"""The cost model (``refit.cost``) against measured runs: every recorded ``refit`` and floor
median of ``refit bench`` on the 2- and 4-GPU machines next to the model's prediction for the
same layouts and GPU placement.

    python -m bench.costcheck [--out bench/results/cost-model-check.json]

No GPU needed: it reads the ``refit bench`` records of ``RUNS`` (measured) and
bench/topologies/<kind>.json (the link speeds measured on those machines, ../shared facts).
"""

from __future__ import annotations

import argparse
import json
import sys

from refit.cost import Topology, broadcast_time, p2p_transfers, transfer_time
from refit.fanout_waves import wave_schedule
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.bench.scenarios import scenarios

RUNS = [
    ("nvidia-h200-x2", "bench/results/h200x2-s1-s3.json"),
    ("nvidia-h200-x2", "bench/results/h200x2-moe-s1-s3.json"),
    ("nvidia-h200-x4", "bench/results/h200x4-s4-s6.json"),
]


def rows() -> list[dict]:
    scen = scenarios("cuda")
    shapes: dict[str, list] = {}
    out = []
    for kind, path in RUNS:
        topo = Topology.from_json(f"bench/topologies/{kind}.json")
        recs = json.load(open(path))
        for name in sorted({r["scenario"] for r in recs if not r.get("variant") or r["method"] == "floor"}):
            if name not in scen:
                continue
            by = {r["method"]: r for r in recs if r["scenario"] == name}
            if "refit" not in by:
                continue
            sc, model = scen[name], by["refit"]["model"]
            shapes.setdefault(model, param_shapes(model))
            s, d = parse_spec(sc.src, "src"), parse_spec(sc.dst, "dst")
            src_l, dst_l = layout_from_spec(shapes[model], s), layout_from_spec(shapes[model], d)
            gpus = [int(x.split(":")[1]) for x in sc.devices]
            placement = (tuple(gpus[: s.world_size]), tuple(gpus[s.world_size : s.world_size + d.world_size]))
            t, where, n = transfer_time(p2p_transfers(src_l, dst_l, topo, placement=placement), topo)
            row = {
                "device": kind,
                "scenario": name,
                "model": model,
                "strategy": "p2p (refit)",
                "predicted_ms": t * 1e3,
                "busiest": where,
                "measured_refit_ms": by["refit"]["median_s"] * 1e3,
                "measured_floor_ms": by["floor"]["median_s"] * 1e3 if "floor" in by else None,
            }
            row["error"] = row["predicted_ms"] / row["measured_refit_ms"] - 1
            out.append(row)
            if "refit_fanout" in by:  # waves of refit's plan into one replica, each wave as long as the first
                reps = d.degree("dp")
                one = d.replica()
                one_l = layout_from_spec(shapes[model], one)
                first = placement[1][: one.world_size]
                t1, where, _ = transfer_time(p2p_transfers(src_l, one_l, topo, placement=(placement[0], first)), topo)
                waves = len(wave_schedule(reps))
                m = by["refit_fanout"]["median_s"] * 1e3
                out.append(
                    {
                        "device": kind,
                        "scenario": name,
                        "model": model,
                        "strategy": f"fanout ({waves} waves)",
                        "predicted_ms": waves * t1 * 1e3,
                        "busiest": where,
                        "measured_refit_ms": m,
                        "measured_floor_ms": None,
                        "error": waves * t1 * 1e3 / m - 1,
                    }
                )
            if "per_tensor_broadcast" in by:
                t, where = broadcast_time(dst_l.nbytes, s.world_size, d.world_size, topo)
                m = by["per_tensor_broadcast"]["median_s"] * 1e3
                out.append(
                    {
                        "device": kind,
                        "scenario": name,
                        "model": model,
                        "strategy": "broadcast",
                        "predicted_ms": t * 1e3,
                        "busiest": where,
                        "measured_refit_ms": m,
                        "measured_floor_ms": None,
                        "error": t * 1e3 / m - 1,
                    }
                )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/cost-model-check.json")
    args = ap.parse_args(argv)
    rs = rows()
    with open(args.out, "w") as f:
        json.dump(
            {"command": "python -m bench.costcheck " + " ".join(sys.argv[1:] if argv is None else argv), "rows": rs},
            f,
            indent=1,
        )
    print("| device | scenario | model | strategy | predicted ms | measured ms | error | busiest resource |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | --- |")
    for r in rs:
        print(
            f"| {r['device']} | {r['scenario']} | {r['model']} | {r['strategy']} | {r['predicted_ms']:.2f} | "
            f"{r['measured_refit_ms']:.2f} | {r['error']:+.1%} | {r['busiest']} |"
        )
    print(f"records written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
