"""``refit plan|verify``'s engine formats: ``--fp8 [BLOCK]`` (vLLM's block FP8) or ``--quant mxfp8|nvfp4``
(ModelOpt's MXFP8 / NVFP4 as vLLM loads them), quantized by the trainer ranks before the wire."""

from __future__ import annotations

import argparse

from refit.errors import ConfigError
from refit.layout import ModelLayout
from refit.quant import fp8_layout
from refit.quant.mx_layout import FORMATS, mx_layout
from refit.tools.eplb_cli import add_expert_map_option, eplb_cli_layouts, expert_map_label


def add_quant_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quant",
        choices=sorted(FORMATS),
        default=None,
        help="the engine holds MXFP8 (E4M3, E8M0 scales per 32 input columns) or NVFP4 (E2M1, E4M3 scales per 16, "
        "one FP32 scale per tensor) weights in ModelOpt's names and shapes, quantized by the trainer ranks",
    )
    add_expert_map_option(p)  # --expert-map FILE (tools/eplb_cli.py)


def quantized_layouts(src: ModelLayout, dst: ModelLayout, args: argparse.Namespace) -> tuple[ModelLayout, ModelLayout]:
    """Both layouts in the engine's format (unchanged without ``--fp8`` or ``--quant``); ``LayoutError`` where a
    shard boundary cuts a block, naming the tensor."""
    fp8, quant = args.fp8, getattr(args, "quant", None)
    if getattr(args, "expert_map", None) is not None:
        return eplb_cli_layouts(src, dst, args)  # an EPLB engine's physical expert slots
    if fp8 and quant:
        raise ConfigError(f"--fp8 {fp8} and --quant {quant} together: an engine holds one format")
    if fp8:
        return fp8_layout(src, block=(fp8, fp8)), fp8_layout(dst, block=(fp8, fp8), side="destination")
    if quant:
        return mx_layout(src, quant), mx_layout(dst, quant, side="destination")
    return src, dst


def quant_label(args: argparse.Namespace, sep: str) -> str:
    """The format as ``refit plan|verify`` print it after ``sep`` ("" for a bf16 engine)."""
    if getattr(args, "expert_map", None) is not None:
        return expert_map_label(args, sep)
    if args.fp8:
        return f"{sep}FP8 {args.fp8}x{args.fp8} blocks"
    return f"{sep}{args.quant.upper()} quantized by the trainer ranks" if getattr(args, "quant", None) else ""


def quant_flags(args: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    """Each engine-format flag with its value (None: not given)."""
    return (("--fp8", args.fp8), ("--quant", args.quant), ("--expert-map", getattr(args, "expert_map", None)))


def quant_fields(args: argparse.Namespace, verify: bool = False) -> dict:
    """``plan --json``'s format fields, or (``verify``) ``tools.verify.verify``'s format arguments."""
    m = getattr(args, "expert_map", None)
    if verify:
        return {"fp8_block": (args.fp8, args.fp8) if args.fp8 else None, "quant": args.quant, "expert_map": m}
    return {"fp8_block": args.fp8, "quant": args.quant, "expert_map": None if m is None else m.digest}
