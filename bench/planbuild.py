"""Plan build time at cluster scale, on one CPU core: the cost model's source choice
(``plan.link_bytes``, what ``refit plan --cluster`` runs) and the full executable plan
(``plan.build_plan``: pieces, messages, buffer schedule, for every rank of both sides).

    taskset -c 0 python -m bench.planbuild [--repeats 3] [--out bench/results/cpu-plan-build.json]

Shapes come from the meta model once per model (not timed); every timed build starts from
fresh layouts, so per-rank boxes are computed inside the timed window. Prints the median of
``--repeats`` builds per case and writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial

from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan, link_bytes
from refit.quant import fp8_layout

# (label, model, trainer spec, engine spec, colocated, fp8 block)
CASES = [
    ("DeepSeek-V3 colocated", "deepseek-v3", "pp=16,ep=16", "tp=32,dp=8", True, None),
    ("DeepSeek-V3 separate", "deepseek-v3", "pp=16,ep=16", "tp=32,dp=8", False, None),
    ("Kimi-K2 FP8 engine", "kimi-k2", "pp=16,ep=16", "tp=16,dp=8", False, 128),
]


def layouts(shapes, src: str, dst: str, fp8: int | None):
    s = layout_from_spec(shapes, parse_spec(src, "src"))
    d = layout_from_spec(shapes, parse_spec(dst, "dst"))
    if fp8:
        s, d = fp8_layout(s, block=(fp8, fp8)), fp8_layout(d, block=(fp8, fp8), side="destination")
    return s, d


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/cpu-plan-build.json")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    shapes_of: dict[str, list] = {}
    rows = []
    for label, model, src, dst, colocated, fp8 in CASES:
        shapes = shapes_of.setdefault(model, param_shapes(model))
        n_src, n_dst = parse_spec(src, "src").world_size, parse_spec(dst, "dst").world_size
        procs = (ProcessMap.colocated if colocated else ProcessMap.disjoint)(n_src, n_dst)
        samples: dict[str, list[float]] = {"link_bytes": [], "build_plan": []}
        info = {}
        for _ in range(args.repeats):
            t, (s, d) = timed(partial(layouts, shapes, src, dst, fp8))
            t2, lb = timed(partial(link_bytes, s, d, procs))
            samples["link_bytes"].append(t + t2)
            s, d = layouts(shapes, src, dst, fp8)
            t3, plan = timed(partial(build_plan, s, d, procs))
            samples["build_plan"].append(t3)
            info = {
                "links": len(lb),
                "messages": len(plan.messages),
                "steps": plan.num_steps,
                "pieces": sum(len(m.pieces) for m in plan.messages) + len(plan.local),
                "bytes_moved": plan.bytes_moved,
            }
            del plan
        rows.append(
            {
                "case": label,
                "model": model,
                "src": src,
                "dst": dst,
                "colocated": colocated,
                "fp8_block": fp8,
                "cores": cores,
                **info,
                "samples_s": samples,
                "median_s": {k: statistics.median(v) for k, v in samples.items()},
            }
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(
        f"{'case':26s} {'pieces':>8s} {'messages':>9s} {'source choice s':>16s} {'full plan s':>12s}  "
        f"(median of {args.repeats}, {cores} core(s))"
    )
    for r in rows:
        m = r["median_s"]
        print(
            f"{r['case']:26s} {r['pieces']:>8d} {r['messages']:>9d} {m['link_bytes']:>16.2f} {m['build_plan']:>12.2f}"
        )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
