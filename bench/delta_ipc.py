"""S1 over CUDA IPC: dense pulls, IPC deltas (``refit.transport.ipc_delta``) and NCCL deltas, side by side.

    python -m bench.delta_ipc --out ipc-delta.json --buffer-mb 2048          # 2 GPUs: llama-3.1-8b shapes (bf16)
    python -m bench.delta_gpu --no-kernels --no-s1 --s1-ipc --buffer-mb 2048 --out delta.json   # the same, there

A trainer process on cuda:0 and an engine process on cuda:1 (``tp=1`` both), one Peer pair per method
(``PEERS``): CUDA IPC dense, IPC deltas under ``delta="auto"`` and forced words (the used staging copied to the
engine's GPU first and scattered there, the default), forced words read in place (``REFIT_IPC_DELTA_READ=peer``:
the receiver's scatter on the trainer's GPU, storing over NVLink), and NCCL P2P
deltas with forced words (the P2P delta path), in two runs (``GROUPS``: one that fails leaves the other's rows).
Per changed fraction (0.1%, 1%, 100%: every element's last mantissa bit flips with that probability) ``--iters``
versions, each refit by every Peer in turn (each first in turn), timed from a barrier to the device's idle on both
processes (the slower one counts, the first version of each fraction not), the engine checked bit for bit against
the trainer's tensors after every refit. ``--buffer-mb``: the staging budget is 2 x that; a delta over it goes
dense (1% of Llama-3.1-8B as words is ~1 GB). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench.delta_gpu import _same, optimizer_step, refit_in_turn
from refit.config import TransferConfig
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.bench.weights import make_weight
from refit.tools.launch import run_local
from refit.transfer import Peer

PEERS = {  # name -> (TransferConfig fields, REFIT_IPC_DELTA_READ while its Peer is built)
    "ipc": ({"transport": "ipc"}, None),
    "ipc_auto": ({"transport": "ipc", "delta": "auto"}, "land"),
    "ipc_words": ({"transport": "ipc", "delta": "words"}, "land"),
    "ipc_peer": ({"transport": "ipc", "delta": "words"}, "peer"),
    "nccl_words": ({"transport": "p2p", "delta": "words"}, None),
}
FRACTIONS = (0.001, 0.01, 1.0)


def _peer(world, name: str, i: int, lay, procs, tensors, buffer_mb: int) -> Peer:
    fields, read = PEERS[name]
    cfg = TransferConfig(num_buffers=2, buffer_bytes=buffer_mb << 20, deadline_s=600, name=f"s1ipc-{name}", **fields)
    side = {"src_tensors": tensors} if world.src_rank is not None else {"dst_tensors": tensors}
    group = world.data_group if fields["transport"] == "p2p" else None  # NCCL for the P2P Peer
    before = os.environ.get("REFIT_IPC_DELTA_READ")
    os.environ["REFIT_IPC_DELTA_READ"] = read or "land"  # read when its IPC link is built
    try:
        return Peer(lay, lay, world.rank, procs=procs, config=cfg, device=world.device, group=group,
                    tag_base=100_000 * i, **side)  # fmt: skip
    finally:
        if before is None:
            os.environ.pop("REFIT_IPC_DELTA_READ")
        else:
            os.environ["REFIT_IPC_DELTA_READ"] = before


def _worker(world, model: str, iters: int, buffer_mb: int, names: tuple[str, ...]) -> list[dict]:
    """Process 0 (cuda:0) sends, process 1 (cuda:1) receives; every Peer of ``names`` refits every version."""
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes(model)]
    lay = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    dev = world.device
    procs = ProcessMap((0,), (1,), ("cuda:0", "cuda:1"))
    is_src = world.src_rank is not None
    tensors = {n: make_weight(n, s, torch.bfloat16, dev) if is_src else torch.zeros(s, dtype=torch.bfloat16, device=dev)
               for n, s, _ in shapes}  # fmt: skip
    ref = None if is_src else {n: make_weight(n, s, torch.bfloat16, dev) for n, s, _ in shapes}
    peers = {k: _peer(world, k, i, lay, procs, tensors, buffer_mb) for i, k in enumerate(names)}
    version, rows = 1, []
    for p in peers.values():
        p.run(version)  # dense for all: nothing to diff against
    for fi, f in enumerate(FRACTIONS):
        times, exact = {k: [] for k in peers}, True
        moved, enc = {}, {}
        for it in range(iters):
            version += 1
            optimizer_step(tensors if ref is None else ref, f, seed=1000 * fi + it)
            for k, st in refit_in_turn(peers, names, version, it, dev, times):
                d = st.delta
                if d is not None:
                    moved[k] = d.wire_bytes if is_src else d.received_bytes
                    enc[k] = {"words": d.encodings["words"], "dense": d.encodings["dense"], "why": dict(d.dense_why)}
                if ref is not None:
                    exact = exact and _same(tensors, ref)
        warm = slice(1, None) if iters > 1 else slice(None)
        rows.append({"fraction": f, **{f"{k}_ms": statistics.median(v[warm]) * 1e3 for k, v in times.items()},
                     "moved": moved, "encodings": enc, "exact": exact})  # fmt: skip
    dense_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    for p in peers.values():
        p.close()
    return [{**r, "dense_bytes": dense_bytes} for r in rows]


GROUPS = (("ipc", "ipc_auto", "ipc_words", "nccl_words"), ("ipc", "ipc_peer"))
"""The Peers of each run: the landing copy and NCCL first, then the scatter reading the staging in place (a run that
fails leaves the others' rows; the dense IPC Peer runs in each, the first one's times are kept)."""


def s1_ipc(model: str, iters: int, buffer_mb: int, groups=GROUPS) -> dict:
    """``_worker`` on 2 processes (cuda:0, cuda:1) once per group of Peers: per fraction the slower process's median
    per Peer, the trainer's bytes staged or sent and encodings, the engine's bytes read and exactness; and the error of
    each run that failed."""
    rows: list[dict] = []
    errors = {}
    for names in groups:
        try:
            src, dst = run_local(_worker, 1, 1, model, iters, buffer_mb, tuple(names), devices=["cuda:0", "cuda:1"],
                                 timeout_s=900)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the other runs' rows stand
            errors["+".join(names)] = f"{type(e).__name__}: {str(e)[-600:]}"
            continue
        for i, (a, b) in enumerate(zip(src, dst)):
            got = {f"{k}_ms": max(a[f"{k}_ms"], b[f"{k}_ms"]) for k in names}
            if i == len(rows):
                rows.append({"fraction": a["fraction"], "sent": {}, "read": {}, "encodings": {}, "receiver_why": {},
                             "exact": True, "dense_bytes": a["dense_bytes"]})  # fmt: skip
            r = rows[i]
            r.update({k: v for k, v in got.items() if k not in r})
            r["sent"] |= a["moved"]
            r["read"] |= b["moved"]
            r["encodings"] |= a["encodings"]
            r["receiver_why"] |= {k: v["why"] for k, v in b["encodings"].items()}
            r["exact"] = r["exact"] and b["exact"]
    return {"rows": rows, "errors": errors}


def print_s1_ipc(res: dict) -> None:
    rows = res["rows"]
    for run, err in res["errors"].items():
        print(f"S1 over CUDA IPC, run {run} failed: {err}")
    if not rows:
        return
    names = [k[:-3] for k in rows[0] if k.endswith("_ms")]
    print("S1 trainer cuda:0 -> engine cuda:1 (slower process, median ms; x dense IPC; engine's bytes read / dense):")
    for r in rows:
        cols = []
        for k in names:
            read = r["read"].get(k)
            share = f", {read / r['dense_bytes']:.2%}" if read is not None else ""
            cols.append(f"{k} {r[f'{k}_ms']:8.2f} ({r[f'{k}_ms'] / r['ipc_ms']:.2f}x{share})")
        print(f"  {r['fraction']:>6.1%} | " + " | ".join(cols) + f" | exact {r['exact']}")
    for r in rows:
        print(f"  {r['fraction']:>6.1%} trainer encodings {r['encodings']}; engine dense because {r['receiver_why']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=4, help="versions per fraction (the first is not counted)")
    ap.add_argument("--buffer-mb", type=int, default=2048, help="the staging budget is 2 x this")
    ap.add_argument(
        "--peers",
        default=None,
        help=f"one run of these methods beside ipc (known: {', '.join(PEERS)}; default: GROUPS)",
    )
    args = ap.parse_args()
    groups = GROUPS
    if args.peers is not None:
        groups = (tuple(dict.fromkeys(["ipc", *(k for k in args.peers.split(",") if k)])),)
        unknown = sorted(set(groups[0]) - set(PEERS))
        if unknown:
            ap.error(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(PEERS)})")
    if torch.cuda.device_count() < 2:
        ap.error(f"{torch.cuda.device_count()} GPU(s): S1 over CUDA IPC needs 2")
    res = s1_ipc(args.model, args.iters, args.buffer_mb, groups)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "model": args.model, "s1_ipc": res}, f, indent=1)
    print_s1_ipc(res)


if __name__ == "__main__":
    main()
