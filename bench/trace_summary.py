"""Summarise the torch profiler timelines `bench.delta_gpu --trace DIR` writes: per refit range, the device's
kernels in order (runs of one kernel on one stream merged), the time the device was busy, and the host calls
that blocked longer than 150 us.

    python3 -m bench.trace_summary DIR/trace_words_0.json [more traces, .json or .json.gz]
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


def _merged(kernels: list[dict]) -> list[list]:
    """Runs of one kernel on one stream (less than 50 us apart): ``[name, stream, start, end, count, busy]``."""
    rows: list[list] = []
    for e in kernels:
        n, tid = _short(e["name"]), e.get("tid")
        if rows and rows[-1][0] == n and rows[-1][1] == tid and e["ts"] - rows[-1][3] < 50:
            rows[-1][3], rows[-1][4], rows[-1][5] = e["ts"] + e["dur"], rows[-1][4] + 1, rows[-1][5] + e["dur"]
        else:
            rows.append([n, tid, e["ts"], e["ts"] + e["dur"], 1, e["dur"]])
    return rows


def _busy(kernels: list[dict], t0: float) -> float:
    busy, end = 0.0, t0
    for e in kernels:
        start, finish = max(e["ts"], end), e["ts"] + e["dur"]
        if finish > start:
            busy, end = busy + finish - start, max(end, finish)
    return busy


def summarise(path: str) -> None:
    ev = _events(path)
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
        for n, tid, s, f, c, d in _merged(kernels):
            if f - s > 30 or c > 3:
                print(f"    gpu {(s - t0) / 1e3:7.2f}-{(f - t0) / 1e3:7.2f}  s{tid} {n} x{c} ({d / 1e3:.2f} ms busy)")
        calls = (e for e in ev if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1 and e["dur"] > 150)
        for e in sorted(calls, key=lambda e: e["ts"]):
            print(f"    cpu {(e['ts'] - t0) / 1e3:7.2f}-{(e['ts'] + e['dur'] - t0) / 1e3:7.2f}  {e['name']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    for path in ap.parse_args().traces:
        summarise(path)


if __name__ == "__main__":
    main()
