"""``refit bench``'s flags and command: the scenarios, methods and engine formats chosen and checked (worlds within
``--max-world``, each device's weights within what it has) before any process starts, then the harness
(``refit.tools.bench``) runs them and prints the table."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout.models import load_config, param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.args import (
    about_flag,
    buffer_flags,
    check_world,
    max_world_option,
    natural_int,
    positive_float,
    positive_int,
    transfer_config,
)


def add_bench_parser(b: argparse.ArgumentParser) -> None:
    b.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if GPUs are present")
    b.add_argument("--model", default=None, help="default: llama-3.1-8b on cuda, tiny-llama on cpu")
    b.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated (S1-S3 need 2 GPUs, S4-S6 4, S6x7 and S7 8; S7 is the MoE "
        "scenario, with --model qwen3-30b-a3b); default: all this machine can run",
    )
    b.add_argument(
        "--methods",
        default=None,
        help="comma-separated: run only these methods (and floor) of each scenario, e.g. refit,refit_nixl",
    )
    b.add_argument("--warmup", type=natural_int, default=2)
    b.add_argument(
        "--iters", type=positive_int, default=5, help="timed refits per method (refit itself runs --growth-iters)"
    )
    b.add_argument("--growth-iters", type=positive_int, default=20, help="consecutive refits of refit's own path")
    b.add_argument("--num-buffers", type=positive_int, default=2)
    b.add_argument("--buffer-mb", type=positive_float, default=256.0)
    b.add_argument(
        "--deadline-s",
        type=positive_float,
        default=TransferConfig.deadline_s,
        help="refit's methods: every blocking wait of one refit gives up this long after it began "
        f"(default {TransferConfig.deadline_s:g})",
    )
    b.add_argument(
        "--copy-streams",
        type=positive_int,
        default=TransferConfig.copy_streams,
        help="CUDA IPC: streams per source GPU a receiver pulls on",
    )
    b.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="CUDA IPC: issue a pull's copies one by one instead of replaying a CUDA graph",
    )
    b.add_argument(
        "--stages",
        type=positive_int,
        default=1,
        help="all-IPC plans: pull in this many stages, so the trainer's FP8 quantization of stage i+1 "
        "overlaps the pull of stage i (default 1)",
    )
    b.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 engine (128x128 blocks): trainer ranks quantize before every refit; "
        "methods refit, fp8_quantize, floor",
    )
    b.add_argument(
        "--quant",
        default=None,
        metavar="FMT[,FMT]",
        help="MXFP8 / NVFP4 engines (mxfp8,nvfp4; beside --fp8 in the same run): trainer ranks quantize before "
        "every refit; methods refit, quantize, floor, floor_read_copy (one read of the bf16 weights + the copy)",
    )
    b.add_argument("--out", default=None, help="JSON records, default bench/results/<device-kind>.json")
    max_world_option(b)


def cmd_bench(args, console) -> int:
    import os
    import shlex

    import torch

    from refit.tools.bench import harness
    from refit.tools.bench.scenarios import parse_formats

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if args.model is not None:
        with about_flag("--model"):
            load_config(args.model)
    model = args.model or ("llama-3.1-8b" if device == "cuda" else "tiny-llama")
    cfg = transfer_config(
        TransferConfig(cuda_graph=not args.no_cuda_graph),
        **buffer_flags(args),
        copy_streams=("--copy-streams", args.copy_streams, args.copy_streams),
        stages=("--stages", args.stages, args.stages),
        deadline_s=("--deadline-s", f"{args.deadline_s:g}", args.deadline_s),
    )
    out = args.out or os.path.join("bench", "results", f"{harness.device_kind() if device == 'cuda' else 'cpu'}.json")
    command = "refit " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "refit bench"
    opts = harness.BenchOptions(
        device=device,
        model=model,
        scenarios=tuple(args.scenarios.split(",")) if args.scenarios else (),  # (): all this machine can run
        warmup=args.warmup,
        iters=args.iters,
        growth_iters=args.growth_iters,
        config=cfg,
        out_path=out,
        command=command,
        methods=tuple(args.methods.split(",")) if args.methods else (),
    )
    with about_flag("--quant"):
        opts = replace(opts, formats=parse_formats(args.fp8, args.quant))
    with about_flag("--scenarios"):
        opts = replace(opts, scenarios=tuple(harness.chosen_scenarios(opts)))
    with about_flag("--methods"):
        harness.check_methods(opts)
    with about_flag("--quant" if args.quant else "--fp8"):
        harness.check_formats(opts)
    check_bench_memory(opts, args.max_world)
    rows = harness.run_bench(opts, console)
    harness.print_table(rows, console)
    console.print(f"records written to {out}")
    bad = [r for r in rows if r["correct"] is False]
    if bad:
        print(f"FAIL: {len(bad)} method(s) produced wrong engine weights", flush=True)
        return 1
    return 0


def check_bench_memory(opts, max_world: int) -> None:
    """Every chosen scenario's world within ``--max-world`` and the weights its processes hold within
    what each of its devices has available: refused before any process allocates (``ConfigError``)."""
    from refit.tools.bench import harness
    from refit.tools.resources import check_devices, rank_bytes

    shapes, every = param_shapes(opts.model), harness.scenarios(opts.device)
    for scen in (every[name] for name in opts.scenarios):
        src, dst = parse_spec(scen.src, "src"), parse_spec(scen.dst, "dst")
        check_world(f"scenario {scen.name} --src {src}", src.world_size, max_world)
        check_world(f"scenario {scen.name} --dst {dst}", dst.world_size, max_world)
        layouts = [layout_from_spec(shapes, src)] * src.world_size + [layout_from_spec(shapes, dst)] * dst.world_size
        ranks = [*range(src.world_size), *range(dst.world_size)]
        need: dict[str, int] = {}
        for device, layout, rank in zip(scen.devices, layouts, ranks):
            need[device] = need.get(device, 0) + rank_bytes(layout, rank)
        check_devices(need, f"refit bench scenario {scen.name} with --model {opts.model}")
