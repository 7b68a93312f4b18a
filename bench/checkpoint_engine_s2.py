"""checkpoint-engine on scenario S2 (trainer and engine processes on one GPU), through its own IPC path.

    python -m bench.checkpoint_engine_s2 --out bench/results/h200x2-s2-checkpoint-engine.json

Two processes on cuda:0, no vLLM:

- the trainer process runs checkpoint-engine's ``ParameterServer`` (rank 0 of
  a world of 1): it registers the model's tensors (made on the GPU, the same
  values ``refit bench`` uses) with ``register_checkpoint`` — a copy into its
  pinned host memory pool — and calls ``update`` per refit, which copies
  buckets host -> GPU, hands the engine a CUDA IPC handle of its GPU buffer
  and the bucket's tensor metadata over ZMQ, and waits for the engine's ack.
- the engine process runs ``checkpoint_engine.worker.update_weights_from_ipc``
  (what its vLLM worker extension calls) with a ``run`` callback that copies
  each received tensor into the engine's own tensors.

Timed per refit: ``ParameterServer.update`` from call to return (it returns
after the engine has copied the last bucket and acknowledged), with the
process group made once (``auto_pg=False``) as its docs advise for repeated
updates. Also timed: the per-step registration of new weights into the
shared pinned pool (``checkpoint_engine_with_register``: unregister +
register + gather_metas + update), which an RL loop pays because the
weights change every step. Floor: one on-device copy of the model bytes, in
the same run. Before each refit the engine's tensors are poisoned (NaN);
after it they are compared bit for bit with the trainer's values.

Needs the ``checkpoint-engine`` package and its imports (pyzmq, loguru,
pydantic, fastapi, httpx); ``bench/gpu_run.sh`` installs carried wheels.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

from refit.transport.control import free_port

MODEL = "llama-3.1-8b"


def _weights(device: torch.device) -> dict[str, torch.Tensor]:
    from refit.layout.models import param_shapes
    from refit.tools.bench.weights import make_weight

    return {n: make_weight(n, shape, dtype, device) for n, shape, dtype in param_shapes(MODEL)}


def _quiet_logs() -> None:
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")


def _engine(cmd_q, res_q) -> None:
    """The engine process: poison, receive through checkpoint-engine's IPC worker path, check."""
    try:
        _quiet_logs()
        import zmq
        from checkpoint_engine.worker import update_weights_from_ipc

        from refit.tools.bench.weights import poison, same_bits

        dev = torch.device("cuda:0")
        torch.cuda.set_device(dev)
        ref = _weights(dev)
        dst = {n: torch.empty_like(t) for n, t in ref.items()}
        uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid!s}"
        ctx = zmq.Context()

        def load(weights: list[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                dst[name].copy_(t, non_blocking=True)

        res_q.put(("ready", None))
        while True:
            msg, arg = cmd_q.get()
            if msg == "stop":
                break
            if msg == "poison":
                poison(dst)
                torch.cuda.synchronize(dev)
                res_q.put(("poisoned", None))
            elif msg == "update":
                paths = dict(arg)
                update_weights_from_ipc(ctx, paths[uuid], device_id=0, run=load, post_hook=None)
                torch.cuda.synchronize(dev)
                res_q.put(("checked", same_bits(dst, ref)))
    except BaseException:  # report, then let the parent see the failure
        res_q.put(("error", traceback.format_exc()))
        raise


def _expect(res_q, what: str, timeout: float = 600.0):
    msg, arg = res_q.get(timeout=timeout)
    if msg == "error":
        raise RuntimeError(f"engine process failed:\n{arg}")
    if msg != what:
        raise RuntimeError(f"engine process said {msg!r}, expected {what!r}")
    return arg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("checkpoint-engine bench needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        from checkpoint_engine.ps import ParameterServer
    except ImportError as e:
        print(f"checkpoint-engine is not importable here: {e}", file=sys.stderr)
        return 2

    _quiet_logs()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mpc = mp.get_context("spawn")
    cmd_q, res_q = mpc.Queue(), mpc.Queue()
    proc = mpc.Process(target=_engine, args=(cmd_q, res_q), daemon=True)
    proc.start()

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    src = _weights(dev)
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    _expect(res_q, "ready")

    ps = ParameterServer(rank=0, world_size=1, auto_pg=False)
    t0 = time.perf_counter()
    ps.register_checkpoint("step", named_tensors=src, use_shared_memory_pool=True)
    first_register_s = time.perf_counter() - t0
    ps.init_process_group()
    ps.gather_metas("step")

    def req(socket_paths) -> None:  # checkpoint-engine calls this from its own thread
        cmd_q.put(("update", list(socket_paths)))

    def reregister() -> None:
        ps.unregister_checkpoint("step")  # keeps the shared pinned pool
        ps.register_checkpoint("step", named_tensors=src, use_shared_memory_pool=True)
        ps.gather_metas("step")

    def timed(with_register: bool) -> tuple[list[float], list[bool], int]:
        times, oks, peak = [], [], 0
        for _ in range(args.warmup + args.iters):
            cmd_q.put(("poison", None))
            _expect(res_q, "poisoned")
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            t = time.perf_counter()
            if with_register:
                reregister()
            ps.update("step", req)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
            peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
            oks.append(bool(_expect(res_q, "checked")))
        return times[args.warmup :], oks, peak

    results = {"checkpoint_engine": timed(False), "checkpoint_engine_with_register": timed(True)}

    a, b = torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, device=dev)
    floor = []
    for _ in range(args.warmup + args.iters):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dev)
        floor.append(time.perf_counter() - t)
    floor = floor[args.warmup :]
    del a, b
    cmd_q.put(("stop", None))
    proc.join(timeout=60)

    floor_s = statistics.median(floor)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    from refit.tools.bench.harness import device_kind

    command = "python -m bench.checkpoint_engine_s2 " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for method, (times, oks, peak) in results.items():
        med = statistics.median(times)
        rows.append(
            {
                "scenario": "S2",
                "method": method,
                "model": MODEL,
                "bytes": nbytes,
                "median_s": med,
                "min_s": min(times),
                "max_s": max(times),
                "n": len(times),
                "gbps": nbytes / med / 1e9,
                "floor_s": floor_s,
                "ratio_to_floor": med / floor_s,
                "peak_extra_bytes": peak,
                "growth_bytes": None,
                "correct": all(oks),
                "variant": "",
                "device": device_kind(),
                "command": command.strip(),
                "date": date,
                "first_register_s": first_register_s,
            }
        )
    rows.append(
        {
            "scenario": "S2",
            "method": "floor",
            "model": MODEL,
            "bytes": nbytes,
            "median_s": floor_s,
            "min_s": min(floor),
            "max_s": max(floor),
            "n": len(floor),
            "gbps": nbytes / floor_s / 1e9,
            "floor_s": floor_s,
            "ratio_to_floor": 1.0,
            "peak_extra_bytes": None,
            "growth_bytes": None,
            "correct": None,
            "variant": "copy",
            "device": device_kind(),
            "command": command.strip(),
            "date": date,
        }
    )
    for r in rows:
        print(
            f"S2 {r['method']:<34} median {r['median_s'] * 1e3:9.2f} ms  min {r['min_s'] * 1e3:9.2f}  "
            f"max {r['max_s'] * 1e3:9.2f}  x floor {r['ratio_to_floor']:7.2f}  peak extra "
            f"{(r['peak_extra_bytes'] or 0) / 2**20:8.0f} MiB  correct={r['correct']}"
        )
    print(f"first register_checkpoint (pins {nbytes / 1e9:.2f} GB of host memory): {first_register_s:.2f} s")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["correct"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
