"""Summarise the torch profiler timelines `bench.delta_gpu --trace DIR` writes: per refit range, the device's
kernels in order (runs of one kernel on one stream merged; ``@`` the host's launch of the run's first, from the
runtime call of the same correlation id), the time the device was busy, and the host calls that blocked longer
than 150 us (``--ops US``: also the host's torch ops longer than US microseconds).

    python3 -m bench.trace_summary DIR/trace_words_0.json [more traces, .json or .json.gz] [--ops 50]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re

_KINDS = ("ncclDevKernel_SendRecv", "ncclDevKernel", "_find_words", "_scatter", "_check", "_pack", "Memcpy", "Memset")


def _events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _short(name: str) -> str:
    name = re.sub(r"\(.*", "", name)
    return next((k for k in _KINDS if k.lower() in name.lower()), name[:40])


def _merged(kernels: list[dict], launched: dict) -> list[list]:
    """Runs of one kernel on one stream (less than 50 us apart): ``[name, stream, start, end, count, busy,
    launch]`` (``launch``: the host time of the first's launch, or None)."""
    rows: list[list] = []
    for e in kernels:
        n, tid = _short(e["name"]), e.get("tid")
        if rows and rows[-1][0] == n and rows[-1][1] == tid and e["ts"] - rows[-1][3] < 50:
            rows[-1][3], rows[-1][4], rows[-1][5] = e["ts"] + e["dur"], rows[-1][4] + 1, rows[-1][5] + e["dur"]
        else:
            at = launched.get(e.get("args", {}).get("correlation"))
            rows.append([n, tid, e["ts"], e["ts"] + e["dur"], 1, e["dur"], at])
    return rows


def _busy(kernels: list[dict], t0: float) -> float:
    busy, end = 0.0, t0
    for e in kernels:
        start, finish = max(e["ts"], end), e["ts"] + e["dur"]
        if finish > start:
            busy, end = busy + finish - start, max(end, finish)
    return busy


def summarise(path: str, ops_us: float | None = None) -> None:
    ev = _events(path)
    launched = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") == "cuda_runtime" and "args" in e}
    print("=====", path)
    for r in sorted((e for e in ev if e["name"].startswith("refit ")), key=lambda e: e["ts"]):
        t0, t1 = r["ts"], r["ts"] + r["dur"]
        print(f"  {r['name']} ({r.get('cat')}): {r['dur'] / 1e3:.2f} ms")
        if "dense" in r["name"]:
            continue
        kernels = sorted(
            (e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= e["ts"] <= t1),
            key=lambda e: e["ts"],
        )
        print(f"    device busy {_busy(kernels, t0) / 1e3:.2f} ms of {(t1 - t0) / 1e3:.2f}")
        for n, tid, s, f, c, d, at in _merged(kernels, launched):
            if f - s > 30 or c > 3:
                host = "" if at is None else f" @{(at - t0) / 1e3:.2f}"
                span = f"{(s - t0) / 1e3:7.2f}-{(f - t0) / 1e3:7.2f}"
                print(f"    gpu {span}  s{tid} {n} x{c} ({d / 1e3:.2f} ms busy){host}")
        calls = (e for e in ev if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1 and e["dur"] > 150)
        for e in sorted(calls, key=lambda e: e["ts"]):
            print(f"    cpu {(e['ts'] - t0) / 1e3:7.2f}-{(e['ts'] + e['dur'] - t0) / 1e3:7.2f}  {e['name']}")
        if ops_us is not None:
            ops = (e for e in ev if e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1 and e["dur"] > ops_us)
            for e in sorted(ops, key=lambda e: e["ts"]):
                print(f"    op  {(e['ts'] - t0) / 1e3:7.2f}-{(e['ts'] + e['dur'] - t0) / 1e3:7.2f}  {e['name'][:60]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--ops", type=float, default=None, help="also list host torch ops longer than this (us)")
    args = ap.parse_args()
    for path in args.traces:
        summarise(path, args.ops)


if __name__ == "__main__":
    main()
