"""Render bench/results/<kind>.json into docs/benchmarks.md's generated section and a PNG chart.

    python -m bench.render bench/results/nvidia-h200-x2.json [bench/results/nvidia-h200-x2-checkpoint-engine.json ...]

Rows of further files (other runs of the same device kind, e.g. checkpoint-engine's)
are appended, without their own floor rows; their ratios stay against the floor
measured in their own run.

Needs matplotlib (``pip install -e '.[bench]'``). Rewrites the text between the
``<!-- results:<kind> -->`` markers in docs/benchmarks.md and writes
docs/bench_<kind>.png.
"""

from __future__ import annotations

import json
import os
import sys


def table(rows: list[dict]) -> str:
    head = (
        "| scenario | method | median ms | min ms | max ms | GB/s | x floor | peak extra MiB | growth (B) | correct |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )
    out = [head]
    for r in rows:
        name = r["method"] + (f" ({r['variant']})" if r.get("variant") else "")
        peak = "-" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.0f}"
        out.append(
            f"| {r['scenario']} | {name} | {r['median_s'] * 1e3:.2f} | {r['min_s'] * 1e3:.2f} | "
            f"{r['max_s'] * 1e3:.2f} | "
            f"{r['gbps']:.0f} | {r['ratio_to_floor']:.3f} | "
            f"{peak} | "
            f"{'-' if r['growth_bytes'] is None or r['method'] != 'refit' else r['growth_bytes']} | "
            f"{'-' if r['correct'] is None else ('yes' if r['correct'] else 'NO')} |"
        )
    return "\n".join(out)


def chart(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = sorted({r["scenario"] for r in rows})
    fig, axes = plt.subplots(1, len(scen), figsize=(5 * len(scen), 4.2))
    axes = axes if len(scen) > 1 else [axes]
    for ax, s in zip(axes, scen):
        rs = [r for r in rows if r["scenario"] == s]
        names = [r["method"] for r in rs]
        vals = [r["median_s"] * 1e3 for r in rs]
        colors = ["#2b8a3e" if n == "refit" else "#868e96" if n == "floor" else "#4263eb" for n in names]
        ax.barh(names[::-1], vals[::-1], color=colors[::-1])
        for y, v in enumerate(vals[::-1]):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
        ax.set_title(f"{s}: {rs[0]['bytes'] / 1e9:.2f} GB")
        if max(vals) / min(vals) > 20:
            ax.set_xscale("log")
            ax.set_xlim(min(vals) * 0.5, max(vals) * 4)
            ax.set_xlabel("median ms per refit, log scale (lower is better)")
        else:
            ax.set_xlabel("median ms per refit (lower is better)")
            ax.set_xlim(0, max(vals) * 1.25)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    src = argv[0]
    rows = json.load(open(src))
    for extra in argv[1:]:
        rows += [r for r in json.load(open(extra)) if r["method"] != "floor"]
    order = {s: i for i, s in enumerate(dict.fromkeys(r["scenario"] for r in rows))}
    rows.sort(key=lambda r: (order[r["scenario"]], r["method"] == "floor"))  # stable: runs keep their order
    kind = os.path.splitext(os.path.basename(src))[0]
    doc = "docs/benchmarks.md"
    text = open(doc).read()
    start, end = f"<!-- results:{kind} -->", f"<!-- /results:{kind} -->"
    if start not in text:
        raise SystemExit(f"{doc} has no {start} marker")
    png = f"bench_{kind}.png"
    chart(rows, os.path.join("docs", png), f"refit bench, {rows[0]['model']}, {kind}, {rows[0]['date']}")
    body = f"{start}\n{table(rows)}\n\n![refit bench on {kind}]({png})\n{end}"
    text = text[: text.index(start)] + body + text[text.index(end) + len(end) :]
    open(doc, "w").write(text)
    print(f"wrote {doc} and docs/{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
