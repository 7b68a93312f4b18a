"""Render a ``refit bench`` record into docs/benchmarks.md's generated table and a PNG chart.

    python -m bench.render bench/results/h200x2-s1-s3.json [bench/results/h200x2-s2-checkpoint-engine.json ...]
        [--drop refit_checksums]

Rows of further files (other runs on the same device kind, e.g. checkpoint-engine's) are appended, without
their own floor rows; their ratios stay against the floor measured in their own run. The table gives each
method's median, its ratio to the floor and to ``refit`` of the same scenario (``x refit``: > 1 is slower).

Needs matplotlib (``pip install -e '.[bench]'``). For a record named NAME.json it rewrites the text between the
``<!-- results:NAME -->`` markers in docs/benchmarks.md and writes docs/img/bench-NAME.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def table(rows: list[dict]) -> str:
    """One line per record: median (min-max) ms, GB/s, x the floor, x refit of the same scenario, memory, exact."""
    out = [
        "| scenario | method | median ms (min-max) | GB/s | x floor | x refit | peak extra MiB | exact |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    refit = {r["scenario"]: r["median_s"] for r in rows if r["method"] == "refit" and not r.get("variant")}
    for r in rows:
        vs = f"{r['median_s'] / refit[r['scenario']]:.2f}" if r["scenario"] in refit else "-"
        name = r["method"] + (f" ({r['variant']})" if r.get("variant") else "")
        peak = "-" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.0f}"
        exact = "-" if r["correct"] is None else ("yes" if r["correct"] else "NO")
        ms = f"{r['median_s'] * 1e3:.2f} ({r['min_s'] * 1e3:.2f}-{r['max_s'] * 1e3:.2f})"
        cells = [r["scenario"], name, ms, f"{r['gbps']:.0f}", f"{r['ratio_to_floor']:.3f}", vs, peak, exact]
        out.append("| " + " | ".join(cells) + " |")
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", help="a refit bench record; its name names the markers and the plot")
    ap.add_argument("more", nargs="*", help="records of other runs whose rows are appended (no floor rows)")
    ap.add_argument("--drop", default="", help="methods left out of the table and plot, comma-separated")
    args = ap.parse_args(argv)
    drop = {m for m in args.drop.split(",") if m}
    rows = json.load(open(args.record))
    for extra in args.more:
        rows += [r for r in json.load(open(extra)) if r["method"] != "floor"]
    rows = [r for r in rows if r["method"] not in drop]
    order = {s: i for i, s in enumerate(dict.fromkeys(r["scenario"] for r in rows))}
    rows.sort(key=lambda r: (order[r["scenario"]], r["method"] == "floor"))  # stable: runs keep their order
    name = os.path.splitext(os.path.basename(args.record))[0]
    doc = "docs/benchmarks.md"
    text = open(doc).read()
    start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    if start not in text:
        raise SystemExit(f"{doc} has no {start} marker")
    png = f"img/bench-{name}.png"
    device = rows[0].get("device", name)
    chart(rows, os.path.join("docs", png), f"refit bench, {rows[0]['model']}, {device}, {rows[0]['date']}")
    body = f"{start}\n{table(rows)}\n\n![refit bench, {name}]({png})\n{end}"
    text = text[: text.index(start)] + body + text[text.index(end) + len(end) :]
    open(doc, "w").write(text)
    print(f"wrote {doc} and docs/{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
