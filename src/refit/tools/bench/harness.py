"""``refit bench``: every method of a scenario timed in the same processes, JSON records.

Per method: setup (not timed), then ``warmup`` + ``iters`` refits; before each
the engine's tensors are poisoned (NaN), after each they are compared bit for
bit with the reference weights, regenerated tensor by tensor on the device
(no second copy of the model is held, so 60 GB models fit). With an engine
format (``BenchOptions.formats``: ``fp8``, ``mxfp8``, ``nvfp4``; a scenario
per format, rows ``<S>-<format>``) the engine holds quantized weights and
scales: the trainer ranks quantize their bf16 shards before every refit (timed
as part of it, overlapped with the pulls of earlier stages when ``--stages`` >
1; ``refit_1stage`` quantizes everything first; ``fp8_quantize`` /
``quantize`` time the quantization alone; an NVFP4 engine's ``refit`` is timed
again as ``refit_amax``, the trainer handing each weight's ``max |x|`` over
outside the timed span, ``MxQuantizer.set_amax``) and the check quantizes each whole
reference tensor with the torch path (``refit.quant.fp8`` / ``refit.quant.mx``),
not the trainer's Triton kernels. Such a scenario on one GPU has a second
floor, ``floor_read_copy`` (issue 52's): one read of the quantized tensors'
bf16 bytes plus the copy of the plan's bytes, at the bandwidth the floor's
copy reached (a copy of n bytes moves 2n, a read n). Time per refit: the slowest
process's time from a shared-memory barrier (all processes released within
microseconds) to its device being synchronized. The scenarios are
``scenarios``'s; the floor each time is divided by is ``floor``'s.
Peak extra memory: ``torch.cuda.max_memory_allocated`` over the memory held
before the method's setup, the largest over the processes. Memory growth: the
allocated memory after the last refit minus after the last warm-up one (a quantizer records its CUDA graphs,
once, at its second refit).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout import LayoutError, box_slices
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.quant import Fp8Quantizer, fp8_layout, quantize_fp8_block, quantized_names, scale_name
from refit.quant.mx_layout import block_scale_name, global_scale_name, mx_format, mx_layout, mx_names
from refit.quant.mx_quantizer import MxQuantizer, expected_mx, shared_scale_2
from refit.tools.launch import World, run_local
from refit.transport.host_barrier import HostBarrier

from . import methods as M
from .floor import engine_floor, floor_setup
from .scenarios import Scenario, installed, only_methods, quant_scenario, scenarios
from .weights import make_weight, poison

GiB = 1 << 30


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_runs(
    barrier, dev, run, iters, before=None, after=None, base=0, stamps=None
) -> tuple[list[float], list[bool], list[int], int]:
    """Times, checks, allocated memory after each refit, and the peak over ``base`` during the refits
    (the checker's temporaries excluded). ``stamps`` (profiling): a refit's ``Executor.stamps``, to which the
    timed span's ends are added ("t0", "synced")."""
    times, oks, mems, peak = [], [], [], 0
    cuda = dev.type == "cuda"
    for _ in range(iters):
        if before:
            before()
        _sync(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        barrier.wait()  # shared memory: every process starts within microseconds
        t0 = time.perf_counter()
        if stamps is not None:
            stamps.append(("t0", t0))
        run()
        _sync(dev)
        dt = time.perf_counter() - t0
        if stamps is not None:
            stamps.append(("synced", t0 + dt))
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
        barrier.wait()  # every writer is done (some write into other processes' memory)
        oks.append(after() if after else True)
        times.append(dt)
        mems.append(torch.cuda.memory_allocated(dev) if cuda else 0)
    return times, oks, mems, peak


def _fp8_reference(t, box, scale_box, dev) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = quantize_fp8_block(make_weight(t.name, t.shape, t.dtype, dev))
    return q[box_slices(box)], scales[box_slices(scale_box)]


def _plain_reference(t, box, dev) -> tuple[torch.Tensor]:
    return (make_weight(t.name, t.shape, t.dtype, dev)[box_slices(box)],)


def _mx_reference(t, fmt, boxes, s2, names, dev) -> tuple[torch.Tensor, ...]:
    got = expected_mx(make_weight(t.name, t.shape, t.dtype, dev), fmt, boxes, t.name, s2)
    return tuple(got[n] for n in names)


def _mx_scale_2(plain, names: list[str], dev) -> dict[str, torch.Tensor]:
    """NVFP4's agreed ``weight_scale_2`` of each of ``names`` from the whole reference tensors (one at a time)."""
    amax = {n: make_weight(n, plain[n].shape, plain[n].dtype, dev).abs().float().amax(dim=(-2, -1)) for n in names}
    return shared_scale_2(amax)


def _expected_mx(plain, dst_l, rank: int, dev, fmt_name: str) -> dict:
    """``_expected`` of an MXFP8 / NVFP4 engine (``expected_mx``: the torch path on the device)."""
    fmt = mx_format(fmt_name)
    boxes = {t.name: b for t, b in dst_l.local_tensors(rank)}
    quantized = mx_names(dst_l, fmt)
    s2 = _mx_scale_2(plain, quantized, dev) if fmt.global_scale else {}
    out = {}
    for name in quantized:
        if name not in boxes:
            continue
        parts = [n for n in (name, block_scale_name(name), global_scale_name(name)) if n in boxes]
        make = partial(_mx_reference, plain[name], fmt, boxes, s2.get(name), parts, dev)
        out.update({n: (make, i) for i, n in enumerate(parts)})
    for name, box in boxes.items():
        if name not in out:
            out[name] = (partial(_plain_reference, dst_l[name], box, dev), 0)
    return out


def _expected(plain, dst_l, rank: int, dev, quant: str | None):
    """name -> (make, i): ``make()[i]`` is what engine ``rank`` must hold there (made on demand, freed after;
    a quantized weight and its scales share one ``make``)."""
    if quant not in (None, "fp8"):
        return _expected_mx(plain, dst_l, rank, dev, quant)
    boxes = {t.name: b for t, b in dst_l.local_tensors(rank)}
    quantized = set(quantized_names(dst_l)) if quant else set()
    out = {}
    for name, box in boxes.items():
        if name in quantized:
            make = partial(_fp8_reference, plain[name], box, boxes[scale_name(name)], dev)
            out[name] = (make, 0)
            out[scale_name(name)] = (make, 1)
        elif name not in out:
            out[name] = (partial(_plain_reference, dst_l[name], box, dev), 0)
    return out


def _check(dst: dict[str, torch.Tensor], expected) -> bool:
    done: dict[int, tuple] = {}
    ok = True
    for name, (make, i) in expected.items():
        key = id(make)
        if key not in done:
            done.clear()  # keep one tensor's reference at a time
            done[key] = make()
        ok &= torch.equal(dst[name].reshape(-1).view(torch.uint8), done[key][i].reshape(-1).view(torch.uint8))
    return ok


@dataclass
class _Process:
    """One process's share of a scenario: the methods' context, the host barrier, and for an engine
    process what its tensors are poisoned with before a refit and checked against after it."""

    ctx: M.Ctx
    barrier: HostBarrier
    quantizer: Fp8Quantizer | MxQuantizer | None
    poison: Callable[[], None] | None
    check: Callable[[], bool] | None


def _quantizer(quant: str, src_l, rank: int, src: dict, group) -> Fp8Quantizer | MxQuantizer:
    if quant == "fp8":
        return Fp8Quantizer(src_l, rank, src)
    return MxQuantizer(src_l, rank, src, mx_format(quant), group=group)


def _local_tensors(world: World, n_src: int, plain_src, src_l, dst_l, quant: str | None, group=None):
    """A trainer's shards (a quantized engine: the quantizer's copies, which travel; ``group``: the trainer
    ranks', where NVFP4 agrees on its global scales) or an engine's empty tensors and what they must hold.
    Returns (src, dst, expected, quantizer), None where the role has none."""
    dev = world.device
    src = dst = expected = quantizer = None
    if world.rank < n_src:
        r = world.rank
        src = {}
        for t, box in plain_src.local_tensors(r):
            src[t.name] = make_weight(t.name, t.shape, t.dtype, dev)[box_slices(box)].clone()
        if quant:  # the trainer keeps its bf16 shards; the quantizer's copies are what travels
            quantizer = _quantizer(quant, src_l, r, src, group)
            src = quantizer.tensors
    else:
        r = world.rank - n_src
        dst = {
            t.name: torch.empty(tuple(b - a for a, b in box), dtype=t.dtype, device=dev)
            for t, box in dst_l.local_tensors(r)
        }
        expected = _expected(plain_src, dst_l, r, dev, quant)
    return src, dst, expected, quantizer


def _setup_process(world: World, scen: Scenario, opts: BenchOptions) -> _Process:
    """Layouts, the plan (transport "auto"), the host barrier, the groups and this process's tensors."""
    dev, cfg = world.device, opts.config
    shapes = param_shapes(opts.model)
    src_spec, dst_spec = parse_spec(scen.src, "src"), parse_spec(scen.dst, "dst")
    plain_src, plain_dst = layout_from_spec(shapes, src_spec), layout_from_spec(shapes, dst_spec)
    src_l, dst_l = plain_src, plain_dst
    if scen.quant == "fp8":
        src_l, dst_l = fp8_layout(plain_src), fp8_layout(plain_dst, side="destination")
    elif scen.quant:
        src_l, dst_l = mx_layout(plain_src, scen.quant), mx_layout(plain_dst, scen.quant, side="destination")
    procs = ProcessMap.disjoint(src_spec.world_size, dst_spec.world_size).with_devices(scen.devices)
    plan = build_plan(src_l, dst_l, procs, replace(cfg, transport="auto"))
    store = world.store
    barrier = HostBarrier.agree(store, "bench/barrier", world.rank, world.world_size, timeout_s=600)
    trainer_nccl = None
    if dev.type == "cuda" and len(set(scen.devices[: src_spec.world_size])) == src_spec.world_size > 1:
        trainer_nccl = dist.new_group(list(range(src_spec.world_size)), backend="nccl")
    nccl = world.data_group if dev.type == "cuda" else dist.group.WORLD
    n_src = src_spec.world_size
    agree = dist.new_group(list(range(n_src))) if scen.quant == "nvfp4" and n_src > 1 else None  # every process
    src, dst, expected, quantizer = _local_tensors(world, n_src, plain_src, src_l, dst_l, scen.quant, agree)
    _sync(dev)
    ctx = M.Ctx(world.rank, dev, plan, src, dst, nccl, list(range(world.world_size)), trainer_nccl, store, cfg)
    ctx.extra["prepare"] = quantizer
    if "refit_fanout" in scen.methods:  # engine rank r is process n_src + r
        n_src = src_spec.world_size
        ctx.extra["fanout"] = (
            layout_from_spec(shapes, dst_spec.replica()),
            [[n_src + r for r in ranks] for ranks in dst_spec.replica_ranks()],
            scen.devices,
        )
    engine = dst is not None
    return _Process(
        ctx,
        barrier,
        quantizer,
        partial(poison, dst) if engine else None,
        partial(_check, dst, expected) if engine else None,
    )


def _method_setups(quantizer: Fp8Quantizer | MxQuantizer | None) -> dict[str, Callable[[M.Ctx], Callable[[], None]]]:
    """Method name -> ``setup(ctx) -> run``."""
    return {
        "refit": M.refit_method("auto"),
        "refit_nccl": M.refit_method("p2p"),
        "refit_nixl": M.refit_method("nixl"),
        "refit_checksums": M.refit_method("auto", checksums=True),
        "refit_1stage": M.refit_method("auto", stages=1),
        "refit_fanout": M.refit_fanout,
        "per_tensor_broadcast": M.per_tensor_broadcast,
        "packed_broadcast_1buf": M.packed_broadcast(1, 1 * GiB),
        "packed_broadcast_2buf": M.packed_broadcast(2, 1 * GiB),
        "gather_then_slice": M.gather_then_slice,
        "refit_amax": _refit_amax(quantizer),
        "fp8_quantize": lambda c: quantizer or (lambda: None),
        "quantize": lambda c: quantizer or (lambda: None),
    }


def _refit_amax(quantizer) -> Callable[[M.Ctx], Callable[[], None]]:
    """NVFP4: ``refit`` with each weight's ``max |x|`` handed over by the trainer (``MxQuantizer.set_amax``,
    outside the timed span: read once at setup, as a trainer's optimizer step would produce it), so the
    agreement reads no weight."""
    base = M.refit_method("auto")

    def setup(ctx: M.Ctx) -> Callable[[], None]:
        run = base(ctx)
        if isinstance(quantizer, MxQuantizer) and quantizer.fmt.global_scale:
            amax = quantizer.read_amax()
            run.before = lambda: quantizer.set_amax(amax)
        return run

    return setup


def _methods(scen: Scenario) -> tuple[str, ...]:
    """``scen``'s methods; an NVFP4 engine's ``refit`` is also timed as ``refit_amax`` (the trainer's amax)."""
    extra = ("refit_amax",) if scen.quant == "nvfp4" and "refit" in scen.methods else ()
    return tuple(scen.methods) + extra


QUANTIZE_ONLY = ("fp8_quantize", "quantize")  # the quantization alone: nothing reaches the engine to check


def _settle(dev: torch.device) -> int:
    """Between methods: every process idle, CUDA caches emptied; returns the memory held now (the base)."""
    _sync(dev)
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _time_floor(proc: _Process, scen: Scenario, opts: BenchOptions) -> list[dict]:
    """Every floor variant any process has, timed; the record of the fastest (by median), ``floor``."""
    ctx = proc.ctx
    variants = floor_setup(ctx, scen) if ctx.src is not None else engine_floor(ctx, scen)
    names = sorted(set(dist_all(variants.keys())))
    best = None
    for v in names:
        run = variants.get(v, lambda: None)
        times, _, _, _ = _time_runs(proc.barrier, ctx.device, run, opts.warmup + opts.iters)
        rec = {"variant": v, "times": gather_max(times[opts.warmup :])}
        if best is None or statistics.median(rec["times"]) < statistics.median(best["times"]):
            best = rec
    return [_floor_record("floor", best)]


def _floor_record(method: str, rec: dict | None) -> dict:
    return {
        "method": method,
        "times": rec["times"] if rec else [],
        "variant": rec["variant"] if rec else "",
        "correct": None,
        "peak_extra_bytes": None,
        "growth_bytes": None,
    }


def _print_ipc_profile(scen: Scenario, rank: int, run) -> None:
    puller = run.peer.executor.puller if isinstance(run, M.RefitRun) else None
    if puller is not None:
        print(
            f"[{scen.name} rank {rank}] ipc profile: "
            + ", ".join(
                f"{k}: {c} copies {b / 1e9:.2f} GB {s * 1e3:.2f} ms ({b / s / 1e9:.0f} GB/s)"
                for k, (c, b, s) in puller.profile().items()
            ),
            flush=True,
        )


def _print_phases(label: str, rank: int, run, warmup: int) -> None:
    """The median host time from one stamped phase of a refit to the next (``Executor.stamps``), after warm-up."""
    stamps = run.peer.executor.stamps if isinstance(run, M.RefitRun) else None
    if not stamps:
        return
    runs = [[]]
    first = stamps[0][0]  # "t0" (the bench's timed span) or the executor's "start"
    for what, at in stamps:
        if what == first and runs[-1]:
            runs.append([])
        runs[-1].append((what, at))
    gaps: dict[str, list[float]] = {}
    for r in runs[warmup:]:
        for (_, a), (what, b) in zip(r, r[1:]):
            gaps.setdefault(what, []).append(b - a)
    print(
        f"[{label} rank {rank}] phases (median ms from the previous stamp): "
        + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in gaps.items()),
        flush=True,
    )


def _time_method(proc: _Process, scen: Scenario, method: str, setup, base: int, opts: BenchOptions) -> dict:
    """``method``'s refits timed (refit itself runs ``growth_iters``), checked bit for bit (except
    ``QUANTIZE_ONLY``), with the peak extra and the grown memory over every process."""
    ctx, dev = proc.ctx, proc.ctx.device
    run = setup(ctx)
    n = opts.warmup + (opts.growth_iters if method == "refit" else opts.iters)
    checked = method not in QUANTIZE_ONLY
    profiled = method.startswith("refit") and dev.type == "cuda" and bool(os.environ.get("REFIT_BENCH_PROFILE"))
    if profiled and isinstance(run, M.RefitRun):
        run.peer.executor.stamps = []  # each refit's phases (``Executor.stamps``)
    stamps = run.peer.executor.stamps if profiled and isinstance(run, M.RefitRun) else None
    poison, pre = proc.poison if checked else None, getattr(run, "before", None)  # pre: untimed, on trainers
    before = (lambda: [f() for f in (poison, pre) if f]) if pre else poison
    times, oks, mems, peak = _time_runs(
        proc.barrier, dev, run, n, before, proc.check if checked else None, base, stamps
    )
    if profiled:
        _print_phases(f"{scen.name} {method}", ctx.rank, run, opts.warmup)
        _print_ipc_profile(scen, ctx.rank, run)
    times = gather_max(times[opts.warmup :])
    all_ok = dist_all([all(oks)])
    peaks = dist_all([peak])
    growth = dist_all([mems[-1] - mems[opts.warmup - 1 if 0 < opts.warmup < n else 0]])  # after the warm-up
    record = {
        "method": method,
        "times": times,
        "correct": all(all_ok) if checked else None,
        "peak_extra_bytes": max(peaks),
        "growth_bytes": max(growth),
        "variant": "",
    }
    dist.barrier()  # nobody still pulls from this method's buffers
    if hasattr(run, "close"):
        run.close()
    return record


def _bench_worker(world: World, scen: Scenario, opts: BenchOptions):
    """One process of a scenario: every method in turn; process 0 returns the records and the plan's bytes."""
    proc = _setup_process(world, scen, opts)
    setups = _method_setups(proc.quantizer)
    records = []
    for round_, method in enumerate(_methods(scen)):
        proc.ctx.extra["round"] = round_
        base = _settle(world.device)
        if method == "floor":
            records += _time_floor(proc, scen, opts)
        else:
            records.append(_time_method(proc, scen, method, setups[method], base, opts))
    dist.barrier()
    proc.barrier.close()
    plan = proc.ctx.plan
    jobs = proc.quantizer.jobs if proc.quantizer is not None else []
    read = sum(dist_all([sum(job[1].numel() * job[1].element_size() for job in jobs)]))  # the bf16 bytes quantized
    if world.rank != 0:
        return None
    return {
        "read_bytes": read,
        "records": records,
        "bytes": plan.bytes_moved + plan.bytes_local,
        "bytes_moved": plan.bytes_moved,
        "bytes_same_device": plan.bytes_same_device,
        "digest": plan.digest,
    }


def dist_all(items) -> list:
    """Every process's items, flattened (over the gloo world)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


def gather_max(times: list[float]) -> list[float]:
    """Per refit, the slowest process's time."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, times)
    return [max(col) for col in zip(*out)]


def device_kind() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    chip = "h200" if "h200" in name else "h100" if "h100" in name else name.replace(" ", "-")
    n = torch.cuda.device_count()
    return f"nvidia-{chip}" + (f"-x{n}" if n > 1 else "")


@dataclass(frozen=True)
class BenchOptions:
    """One ``refit bench`` run: where, which model and scenarios, how many refits, with which settings.

    ``scenarios`` empty: every scenario this machine can run. Each method runs ``warmup`` untimed refits,
    then ``iters`` timed ones (refit itself ``growth_iters``, to see its memory stay flat). ``formats``: every
    scenario runs once per engine format (``scenarios.QUANT_FORMATS``; methods ``FP8_METHODS`` /
    ``MX_METHODS``), rows named ``<S>-<format>``; empty: the engine holds the trainer's dtype. ``out_path``: the
    JSON records (None: not written); ``command`` is recorded in each. ``methods``: run only these (and
    ``floor``, the ratios' base) in every scenario that has them; empty: all.
    """

    device: str
    model: str
    scenarios: tuple[str, ...] = ()
    warmup: int = 2
    iters: int = 5
    growth_iters: int = 20
    config: TransferConfig = field(default_factory=TransferConfig)
    formats: tuple[str, ...] = ()
    out_path: str | None = None
    command: str = "refit bench"
    methods: tuple[str, ...] = ()  # (): every method of each scenario; else these (and "floor") only


def chosen_scenarios(opts: BenchOptions) -> list[str]:
    """The names of ``opts.scenarios``, or of every scenario this machine can run if none are named;
    ``ConfigError`` for an unknown name or too few GPUs."""
    all_s = scenarios(opts.device)
    which = list(opts.scenarios)
    if not which:  # the scenarios this machine can run
        have = torch.cuda.device_count() if opts.device == "cuda" else 0
        moe = any(".experts." in n for n, _, _ in param_shapes(opts.model))
        which = [n for n, sc in all_s.items() if sc.gpus <= have and (n != "S7" or moe)]  # S7: MoE models only
    unknown = [w for w in which if w not in all_s]
    if unknown:
        raise ConfigError(f"unknown scenario(s) {unknown} for device {opts.device!r}; available: {', '.join(all_s)}")
    if opts.device == "cuda":
        need = max(int(d.split(":")[1]) for s in which for d in all_s[s].devices) + 1
        have = torch.cuda.device_count()
        if have < need:
            raise ConfigError(f"scenarios {which} need {need} GPUs, this machine has {have}")
    return which


def run_scenarios(opts: BenchOptions) -> list[Scenario]:
    """The scenarios ``opts`` runs, in order: each of ``opts.scenarios`` once per engine format (or as it is,
    without the optional methods not installed here), with only ``opts.methods`` (and the floor)."""
    all_s = scenarios(opts.device)
    out = []
    for name in opts.scenarios:
        variants = [quant_scenario(all_s[name], f) for f in opts.formats] or [installed(all_s[name])]
        out += [only_methods(v, opts.methods) for v in variants]
    return out


def check_formats(opts: BenchOptions) -> None:
    """``ConfigError`` naming the scenario where an engine format of ``opts.formats`` cannot hold its layouts (a
    shard boundary cutting a block), before any process starts."""
    shapes = param_shapes(opts.model)
    for scen in run_scenarios(opts):
        if scen.quant is None:
            continue
        src = layout_from_spec(shapes, parse_spec(scen.src, "src"))
        dst = layout_from_spec(shapes, parse_spec(scen.dst, "dst"))
        try:
            if scen.quant == "fp8":
                fp8_layout(src), fp8_layout(dst, side="destination")
            else:
                mx_layout(src, scen.quant), mx_layout(dst, scen.quant, side="destination")
        except LayoutError as e:
            raise ConfigError(f"scenario {scen.name} with --model {opts.model}: {e}") from None


def check_methods(opts: BenchOptions) -> None:
    """``ConfigError`` if ``opts.methods`` names a method that none of ``opts.scenarios`` has."""
    all_s = scenarios(opts.device)
    variants = [[quant_scenario(all_s[n], f) for f in opts.formats] or [all_s[n]] for n in opts.scenarios]
    known = {m for vs in variants for v in vs for m in v.methods}
    odd = [m for m in opts.methods if m not in known]
    if odd:
        raise ConfigError(f"unknown method(s) {odd} for scenarios {list(opts.scenarios)}; available: {sorted(known)}")


def _row(scen: Scenario, res: dict, r: dict, floor_s: float | None, opts: BenchOptions, kind: str, date: str) -> dict:
    """The JSON record of method record ``r`` of scenario result ``res``."""
    t = r["times"]
    med = statistics.median(t)
    cfg = opts.config
    return {
        "scenario": scen.name,
        "method": r["method"],
        "model": opts.model,
        "bytes": res["bytes"],
        "bytes_moved": res["bytes_moved"],
        "bytes_same_device": res["bytes_same_device"],
        "median_s": med,
        "min_s": min(t),
        "max_s": max(t),
        "n": len(t),
        "gbps": res["bytes"] / med / 1e9,
        "floor_s": floor_s,
        "ratio_to_floor": med / floor_s if floor_s else None,
        "peak_extra_bytes": r["peak_extra_bytes"],
        "growth_bytes": r["growth_bytes"],
        "correct": r["correct"],
        "variant": r["variant"],
        "budget_bytes": cfg.num_buffers * cfg.buffer_bytes,
        "copy_streams": cfg.copy_streams,
        "cuda_graph": cfg.cuda_graph,
        "device": kind,
        "command": opts.command,
        "date": date,
        "plan_digest": res["digest"],
    }


def _run_scenario(scen: Scenario, opts: BenchOptions) -> dict:
    """Every method of ``scen`` in its own processes; process 0's result."""
    n_src = parse_spec(scen.src, "src").world_size
    n_dst = parse_spec(scen.dst, "dst").world_size
    return run_local(
        _bench_worker, n_src, n_dst, scen, opts, devices=list(scen.devices), backend="gloo", timeout_s=1200
    )[0]


def _median_of(records: list[dict], method: str) -> float | None:
    rec = next((r for r in records if r["method"] == method), None)
    return statistics.median(rec["times"]) if rec and rec["times"] else None


def run_bench(opts: BenchOptions, console) -> list[dict]:
    """Run the scenarios of ``opts``, print a line per method as it finishes, write and return the records."""
    opts = replace(opts, scenarios=tuple(chosen_scenarios(opts)))
    kind = device_kind() if opts.device == "cuda" else "cpu"
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    rows = []
    for scen in run_scenarios(opts):
        console.print(
            f"[{scen.name}] {scen.what}: {opts.model}, trainer {scen.src} -> engine {scen.dst}, "
            f"methods {', '.join(scen.methods)} ..."
        )
        res = _run_scenario(scen, opts)
        floor_s = _median_of(res["records"], "floor")
        read_copy_s = None
        if scen.quant and floor_s and len(set(scen.devices)) == 1:  # one GPU: issue 52's floor, derived
            read_copy_s = floor_s * (1 + res["read_bytes"] / (2 * res["bytes"]))
            res["records"].append({**_floor_record("floor_read_copy", None), "times": [read_copy_s]})
            res["records"][-1]["variant"] = "read + copy"
        for r in res["records"]:
            rows.append(_row(scen, res, r, floor_s, opts, kind, date))
            if read_copy_s:
                rows[-1]["ratio_to_read_copy_floor"] = rows[-1]["median_s"] / read_copy_s
            console.print(
                f"  {r['method']:<22} median {rows[-1]['median_s'] * 1e3:9.2f} ms  "
                f"ratio {rows[-1]['ratio_to_floor'] or 0:5.2f}  ok={r['correct']}"
            )
    if opts.out_path:
        os.makedirs(os.path.dirname(opts.out_path) or ".", exist_ok=True)
        with open(opts.out_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def print_table(rows: list[dict], console) -> None:
    from rich.table import Table

    table = Table(
        "scenario", "method", "median ms", "min ms", "max ms", "GB/s", "x floor", "peak extra MiB", "growth", "correct"
    )
    for r in rows:
        table.add_row(
            r["scenario"],
            r["method"] + (f" ({r['variant']})" if r["variant"] else ""),
            f"{r['median_s'] * 1e3:.2f}",
            f"{r['min_s'] * 1e3:.2f}",
            f"{r['max_s'] * 1e3:.2f}",
            f"{r['gbps']:.1f}",
            f"{r['ratio_to_floor']:.3f}" if r["ratio_to_floor"] else "-",
            "-" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.1f}",
            "-" if r["growth_bytes"] is None else str(r["growth_bytes"]),
            "-" if r["correct"] is None else str(r["correct"]),
        )
    console.print(table)


__all__ = ["BenchOptions", "chosen_scenarios", "run_bench", "print_table", "scenarios"]
