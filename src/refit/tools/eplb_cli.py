"""``refit plan|verify --expert-map FILE``: an EPLB engine's physical expert slots (``refit.layout.eplb``), and the
real multi-process check behind ``refit verify`` with a map (and the tests): versions refit under a sequence of maps,
every physical slot of every engine rank checked bit for bit against the trainer's logical expert after each."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from refit.config import TransferConfig
from refit.errors import ConfigError, LayoutError, PlanError
from refit.layout import ModelLayout, TensorLayout, box_slices
from refit.layout.eplb import EplbLayouts, ExpertMap, ep_of, eplb_layouts, moe_layers
from refit.plan import ProcessMap, build_plan

if TYPE_CHECKING:  # the multi-process check's modules load when it runs, not with the command line
    from refit.tools.launch import World
    from refit.tools.verify import VerifyResult


def expert_map_file(path: str) -> ExpertMap:
    """argparse type: the expert map in JSON file ``path``, checked field by field (``ExpertMap.read``)."""
    try:
        return ExpertMap.read(path)
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_expert_map_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expert-map",
        type=expert_map_file,
        default=None,
        metavar="FILE",
        help='an EPLB engine: JSON {"physical_to_logical": [[expert id per physical slot] per MoE layer], '
        '"num_redundant_experts": R}; slots split contiguously over the engine\'s EP ranks, every slot receives '
        "its expert",
    )


def eplb_cli_layouts(src: ModelLayout, dst: ModelLayout, args: argparse.Namespace) -> tuple[ModelLayout, ModelLayout]:
    """Both layouts with one tensor per physical slot of ``--expert-map`` (unchanged without it)."""
    m = getattr(args, "expert_map", None)
    if m is None:
        return src, dst
    for flag, given in (("--fp8", args.fp8), ("--quant", getattr(args, "quant", None))):
        if given:
            raise ConfigError(f"--expert-map and {flag} together are not supported (an EPLB engine in bf16/fp32 only)")
    try:
        layouts = eplb_layouts(src, dst, m)
    except LayoutError as e:
        raise LayoutError(f"--expert-map: {e}") from None
    return layouts.src, layouts.dst


def expert_map_label(args: argparse.Namespace, sep: str) -> str:
    """``--expert-map`` as ``refit plan|verify`` print it after ``sep`` ("" without one)."""
    m = getattr(args, "expert_map", None)
    if m is None:
        return ""
    return f"{sep}EPLB map {m.digest} ({m.num_physical} physical slots in each of {m.num_layers} MoE layers)"


# --------------------------------------------------------------------------- the multi-process check


@dataclass(frozen=True)
class Session:
    """Refits of versions 1, 2, ... from ``src`` into ``dst`` (logical layouts) on processes ``procs``, version ``v``
    under ``maps[v - 1]``; the trainer ranks use ``src_maps`` instead where given (a mismatch to be refused);
    ``commit``, ``delta``: ``TransferConfig``'s."""

    src: ModelLayout
    dst: ModelLayout
    procs: ProcessMap
    maps: tuple[ExpertMap, ...]
    src_maps: tuple[ExpertMap, ...] | None = None
    commit: str = "in_place"
    delta: str = "off"


def eplb_worker(world: World, sessions: Sequence[Session], seed: int, config: TransferConfig) -> list[dict | None]:
    """Each session in turn on the processes it names (None for the others): ``_session``'s record."""
    return [
        _session(world.rank, i, s, seed, replace(config, name=f"{config.name}/eplb{i}", commit=s.commit, delta=s.delta))
        if world.rank in (*s.procs.src, *s.procs.dst)
        else None
        for i, s in enumerate(sessions)
    ]


def _session(proc: int, index: int, s: Session, seed: int, config: TransferConfig) -> dict:
    """``{"rows": [{version, map, bytes_moved, bytes_needed, mismatches, bytes_checked}], "plans_built", "error"}``:
    the trainer's shards are refreshed in place before each version (``version_values``); the engine's slots are
    checked after each."""
    from refit.eplb import EplbPeer

    src_rank = s.procs.src.index(proc) if proc in s.procs.src else None
    dst_rank = s.procs.dst.index(proc) if proc in s.procs.dst else None
    maps = s.src_maps if src_rank is not None and s.src_maps is not None else s.maps
    src_t = version_shards(s.src, src_rank, seed, 0) if src_rank is not None else None
    dst_t = None
    if dst_rank is not None:
        shapes = eplb_layouts(s.src, s.dst, maps[0]).dst_shapes(dst_rank)
        dst_t = {n: torch.full(shape, float("nan"), dtype=s.dst[n].dtype) for n, shape in shapes.items()}
    peer = EplbPeer(s.src, s.dst, proc, src_tensors=src_t, dst_tensors=dst_t, procs=s.procs, config=config)
    rows: list[dict] = []
    try:
        for v, m in enumerate(maps, 1):
            if src_t is not None:
                for name, x in version_shards(s.src, src_rank, seed, v).items():
                    src_t[name].copy_(x)
            peer.run(v, m)
            plan = peer.plan(m)
            row = {"version": v, "map": m.digest, "bytes_moved": plan.bytes_moved, "bytes_needed": plan.bytes_needed}
            if dst_t is not None:
                row["mismatches"], row["bytes_checked"] = check_slots(peer.layouts[m.digest], dst_rank, dst_t, seed, v)
            rows.append(row)
    except PlanError as e:
        return {"rows": rows, "plans_built": peer.plans_built, "error": f"{type(e).__name__}: {e}"}
    finally:
        peer.close()
    return {"rows": rows, "plans_built": peer.plans_built, "error": None}


def version_values(t: TensorLayout, seed: int, version: int) -> torch.Tensor:
    """Tensor ``t``'s values at ``version``: ``tools.verify``'s reference values of ``seed`` with every 61st element
    set to ``version`` (versions differ in few elements, as after an optimizer step: a delta refit sends few)."""
    from refit.tools.verify import reference_tensor

    x = reference_tensor(t.name, t.shape, t.dtype, seed)
    x.view(-1)[::61] = version
    return x


def version_shards(layout: ModelLayout, rank: int, seed: int, version: int) -> dict[str, torch.Tensor]:
    """Source ``rank``'s boxes of ``version_values``."""
    return {t.name: version_values(t, seed, version)[box_slices(b)].clone() for t, b in layout.local_tensors(rank)}


def check_slots(layouts: EplbLayouts, rank: int, tensors: dict, seed: int, version: int) -> tuple[list[str], int]:
    """Mismatches of destination ``rank``'s tensors against ``version_values``: physical slot ``j``
    of EP coordinate ``c`` against logical expert ``map[layer][c * P / ep + j]`` (from the map alone, not from
    the slot layouts), every other tensor against its box; and the bytes compared."""
    from refit.tools.verify import same_bits

    base, m = layouts.base_dst, layouts.expert_map
    stacked = {t.name: i for i, ts in enumerate(moe_layers(base)) for t in ts}
    bad, nbytes = [], 0
    for t, box in base.local_tensors(rank):
        got, full = tensors[t.name], version_values(t, seed, version)
        nbytes += got.numel() * got.element_size()
        if t.name not in stacked:
            if not same_bits(got, full[box_slices(box)]):
                bad.append(f"destination rank {rank}: tensor {t.name!r} box {list(box)} differs")
            continue
        ep, axis = ep_of(t)
        per = m.num_physical // ep
        first = 0 if axis is None else t.mesh.coords(rank)[axis] * per
        for j in range(per):
            e = m.physical_to_logical[stacked[t.name]][first + j]
            if not same_bits(got[j : j + 1], full[(slice(e, e + 1), *box_slices(box)[1:])]):
                bad.append(f"destination rank {rank}: {t.name!r} physical slot {first + j} (expert {e}) differs")
    return bad, nbytes


def verify_eplb(
    src: ModelLayout,
    dst: ModelLayout,
    expert_map: ExpertMap,
    *,
    config: TransferConfig | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> VerifyResult:
    """``refit verify --expert-map``: one refit from ``src`` into ``dst``'s physical slots under ``expert_map`` in
    real processes (CPU, gloo), every slot checked bit for bit."""
    from refit.tools.launch import run_local
    from refit.tools.resources import check_memory, held_bytes
    from refit.tools.verify import VerifyResult

    config = config if config is not None else TransferConfig()
    layouts = eplb_layouts(src, dst, expert_map)
    plan = build_plan(layouts.src, layouts.dst, config=config)  # fails fast
    n = src.world_size + dst.world_size
    check_memory(held_bytes(src) + 2 * held_bytes(layouts.dst), f"verify on {n} processes")
    session = Session(src, dst, ProcessMap.disjoint(src.world_size, dst.world_size), (expert_map,))
    out = run_local(
        eplb_worker, src.world_size, dst.world_size, [session], seed, config, backend="gloo", timeout_s=timeout_s
    )
    mismatches: list[str] = []
    nbytes = 0
    for res in out[src.world_size :]:
        row = res[0]["rows"][0]
        mismatches += row["mismatches"]
        nbytes += row["bytes_checked"]
    return VerifyResult(len(layouts.dst), dst.world_size, nbytes, mismatches, plan)


def verify_with_map(
    src: ModelLayout, dst: ModelLayout, *, expert_map: ExpertMap | None = None, **kwargs
) -> VerifyResult:
    """``refit verify``: ``tools.verify.verify(src, dst, **kwargs)``, or with ``expert_map`` ``verify_eplb`` (which
    takes no dump, FP8 or MX format: refused with ``ConfigError``)."""
    from refit.tools.verify import verify

    if expert_map is None:
        return verify(src, dst, **kwargs)
    other = [k for k in ("dump", "fp8_block", "quant") if kwargs.pop(k, None)]
    if other:
        raise ConfigError(f"--expert-map with {other[0]} is not supported: verify the EPLB engine alone")
    return verify_eplb(src, dst, expert_map, **kwargs)
