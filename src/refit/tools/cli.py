"""``refit demo | plan | verify | soak | bench`` — the command line.

A user error (``refit.errors.USER_ERRORS``: a bad flag, spec, model, topology, layout or plan) prints one
line ``refit: error: <message>`` on stderr and exits with status 2; the message names the flag and the value
where one flag is to blame. Numeric flags are typed at parsing (``positive_int``, ``natural_int``,
``positive_float``: finite and in range), argparse's own errors are the same one line; flags that are
``TransferConfig`` fields are then checked by ``TransferConfig``, specs against the model by
``rules.check_spec_fits`` (the engine spec of ``plan`` and ``verify`` by ``engines.check_engine_fits`` for the
``--engine`` given), all before any process starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from refit.errors import USER_ERRORS, ConfigError, SpecError
from refit.layout import megatron as megatron_rules
from refit.layout.engines import ENGINES, check_engine_fits, engine_layout, engine_rules
from refit.layout.hf_names import num_layers
from refit.layout.models import PRESETS, load_config, param_shapes
from refit.layout.rules import check_spec_fits, layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import Plan, build_plan
from refit.tools.args import (
    CliParser,
    about_flag,
    buffer_flags,
    check_world,
    fraction,
    max_world_option,
    natural_int,
    positive_float,
    positive_int,
    transfer_config,
)
from refit.tools.bench_cli import add_bench_parser, cmd_bench
from refit.tools.cluster.command import add_cluster_parser, cmd_cluster
from refit.tools.quant_cli import add_quant_option, quant_fields, quant_flags, quant_label, quantized_layouts
from refit.transport.auth import secret_from_env


def _common(p: argparse.ArgumentParser, model_default: str | None = "tiny-llama") -> None:
    p.add_argument(
        "--model",
        default=model_default,
        required=model_default is None,
        help=f"preset ({', '.join(PRESETS)}) or path to an HF config.json",
    )
    p.add_argument(
        "--src",
        default="tp=2",
        help="trainer layout, keys pp,dp,fsdp,ep,etp,tp (default tp=2); prefix megatron: for Megatron-Core's storage",
    )
    p.add_argument("--dst", default="tp=1,dp=2", help="engine layout, keys dp,ep,tp (default tp=1,dp=2)")
    max_world_option(p)
    p.add_argument(
        "--src-ranks", type=positive_int, default=None, help="check the trainer spec against this many ranks"
    )
    p.add_argument("--dst-ranks", type=positive_int, default=None, help="check the engine spec against this many ranks")
    p.add_argument("--num-buffers", type=positive_int, default=2, help="staging buffers per process (default 2)")
    p.add_argument(
        "--buffer-mb", type=positive_float, default=64.0, help="size of one staging buffer in MiB (default 64)"
    )


def _fp8_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fp8",
        type=positive_int,
        nargs="?",
        const=128,
        default=None,
        metavar="BLOCK",
        help="the engine holds FP8 weights blockwise-quantized in BLOCK x BLOCK blocks (default 128), "
        "quantized by the trainer ranks before the wire",
    )
    add_quant_option(p)  # --quant mxfp8|nvfp4


def _parser() -> argparse.ArgumentParser:
    ap = CliParser(prog="refit", description="Weight refit between trainer and engine layouts.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a tiny model, refit after each step, compare logits")
    _common(d)
    d.add_argument("--steps", type=positive_int, default=3)
    _plan_parser(sub.add_parser("plan", help="print the transfer plan without running it (shapes only)"))
    _verify_parser(sub.add_parser("verify", help="run a real multi-process reshard on CPU and check every shard"))
    k = sub.add_parser("soak", help="many consecutive refits on CPU: memory, threads and process groups must not grow")
    _common(k)
    k.add_argument("--refits", type=positive_int, default=200)
    k.add_argument("--warmup", type=positive_int, default=20, help="refits before the baseline is taken")
    add_bench_parser(sub.add_parser("bench", help="time refit against today's methods (scenarios S1-S7)"))
    add_cluster_parser(sub)
    return ap


def engine_name(text: str) -> str:
    """argparse type: a name of ``engines.ENGINES``."""
    try:
        return engine_rules(text).name
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        type=engine_name,
        default="vllm",
        help=f"the engine whose padding and KV-head replication the engine layout follows ({', '.join(ENGINES)}; "
        "default vllm)",
    )


def _plan_parser(p: argparse.ArgumentParser) -> None:
    _common(p)
    _engine_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _fp8_option(p)
    p.add_argument(
        "--bandwidth", type=positive_float, default=370.0, help="link bandwidth in GB/s for the predicted time"
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="TOPOLOGY.json",
        help="predict refit time per strategy (broadcast, refit's p2p plan, fan-out waves) on this "
        "topology (nodes, gpus_per_node, nvlink_gbps, nics_per_node, nic_gbps, ...) instead of "
        "printing the plan",
    )
    p.add_argument("--colocated", action="store_true", help="with --cluster: engine ranks share the trainer's GPUs")
    p.add_argument(
        "--changed-fraction",
        type=fraction,
        default=None,
        metavar="F",
        help="with --cluster: also predict a delta refit where this fraction of the elements changed (0.01 = 1%%)",
    )
    p.add_argument(
        "--relay",
        type=positive_int,
        default=None,
        metavar="D",
        help="with --cluster and --dst dp > 1: also predict the fan-out as a pipelined relay, a tree of degree D "
        "(1: a chain; Fanout(relay=D))",
    )
    p.add_argument(
        "--nixl",
        choices=("auto", "stripe"),
        default=None,
        metavar="NIC_MODE",
        help="with --cluster: refit pulls through NIXL, its NICs picked as REFIT_NIC_MODE=NIC_MODE picks them "
        "(auto: the nearest, stripe: all); adds the nixl (with --changed-fraction also nixl-delta) rows, the path",
    )


def _verify_parser(v: argparse.ArgumentParser) -> None:
    _common(v)
    _engine_option(v)
    _fp8_option(v)
    v.add_argument(
        "--dump", default=None, metavar="DIR", help="write full.safetensors, dst_rank{r}.safetensors, layout.json"
    )
    v.add_argument("--seed", type=natural_int, default=0)
    v.add_argument(
        "--inject",
        default=None,
        metavar="MODE",
        help="kill-receiver | kill-sender | corrupt | swap | zero | shape-mismatch | slow-receiver: commit version 1, "
        "strike during version 2, exit 0 only if the fault is detected and handled",
    )
    v.add_argument(
        "--deadline", type=positive_float, default=10.0, help="with --inject: seconds a refit may take (default 10)"
    )


def _setup(args):
    """The two specs, the transfer settings and the model's shapes from the common flags."""
    with about_flag("--src"):
        src = parse_spec(_src_family(args.src)[1], "src")
    with about_flag("--dst"):
        dst = parse_spec(args.dst, "dst")
    check_world(f"--src {src}", src.world_size, args.max_world)  # before anything sized by the world
    check_world(f"--dst {dst}", dst.world_size, args.max_world)
    for flag, spec, ranks in (("--src-ranks", src, args.src_ranks), ("--dst-ranks", dst, args.dst_ranks)):
        if ranks is not None:
            with about_flag(flag):
                spec.check_world_size(ranks)
    cfg = transfer_config(**buffer_flags(args))
    with about_flag("--model"):  # read again for the shapes below; checked here so that its error names the flag
        config = load_config(args.model)
    shapes = param_shapes(args.model)
    n_layers = num_layers(n for n, _, _ in shapes)
    if src.degree("pp") > max(n_layers, 1):
        raise SpecError(f"--src {src}: pp={src.degree('pp')} exceeds the model's {n_layers} decoder layers")
    megatron = _src_family(args.src)[0] == megatron_rules.FAMILY
    with about_flag(f"--src {src}"):
        check_spec_fits(shapes, src, config, kv_replicas=megatron)
    with about_flag(f"--dst {dst}"):
        engine = getattr(args, "engine", None)
        if engine is None:
            check_spec_fits(shapes, dst, config)
        else:
            check_engine_fits(shapes, dst, config, engine)
    return src, dst, cfg, shapes


def _dst_layout(args, shapes, dst):
    """The engine's layout: as ``--engine`` allocates it (padding, replicated KV heads)."""
    return engine_layout(shapes, dst, load_config(args.model), args.engine)


def _src_family(text: str) -> tuple[str | None, str]:
    """``("megatron", "tp=2")`` for ``--src megatron:tp=2``; ``(None, text)`` without a family."""
    family, sep, rest = text.partition(":")
    if not sep:
        return None, text
    if family.strip() != megatron_rules.FAMILY:
        raise SpecError(f"unknown trainer family {family.strip()!r} in {text!r}; known: {megatron_rules.FAMILY}")
    return megatron_rules.FAMILY, rest


def _src_layout(args, shapes, src):
    """The trainer's layout: Megatron-Core's (``--src megatron:...``) or the generic DTensor rules'."""
    if _src_family(args.src)[0] == megatron_rules.FAMILY:
        return megatron_rules.megatron_layout(shapes, src, load_config(args.model))
    return layout_from_spec(shapes, src)


def _plan_json(plan: Plan, bandwidth: float) -> dict:
    return {
        "tensors": len(plan.dst_layout),
        "bytes_needed": plan.bytes_needed,
        "bytes_moved": plan.bytes_moved,
        "bytes_local": plan.bytes_local,
        "ratio": round(plan.ratio, 6),
        "digest": plan.digest,
        "links": {str(s): {str(d): b for d, b in row.items()} for s, row in plan.links.items()},
        "max_link_bytes": plan.max_link_bytes,
        "max_link_share": round(plan.max_link_bytes / plan.bytes_moved, 6) if plan.bytes_moved else 0.0,
        "messages": len(plan.messages),
        "steps": plan.num_steps,
        "bandwidth_gbps": bandwidth,
        "predicted_seconds": plan.predicted_seconds(bandwidth),
    }


def _cluster(args, console, topo, src, dst, shapes, src_l, dst_l, t0: float) -> int:
    import time

    from rich.table import Table

    from refit.cost import predict

    replicas = dst.degree("dp")
    if args.relay is not None and replicas < 2:
        raise ConfigError(f"--relay {args.relay} needs --dst with dp > 1 (replicas to relay to), got {dst}")
    one = None
    if replicas > 1:
        one = _dst_layout(args, shapes, dst.replica())
        _, one = _fp8(src_l, one, args)
    src_l, dst_l = _fp8(src_l, dst_l, args)
    if replicas > 1:  # the fan-out rows plan every wave as Fanout does: long for a large model
        print(
            f"refit plan: planning the fan-out waves to {replicas} replicas as Fanout would "
            f"({dst_l.nbytes / 1e9:.1f} GB; tens of seconds for a model of hundreds of GB)",
            file=sys.stderr,
            flush=True,
        )
    preds = predict(
        src_l,
        dst_l,
        topo,
        replicas=replicas,
        replica_dst=one,
        colocated=args.colocated,
        changed_fraction=args.changed_fraction,
        nixl_nic_mode=args.nixl,
        relay=args.relay or 0,
    )
    build_s = time.perf_counter() - t0
    path = ("nixl" if args.nixl else "p2p") + ("-delta" if args.changed_fraction is not None else "")
    path = {"p2p-delta": "delta"}.get(path, path)  # the row refit runs with these flags
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "src": str(src),
                    "dst": str(dst),
                    "topology": topo.describe(),
                    "bytes_needed": dst_l.nbytes,
                    "plan_seconds": build_s,
                    "path": path,
                    "predictions": [p.__dict__ for p in preds],
                }
            )
        )
        return 0
    console.print(
        f"model {args.model}: trainer {src} ({src.world_size} GPUs) -> engine {dst} ({dst.world_size} GPUs"
        f"{', colocated' if args.colocated else ''}); {dst_l.nbytes / 1e9:.1f} GB per replica"
        f"{' (FP8 weights + scales)' if args.fp8 else ''}"
    )
    console.print(f"topology {topo.name}: {topo.describe()}")
    table = Table(title="predicted refit time (bottleneck model, refit.cost)")
    for col in ("strategy", "seconds", "busiest resource", "its GB", "how"):
        table.add_column(col)
    for p in preds:
        name = f"{p.strategy} (path)" if p.strategy == path else p.strategy
        table.add_row(name, f"{p.seconds:.3f}", p.busiest, f"{p.busiest_bytes / 1e9:.1f}", p.note)
    console.print(table)
    console.print(f"plans built in {build_s:.1f} s")
    return 0


def cmd_plan(args, console) -> int:
    import time

    from rich.table import Table

    if args.changed_fraction is not None and not args.cluster:
        raise ConfigError(f"--changed-fraction {args.changed_fraction:g} needs --cluster (it adds a delta prediction)")
    if args.nixl is not None and not args.cluster:
        raise ConfigError(f"--nixl {args.nixl} needs --cluster (it adds the NIXL predictions)")
    if args.relay is not None and not args.cluster:
        raise ConfigError(f"--relay {args.relay} needs --cluster (it adds the relay's prediction)")
    topo = None
    if args.cluster:  # read first: a bad file is refused before the model's shapes are built
        from refit.cost import Topology

        with about_flag("--cluster"):
            topo = Topology.from_json(args.cluster)
    src, dst, cfg, shapes = _setup(args)
    t0 = time.perf_counter()  # plan building starts here: shapes are given
    src_l, dst_l = _src_layout(args, shapes, src), _dst_layout(args, shapes, dst)
    if args.cluster:
        return _cluster(args, console, topo, src, dst, shapes, src_l, dst_l, t0)

    src_l, dst_l = _fp8(src_l, dst_l, args)
    plan = build_plan(src_l, dst_l, config=cfg)
    info = _plan_json(plan, args.bandwidth)
    fp8 = quant_label(args, "; ")
    if args.json:
        head = {"model": args.model, "src": str(src), "dst": str(dst), "engine": args.engine, **quant_fields(args)}
        layouts = {"src_layout": plan.src_layout.to_json(), "dst_layout": plan.dst_layout.to_json()}  # refit.layout/1
        print(json.dumps({**head, **info, **layouts}))
        return 0
    console.print(
        f"model {args.model}: {info['tensors']} tensors; trainer {src} ({src.world_size} ranks) "
        f"-> engine {dst} ({dst.world_size} ranks, {args.engine}){fp8}"
    )
    console.print(f"bytes destinations need : {plan.bytes_needed:>16,}")
    console.print(f"bytes moved over links  : {plan.bytes_moved:>16,}")
    console.print(f"moved/needed            : {plan.ratio:>16.2f}")
    table = Table(title="bytes per link (source rank -> destination rank)")
    table.add_column("src \\ dst")
    for d in range(dst.world_size):
        table.add_column(str(d), justify="right")
    for s in range(src.world_size):
        row = plan.links.get(s, {})
        table.add_row(str(s), *[f"{row.get(d, 0):,}" for d in range(dst.world_size)])
    console.print(table)
    console.print(f"largest link: {plan.max_link_bytes:,} bytes ({info['max_link_share']:.1%} of moved)")
    console.print(
        f"messages: {len(plan.messages)} in {plan.num_steps} steps, buffers {cfg.num_buffers} x {args.buffer_mb:g} MiB"
    )
    console.print(f"predicted time at {args.bandwidth:g} GB/s per process: {info['predicted_seconds'] * 1e3:.2f} ms")
    console.print(f"digest {plan.digest}")
    return 0


def _fp8(src_l, dst_l, args):
    return quantized_layouts(src_l, dst_l, args)  # --fp8 or --quant (tools/quant_cli.py)


def cmd_verify(args, console) -> int:
    from refit.tools.eplb_cli import verify_with_map as verify  # tools.verify's, or --expert-map's
    from refit.tools.verify import check_dump

    src, dst, cfg, shapes = _setup(args)
    src_l, dst_l = _src_layout(args, shapes, src), _dst_layout(args, shapes, dst)
    if args.inject is not None:
        for flag, given in (*quant_flags(args), ("--dump", args.dump)):  # --fp8, --quant, --expert-map
            if given is not None:
                raise ConfigError(f"--inject and {flag} together are not supported (inject faults into a plain refit)")
        return _verify_inject(args, src, dst, src_l, dst_l, cfg, console)
    if args.dump is not None:
        with about_flag("--dump"):
            check_dump(args.dump, dst.world_size)
    _fp8(src_l, dst_l, args)  # block alignment errors as usage errors, before any process starts
    fp8 = quant_label(args, ", engine ")
    console.print(
        f"verify {args.model}: trainer {src} ({src.world_size} ranks) -> engine {dst} ({dst.world_size} ranks)"
        f"{fp8} on CPU gloo ..."
    )
    res = verify(src_l, dst_l, config=cfg, seed=args.seed, dump=args.dump, **quant_fields(args, verify=True))
    for m in res.mismatches[:20]:
        console.print(f"MISMATCH {m}")
    if args.dump:
        console.print(f"dumped to {args.dump}")
    print(("" if res.ok else f"FAIL: {len(res.mismatches)} mismatching shards; ") + res.summary(), flush=True)
    return 0 if res.ok else 1


def _verify_inject(args, src, dst, src_l, dst_l, cfg, console) -> int:
    from refit.tools.faults import MODES, inject, plain_error
    from refit.tools.resources import check_memory
    from refit.tools.verify import verify_bytes

    if args.inject not in MODES:
        raise ConfigError(f"--inject must be one of {', '.join(MODES)}, got {args.inject!r}")
    check_memory(
        verify_bytes(src_l, src_l, dst_l, None), f"verify --inject on {src.world_size + dst.world_size} processes"
    )
    cfg = transfer_config(cfg, deadline_s=("--deadline", f"{args.deadline:g}", args.deadline))
    cfg = replace(cfg, buffer_bytes=min(cfg.buffer_bytes, 64 << 10))  # many steps: the fault lands mid-transfer
    plan_steps = build_plan(src_l, dst_l, config=cfg).num_steps
    console.print(
        f"verify --inject {args.inject}: trainer {src} -> engine {dst}, deadline {args.deadline:g}s, "
        f"commit staged, checksums on, buffers {cfg.num_buffers} x {cfg.buffer_bytes >> 10} KiB "
        f"({plan_steps} steps); version 1 clean, the fault half way through version 2 ..."
    )
    res = inject(src_l, dst_l, args.inject, deadline_s=cfg.deadline_s, seed=args.seed, config=cfg)
    for p, r in enumerate(res.rows):
        if r is None:
            console.print(f"  process {p}: died (the injected fault)", markup=False)
        else:
            console.print(
                f"  process {p} ({r['role']} rank {r['rank']}): after {r['elapsed_s']:.2f}s: "
                f"{plain_error(r['error']) if r['error'] else 'no error'}; version {r['version']}"
                + ("" if r["v1_exact"] is None else f", v1 bit-exact: {r['v1_exact']}"),
                markup=False,
            )
    print(res.last_line(), flush=True)
    return 0 if not res.problems() else 1


def cmd_soak(args, console) -> int:
    from refit.tools.soak import soak

    src, dst, cfg, shapes = _setup(args)
    if not 1 <= args.warmup < args.refits:
        raise ConfigError(f"need 1 <= --warmup < --refits, got --warmup {args.warmup}, --refits {args.refits}")
    console.print(f"soak {args.model}: trainer {src} -> engine {dst}, {args.refits} refits on CPU gloo ...")
    res = soak(_src_layout(args, shapes, src), layout_from_spec(shapes, dst), args.refits, args.warmup, cfg)
    for p, r in enumerate(res.rows):
        console.print(
            f"  process {p} ({r['role']} rank {r['rank']}): RSS {r['rss_warm'] / 2**20:.1f} -> "
            f"{r['rss_end'] / 2**20:.1f} MiB ({r['rss_end'] / r['rss_warm'] - 1:+.2%}), threads "
            f"{r['threads_warm']} -> {r['threads_end']}, process groups {r['groups_warm']} -> {r['groups_end']}, "
            f"{r['seconds'] / args.refits * 1e3:.2f} ms/refit"
            + ("" if r["exact"] is None else f", last refit exact: {r['exact']}")
            + (f", refit threads left after close: {r['refit_threads_closed']}" if r["refit_threads_closed"] else ""),
            markup=False,
        )
    unchanged = all(r["threads_end"] == r["threads_warm"] and r["groups_end"] == r["groups_warm"] for r in res.rows)
    print(
        f"{'PASS' if res.ok else 'FAIL'}: {args.refits} refits (baseline after {args.warmup}); worst RSS growth "
        f"{res.worst_rss_growth:+.2%} (limit +5%); threads and process groups {'unchanged' if unchanged else 'GREW'}",
        flush=True,
    )
    return 0 if res.ok else 1


def cmd_demo(args, console) -> int:
    from refit.tools.demo import run_demo

    src, dst, cfg, _ = _setup(args)
    ok = run_demo(args.model, src, dst, args.steps, cfg, console)
    print(
        "PASS: every engine replica matches the trainer bit for bit"
        if ok
        else "FAIL: engine logits differ from the trainer's",
        flush=True,
    )
    return 0 if ok else 1


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error prints ``refit: error: <one line>`` on stderr and returns 2."""
    from rich.console import Console

    console = Console(stderr=False, highlight=False)
    try:
        args = _parser().parse_args(argv)
        if args.cmd not in ("plan", "cluster"):  # a job's secret (REFIT_SECRET / _FILE) checked before any process
            secret_from_env()
        command = {"plan": cmd_plan, "verify": cmd_verify, "demo": cmd_demo, "bench": cmd_bench, "soak": cmd_soak}
        command["cluster"] = cmd_cluster
        return command[args.cmd](args, console)
    except USER_ERRORS as e:
        print(f"refit: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
