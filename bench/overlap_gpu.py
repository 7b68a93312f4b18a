"""Refit while an engine runs forward passes (issue 21): the stall an overlapped refit costs, beside a
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
  the live weights, it resumes.

Reported per mode (medians over ``--iters``): ``stall_s``: the longest interval with no forward pass
completing, from the start of the refit until 5 passes after it; ``forward_s``: the median interval
between passes before the refit (one forward pass); ``copy_s``: the commit's shadow -> live copy (one
on-device copy of the engine's share); ``transfer_s``; and after each refit whether the live weights equal
the version bit for bit. S2: both processes on GPU 0 (CUDA IPC on one GPU); S1: trainer on GPU 0,
engine on GPU 1 (IPC between GPUs).
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

    def rms(x, weight):  # written out: no F.rms_norm, so older torch runs it too
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * weight

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)  # grouped KV heads
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(0, 1).reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x[-1:], w["model.norm.weight"]) @ head.T


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


def _measure(loop: ForwardLoop, refit, dev: torch.device) -> dict:
    """Run ``refit()`` (returns its own timings) while the loop runs; the stall from its start until
    ``AFTER`` passes after it ended."""
    time.sleep(0.3)
    quiet = time.perf_counter()
    time.sleep(0.3)
    t0 = time.perf_counter()
    row = refit()
    t1 = time.perf_counter()
    while len(loop.between(t1, time.perf_counter())) < AFTER:
        time.sleep(0.001)
    t2 = time.perf_counter()
    return {**row, "stall_s": loop.stall(t0, t2), "forward_s": loop.typical(quiet, t0), "refit_s": t1 - t0}


def _worker(world, model: str, tokens: int, iters: int, warmup: int) -> list[dict]:
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
        config=TransferConfig(name="ov-s", commit="staged", transport=transport),
        **common,
        **kw,
    )
    inplace = Peer(layout, dst, world.rank, config=TransferConfig(name="ov-i", transport=transport), **common, **kw)
    loop = None
    if not is_src:
        cfg, ids = load_config(model), torch.arange(tokens, device=dev) % 1000

        def step():
            out = forward_pass(tensors, cfg, ids)
            _sync(dev)
            return float(out[0, 0])

        loop = ForwardLoop(step).start()
    rows, version = [], 0
    for i in range(warmup + iters):
        for mode in ("overlap", "stop_the_world"):
            version += 1
            if is_src:
                _regenerate(tensors, layout, version, dev)
            torch.distributed.barrier()
            if is_src:
                (staged.run if mode == "overlap" else inplace.run)(version)
                continue
            row = _measure(
                loop,
                _overlap(staged, loop, dev, version) if mode == "overlap" else _stw(inplace, loop, dev, version),
                dev,
            )
            row.update(mode=mode, version=version, exact=_holds(tensors, layout, version, dev), warmup=i < warmup)
            rows.append(row)
    if loop is not None:
        loop.stop()
    staged.close()
    inplace.close()
    return rows


def _overlap(peer: Peer, loop: ForwardLoop, dev, version: int):
    def refit() -> dict:
        t0 = time.perf_counter()
        peer.stage(version)
        t1 = time.perf_counter()
        copy_s = peer.commit(loop.pause, loop.resume)
        return {"transfer_s": t1 - t0, "copy_s": copy_s}

    return refit


def _stw(peer: Peer, loop: ForwardLoop, dev, version: int):
    def refit() -> dict:
        loop.pause()
        t0 = time.perf_counter()
        try:
            peer.run(version)
            _sync(dev)
        finally:
            t1 = time.perf_counter()
            loop.resume()
        return {"transfer_s": t1 - t0, "copy_s": None}

    return refit


def summarize(rows: list[dict]) -> dict:
    """Medians per mode over the timed (not warm-up) refits, every refit's exactness, and the ratios."""
    out = {}
    for mode in ("overlap", "stop_the_world"):
        timed = [r for r in rows if r["mode"] == mode and not r["warmup"]]
        med = {k: statistics.median(r[k] for r in timed) for k in ("stall_s", "forward_s", "transfer_s", "refit_s")}
        if mode == "overlap":
            med["copy_s"] = statistics.median(r["copy_s"] for r in timed)
        med["exact"] = all(r["exact"] for r in rows if r["mode"] == mode)
        med["n"] = len(timed)
        out[mode] = med
    o = out["overlap"]
    out["stall_over_copy"] = o["stall_s"] / o["copy_s"] if o["copy_s"] else None
    out["excess_over_copy"] = (o["stall_s"] - o["forward_s"]) / o["copy_s"] if o["copy_s"] else None
    out["stop_the_world_over_overlap"] = out["stop_the_world"]["stall_s"] / o["stall_s"]
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.overlap_gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("S1", "S2"), default="S2")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=8, help="tokens per forward pass (one sequence)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None, help="write rows and summary here")
    args = ap.parse_args(argv)
    for name in ("tokens", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
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
            _worker, 1, 1, args.model, args.tokens, args.iters, args.warmup, devices=devices, timeout_s=1800
        )[1]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    result = {
        "scenario": args.scenario,
        "model": args.model,
        "devices": devices,
        "tokens": args.tokens,
        "summary": summarize(rows),
        "rows": rows,
    }
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    s = result["summary"]
    for mode in ("overlap", "stop_the_world"):
        m = s[mode]
        print(
            f"{args.scenario} {args.model} {mode:>15}: stall {m['stall_s'] * 1e3:8.2f} ms  "
            f"forward {m['forward_s'] * 1e3:7.2f} ms  transfer {m['transfer_s'] * 1e3:8.2f} ms  "
            f"copy {(m.get('copy_s') or 0) * 1e3:7.2f} ms  exact {m['exact']}"
        )
    print(
        f"stall / copy {s['stall_over_copy']:.2f}  (stall - forward) / copy {s['excess_over_copy']:.2f}  "
        f"stop-the-world stall / overlapped stall {s['stop_the_world_over_overlap']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
