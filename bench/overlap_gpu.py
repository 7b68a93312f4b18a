"""Refit while an engine runs forward passes: the stall an overlapped refit costs, beside a
stop-the-world refit of the same scenario, in one run.

    python -m bench.overlap_gpu --scenario S2 [--model llama-3.1-8b] [--iters 5] [--json out.json]
    python -m bench.overlap_gpu --scenario S1            # two GPUs: trainer GPU0 -> engine GPU1
    python -m bench.overlap_gpu --device cpu --model tiny-llama --iters 2   # the same code on CPU (a check)

Two processes: a trainer rank holding the model (the source, its weights regenerated per version) and an
engine rank holding the live weights (``tp=1``), on which an engine stand-in
(``refit.tools.standin.ForwardLoop``) runs a forward pass of the model back to back: ``--tokens`` tokens
through every layer (embedding, attention with grouped KV heads, SwiGLU MLP, norms, LM head), reading
every weight. Per version:

* ``overlap``: ``Peer.stage(v)`` (``commit="staged"``: the bytes land in a shadow while passes run on the
  live weights), then ``Peer.commit(pause, resume)``: the stand-in stops after its pass in flight, the
  shadow is copied into the live weights, it resumes;
* ``stop_the_world``: the stand-in is paused, ``Peer.run(v)`` (``commit="in_place"``) moves the bytes into
  the live weights, it resumes;
* ``swap``: ``refit.swap.SwapCommit``: v lands in the engine's second weight set while passes run on the
  live one, then the commit pauses the stand-in, rebinds it to the other set (no copy) and resumes it.
  Two swap refits per iteration (into set B, then back into A), so the other modes always find the
  engine on set A; each counts.

Reported per mode (medians over ``--iters``): ``stall_s``: the longest interval with no forward pass
completing, from the start of the refit until 5 passes after it; ``forward_s``: the median interval
between passes before the refit (one forward pass); ``copy_s``: the overlap commit's shadow -> live copy
(one on-device copy of the engine's share); ``commit_s``: the commit under the pause (the copy, or the
rebind); ``transfer_s``; and after each refit whether the weights the forward pass reads equal the
version bit for bit (``exact``). S2: both processes on GPU 0 (CUDA IPC on one GPU); S1: trainer on GPU 0,
engine on GPU 1 (IPC between GPUs). The trainer waits (a barrier) until the engine has measured a refit
before it regenerates the next version, so on S2 its writes never overlap the engine's commit.

``--pull-gbps G`` paces the overlapped modes' pulls (``TransferConfig.pull_gbps``): on one GPU (S2) a
full-speed pull takes the memory bandwidth the passes need; a paced one leaves them most of it.

On CUDA the stand-in replays its forward pass as a CUDA graph (``--forward graph``, the default; one
graph per weight set, captured once): an eager pass of an 8B model is some 850 kernel launches and
takes ~30 ms of Python and launch overhead for ~5 ms of reading weights. A graph reads the weights at
the addresses it captured, like vLLM's: the swap commit rebinds the stand-in to the other set's graph.
``--forward eager`` runs the eager pass (the same weights by reference).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout.models import PRESETS, load_config, param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.swap import SwapCommit
from refit.tools.launch import run_local
from refit.tools.standin import ForwardLoop
from refit.tools.verify import reference_tensor, same_bits
from refit.transfer import Peer

DEVICES = {("cuda", "S2"): ("cuda:0", "cuda:0"), ("cuda", "S1"): ("cuda:0", "cuda:1"), ("cpu", "S2"): ("cpu", "cpu")}
AFTER = 5  # passes counted after a refit, inside the stall window


def forward_pass(w: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> torch.Tensor:
    """One pass of a Llama decoder over the tokens ``ids`` (one causal sequence) on the weights ``w``
    (HF names); returns the last token's logits. Every weight is read once."""
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    eps, n = cfg.rms_norm_eps, ids.numel()
    gqa = {"enable_gqa": True} if _SDPA_GQA else {}

    def rms(x, weight):
        if hasattr(F, "rms_norm"):  # one kernel (torch >= 2.4)
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * weight

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(n, nh, hd).transpose(0, 1)
        k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(n, nkv, hd).transpose(0, 1)
        v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(n, nkv, hd).transpose(0, 1)
        if not gqa:  # older torch: grouped KV heads materialized
            k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        x = x + F.linear(a.transpose(0, 1).reshape(n, nh * hd), w[p + "self_attn.o_proj.weight"])
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g, u = F.linear(h, w[p + "mlp.gate_proj.weight"]), F.linear(h, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(g) * u, w[p + "mlp.down_proj.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return F.linear(rms(x[-1:], w["model.norm.weight"]), head)


def _sdpa_takes_gqa() -> bool:
    try:
        q, kv = torch.zeros(2, 1, 4), torch.zeros(1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


_SDPA_GQA = _sdpa_takes_gqa()


def _capture(w: dict[str, torch.Tensor], cfg, ids: torch.Tensor, dev: torch.device):
    """A CUDA graph of ``forward_pass`` on ``w`` (warmed up on a side stream) and its output tensor."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward_pass(w, cfg, ids)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward_pass(w, cfg, ids)
    torch.cuda.synchronize(dev)
    return graph, out


def _standin(holder: dict, sets: tuple[dict, ...], cfg, tokens: int, dev: torch.device, graphs: bool):
    """The stand-in's pass on ``holder["w"]`` (one of ``sets``): eager, or the graph captured for that
    set; and how it runs (``"graph"``, ``"eager"``, or why capturing failed: the run then goes on eager,
    saying so on stderr and in the JSON). A pass waits for its own stream only, not for the transfer's."""
    ids = torch.arange(tokens, device=dev) % 1000
    key, how = "model.embed_tokens.weight", "graph" if graphs else "eager"  # a set is known by its tensors' place
    captured = {}
    try:
        captured = {s[key].data_ptr(): _capture(s, cfg, ids, dev) for s in sets} if graphs else {}
    except Exception as e:  # noqa: BLE001 - reported, and the bench still measures (eager)
        how, captured = f"eager (CUDA graph capture failed: {type(e).__name__}: {e})", {}
        print(f"warning: the stand-in runs eager: {how}", file=sys.stderr)

    def step():
        if captured:
            with torch.cuda.device(dev):
                graph, out = captured[holder["w"][key].data_ptr()]
                graph.replay()
        else:
            out = forward_pass(holder["w"], cfg, ids)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        return float(out[0, 0])

    return step, how


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _regenerate(tensors: dict, layout, version: int, dev: torch.device) -> None:
    """The trainer's weights of ``version`` (seeded per tensor and version), in place."""
    for t in layout:
        tensors[t.name].copy_(reference_tensor(t.name, t.shape, t.dtype, version, dev))
    _sync(dev)


def _holds(tensors: dict, layout, version: int, dev: torch.device) -> bool:
    return all(same_bits(tensors[t.name], reference_tensor(t.name, t.shape, t.dtype, version, dev)) for t in layout)


def _measure(loop: ForwardLoop, refit, version: int) -> dict:
    """Run ``refit(version)`` (returns its own timings) while the loop runs; the stall from its start until
    ``AFTER`` passes after it ended."""
    time.sleep(0.3)
    quiet = time.perf_counter()
    time.sleep(0.3)
    t0 = time.perf_counter()
    row = refit(version)
    t1 = time.perf_counter()
    while len(loop.between(t1, time.perf_counter())) < AFTER:
        time.sleep(0.001)
    t2 = time.perf_counter()
    return {**row, "stall_s": loop.stall(t0, t2), "forward_s": loop.typical(quiet, t0), "refit_s": t1 - t0}


MODES = ("overlap", "stop_the_world", "swap", "swap")  # per iteration; two swaps end on set A again


def _worker(
    world, model: str, tokens: int, iters: int, warmup: int, graphs: bool, pull_gbps: float | None = None
) -> list[dict]:
    dev = world.device
    layout = layout_from_spec(param_shapes(model), parse_spec("tp=1", "src"))
    dst = layout_from_spec(param_shapes(model), parse_spec("tp=1", "dst"))
    tensors = {t.name: torch.empty(t.shape, dtype=t.dtype, device=dev) for t in layout}
    is_src = world.rank == 0
    cuda = dev.type == "cuda"
    procs = ProcessMap((0,), (1,), tuple(world.devices) if cuda else None)
    transport = "auto" if cuda else "p2p"  # CUDA IPC between the two GPU processes
    kw = {"src_tensors": tensors} if is_src else {"dst_tensors": tensors}
    _regenerate(tensors, layout, 0, dev)
    common = dict(procs=procs, device=dev, group=world.data_group)
    staged = Peer(
        layout,
        dst,
        world.rank,
        config=TransferConfig(name="ov-s", commit="staged", transport=transport, pull_gbps=pull_gbps),
        **common,
        **kw,
    )
    inplace = Peer(layout, dst, world.rank, config=TransferConfig(name="ov-i", transport=transport), **common, **kw)
    holder = {"w": tensors}  # what the stand-in reads; the swap commit rebinds it
    swap_kw = (
        {"src_tensors": tensors}
        if is_src
        else {
            "sets": (tensors, {n: torch.empty_like(t) for n, t in tensors.items()}),
            "rebind": lambda t: holder.__setitem__("w", t),
        }
    )
    swap = SwapCommit(
        layout,
        dst,
        world.rank,
        config=TransferConfig(name="ov-w", transport=transport, pull_gbps=pull_gbps),
        **common,
        **swap_kw,
    )
    loop = None
    if not is_src:
        step, how = _standin(holder, swap.sets, load_config(model), tokens, dev, graphs and cuda)
        loop = ForwardLoop(step).start()
    refit = {
        "overlap": _staged(staged, loop, True),
        "stop_the_world": _stw(inplace, loop, dev),
        "swap": _staged(swap, loop, False),
    }
    rows, version = [], 0
    for i in range(warmup + iters):
        for mode in MODES:
            version += 1
            if is_src:
                _regenerate(tensors, layout, version, dev)
            torch.distributed.barrier()
            if is_src:
                refit[mode](version)
            else:
                row = _measure(loop, refit[mode], version)
                exact = _holds(holder["w"], layout, version, dev)
                row.update(mode=mode, version=version, exact=exact, warmup=i < warmup, set=swap.live, forward=how)
                rows.append(row)
            torch.distributed.barrier()  # the trainer regenerates only after the engine measured
    if loop is not None:
        loop.stop()
    for p in (staged, inplace, swap):
        p.close()
    return rows


def _staged(peer: Peer | SwapCommit, loop: ForwardLoop | None, copies: bool):
    """``stage(v)`` while the stand-in runs, then ``commit(pause, resume)``: a copy (``Peer``) or a rebind."""

    def refit(version: int) -> dict:
        t0 = time.perf_counter()
        peer.stage(version)
        t1 = time.perf_counter()
        commit_s = peer.commit(*((loop.pause, loop.resume) if loop else ()))
        return {"transfer_s": t1 - t0, "copy_s": commit_s if copies else None, "commit_s": commit_s}

    return refit


def _stw(peer: Peer, loop: ForwardLoop | None, dev):
    def refit(version: int) -> dict:
        if loop is None:
            peer.run(version)
            return {}
        loop.pause()
        t0 = time.perf_counter()
        try:
            peer.run(version)
            _sync(dev)
        finally:
            t1 = time.perf_counter()
            loop.resume()
        return {"transfer_s": t1 - t0, "copy_s": None, "commit_s": None}

    return refit


def summarize(rows: list[dict]) -> dict:
    """Medians per mode over the timed (not warm-up) refits, every refit's exactness, and the ratios
    (a stall over one on-device copy of the engine's share: the overlap commit's copy)."""
    out = {}
    for mode in dict.fromkeys(MODES):
        timed = [r for r in rows if r["mode"] == mode and not r["warmup"]]
        med = {k: statistics.median(r[k] for r in timed) for k in ("stall_s", "forward_s", "transfer_s", "refit_s")}
        for k in ("copy_s", "commit_s"):
            if timed[0][k] is not None:
                med[k] = statistics.median(r[k] for r in timed)
        med["exact"] = all(r["exact"] for r in rows if r["mode"] == mode)
        med["n"] = len(timed)
        out[mode] = med
    copy = out["overlap"]["copy_s"]
    for mode, key in (("overlap", "stall_over_copy"), ("swap", "swap_stall_over_copy")):
        out[key] = out[mode]["stall_s"] / copy if copy else None
    out["excess_over_copy"] = (out["overlap"]["stall_s"] - out["overlap"]["forward_s"]) / copy if copy else None
    out["stop_the_world_over_overlap"] = out["stop_the_world"]["stall_s"] / out["overlap"]["stall_s"]
    out["stop_the_world_over_swap"] = out["stop_the_world"]["stall_s"] / out["swap"]["stall_s"]
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.overlap_gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("S1", "S2"), default="S2")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=8, help="tokens per forward pass (one sequence)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--pull-gbps",
        type=float,
        default=None,
        help="pace the overlapped modes' pulls to this many GB/s (TransferConfig.pull_gbps); stop-the-world unpaced",
    )
    ap.add_argument("--json", default=None, help="write rows and summary here")
    ap.add_argument(
        "--forward",
        choices=("graph", "eager"),
        default="graph",
        help="CUDA: the stand-in's pass as a CUDA graph or eager",
    )
    args = ap.parse_args(argv)
    for name in ("tokens", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.pull_gbps is not None and not (0 < args.pull_gbps < float("inf")):
        ap.error(f"--pull-gbps must be a finite number of GB/s > 0, got {args.pull_gbps}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if (args.device, args.scenario) not in DEVICES:
        ap.error(f"--scenario {args.scenario} needs two GPUs; on --device cpu only S2 (both processes on the CPU)")
    if args.device == "cuda" and torch.cuda.device_count() < len(set(DEVICES[args.device, args.scenario])):
        ap.error(
            f"--scenario {args.scenario} needs {len(set(DEVICES[args.device, args.scenario]))} GPU(s), "
            f"this machine has {torch.cuda.device_count()}"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    devices = list(DEVICES[args.device, args.scenario])
    try:
        rows = run_local(
            _worker,
            1,
            1,
            args.model,
            args.tokens,
            args.iters,
            args.warmup,
            args.forward == "graph",
            args.pull_gbps,
            devices=devices,
            timeout_s=1800,
        )[1]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    result = {
        "scenario": args.scenario,
        "model": args.model,
        "devices": devices,
        "tokens": args.tokens,
        "pull_gbps": args.pull_gbps,
        "forward": rows[0]["forward"],
        "summary": summarize(rows),
        "rows": rows,
    }
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    s = result["summary"]
    pace = f"{args.pull_gbps:g} GB/s" if args.pull_gbps else "full speed"
    print(f"{args.scenario} {args.model} stand-in forward pass: {result['forward']}; overlapped pulls: {pace}")
    for mode in dict.fromkeys(MODES):
        m = s[mode]
        print(
            f"{args.scenario} {args.model} {mode:>15}: stall {m['stall_s'] * 1e3:8.2f} ms  "
            f"forward {m['forward_s'] * 1e3:7.2f} ms  transfer {m['transfer_s'] * 1e3:8.2f} ms  "
            f"commit {(m.get('commit_s') or 0) * 1e3:7.2f} ms  exact {m['exact']}  (n={m['n']})"
        )
    print(
        f"stall / copy: overlap {s['stall_over_copy']:.2f}, swap {s['swap_stall_over_copy']:.2f}  "
        f"(copy {s['overlap']['copy_s'] * 1e3:.2f} ms; target <= 1.25)  stop-the-world stall / overlapped stall "
        f"{s['stop_the_world_over_overlap']:.2f}  stop-the-world stall / swap stall {s['stop_the_world_over_swap']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
