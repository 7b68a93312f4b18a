"""The CPU delta path's rates on one core, as ``refit.delta.rule.HOST`` weighs them (process time, the least of
``--runs`` runs of each step, so another process on the machine inflates them least):

    .venv/bin/python -m bench.delta_host_rates

* ``word_pass_gbps``: the find (``refit.delta.elements.find_changes``, one numpy pass over 64-bit words) over a
  ``--mib`` MiB bf16 tensor and its base with nothing changed: bytes of both versions read per second;
* ``find_ns_per_element``: what each changed element adds to that find (``--fraction`` of the elements changed,
  spread at random: told apart within its word);
* ``apply_ns_per_element``: what each changed element costs after the find: encoded (``wire.encode``, sparse),
  the base brought up to date (``elements.apply_changes``) and scattered on the receiver (``receive.scatter_host``);
* ``piece_us``: the fixed cost of one piece (``--pieces`` pieces of 4 KiB, one element changed each: the find,
  encode, base update and scatter per piece, less what their bytes and elements cost at the rates above).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from refit.delta.elements import apply_changes, bits, find_changes
from refit.delta.receive import scatter_host
from refit.delta.wire import encode, piece_wire


def _least(fn, runs: int) -> float:
    """The least process time of ``runs`` calls of ``fn`` (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _pair(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 tensor of ``n`` elements and a base that differs from it in ``k`` distinct elements (lowest bit)."""
    gen = torch.Generator().manual_seed(seed)
    cur = torch.randn(n, generator=gen).to(torch.bfloat16)
    base = cur.clone()
    at = torch.randperm(n, generator=gen)[:k]
    bits(base)[at] ^= 1
    return base, cur


def _after_find(base: torch.Tensor, cur: torch.Tensor, found: tuple, dst: np.ndarray) -> None:
    """One piece's work after its find: encode sparse, update a copy of the base, scatter into ``dst``."""
    idx, vals = found
    out = torch.empty(piece_wire("sparse", cur, len(idx)), dtype=torch.uint8)
    encode("sparse", cur.numel(), idx, vals, out)
    apply_changes(base, idx, vals)
    scatter_host([(dst, idx.numpy(), bits(vals).numpy())])


def measure(mib: int, fraction: float, pieces: int, runs: int) -> dict:
    torch.set_num_threads(1)
    n = mib * (1 << 20) // 2
    k = round(fraction * n)
    same = _pair(n, 0, 1)
    changed = _pair(n, k, 2)
    t_same = _least(lambda: find_changes(*same), runs)
    t_changed = _least(lambda: find_changes(*changed), runs)
    found = find_changes(*changed)
    work = changed[0].clone()
    dst = bits(torch.zeros(n, dtype=torch.bfloat16)).numpy()
    t_apply = _least(lambda: _after_find(work, changed[1], found, dst), runs)
    small = [_pair(2048, 1, 10 + i) for i in range(pieces)]
    smalls = [(b.clone(), c, bits(torch.zeros(2048, dtype=torch.bfloat16)).numpy()) for b, c in small]

    def per_piece() -> None:
        for (b, c), (w, _, d) in zip(small, smalls):
            _after_find(w, c, find_changes(b, c), d)

    t_pieces = _least(per_piece, max(3, runs // 3))
    gbps = 2 * 2 * n / t_same / 1e9
    find_ns = max(0.0, t_changed - t_same) / k * 1e9
    apply_ns = t_apply / k * 1e9
    piece_s = t_pieces / pieces - 2 * 2 * 2048 / (gbps * 1e9) - (find_ns + apply_ns) * 1e-9
    return {
        "mib": mib,
        "fraction": fraction,
        "runs": runs,
        "word_pass_gbps": round(gbps, 2),
        "find_ns_per_element": round(find_ns, 1),
        "apply_ns_per_element": round(apply_ns, 1),
        "ns_per_element": round(find_ns + apply_ns, 1),
        "piece_us": round(piece_s * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB of the bf16 tensor (and as much base)")
    ap.add_argument("--fraction", type=float, default=0.01, help="changed elements for the per-element costs")
    ap.add_argument("--pieces", type=int, default=500, help="4 KiB pieces for the per-piece cost")
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()
    for name in ("mib", "pieces", "runs"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(a, name)}")
    if not 0 < a.fraction < 1:
        raise SystemExit(f"--fraction must be within (0, 1), got {a.fraction}")
    print(json.dumps(measure(a.mib, a.fraction, a.pieces, a.runs)))


if __name__ == "__main__":
    main()
