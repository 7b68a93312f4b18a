"""The scenarios ``refit bench`` times (S1-S7 on GPUs, S1/S3/S6 on CPU): each setting's two layouts, the
device of every process and the methods timed there; and the variants a run derives from one (FP8 engine,
only some methods, the methods whose optional package is installed here)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from refit.config import nixl_installed


@dataclass(frozen=True)
class Scenario:
    """One benchmark setting: the two layouts, which device each process runs on, the methods timed."""

    name: str
    what: str
    src: str
    dst: str
    devices: tuple[str, ...]  # process -> device (trainer ranks first)
    methods: tuple[str, ...]
    # "links": every link's bytes as one copy, all at once; "one_link": one engine's bytes over one link
    floor: str = "links"
    quant: str | None = None  # the engine's format (``QUANT_FORMATS``), quantized by the trainer; None: as trained

    @property
    def gpus(self) -> int:
        return len({d for d in self.devices if d.startswith("cuda")})


def _gpus(n: int) -> tuple[str, ...]:
    return tuple(f"cuda:{i}" for i in range(n))


CPU_SCENARIOS = (
    Scenario(
        "S1",
        "non-colocated 1 -> 1 (CPU, gloo)",
        "tp=1",
        "tp=1",
        ("cpu", "cpu"),
        ("refit", "refit_checksums", "refit_nixl", "per_tensor_broadcast", "floor"),
    ),
    Scenario(
        "S3",
        "reshard fsdp=2 -> tp=2 (CPU, gloo)",
        "fsdp=2",
        "tp=2",
        ("cpu",) * 4,
        ("refit", "refit_checksums", "refit_nixl", "floor"),
    ),
    Scenario(
        "S6",
        "one trainer -> 3 engine replicas (CPU, gloo)",
        "tp=1",
        "tp=1,dp=3",
        ("cpu",) * 4,
        ("refit", "refit_fanout", "floor"),
    ),
)


CUDA_SCENARIOS = (
    Scenario(
        "S1",
        "non-colocated 1 -> 1: trainer GPU0, engine tp=1 GPU1",
        "tp=1",
        "tp=1",
        ("cuda:0", "cuda:1"),
        (
            "refit",
            "refit_checksums",
            "refit_nccl",
            "refit_nixl",
            "per_tensor_broadcast",
            "packed_broadcast_1buf",
            "packed_broadcast_2buf",
            "floor",
        ),
    ),
    Scenario(
        "S2",
        "colocated on one GPU: trainer and engine processes on GPU0",
        "tp=1",
        "tp=1",
        ("cuda:0", "cuda:0"),
        ("refit", "refit_checksums", "refit_nixl", "floor"),
    ),
    Scenario(
        "S3",
        "colocated reshard: trainer fsdp=2 on GPU0-1 -> engine tp=2 on GPU0-1",
        "fsdp=2",
        "tp=2",
        _gpus(2) * 2,
        ("refit", "refit_checksums", "refit_nixl", "gather_then_slice", "floor"),
    ),
    Scenario(
        "S4",
        "non-colocated reshard: trainer tp=2 on GPU0-1 -> engine tp=2 on GPU2-3",
        "tp=2",
        "tp=2",
        _gpus(4),
        ("refit", "refit_nccl", "floor"),
    ),
    Scenario(
        "S5",
        "colocated reshard: trainer fsdp=4 -> engine tp=1,dp=4 on GPU0-3",
        "fsdp=4",
        "tp=1,dp=4",
        _gpus(4) * 2,
        ("refit", "floor"),
    ),
    Scenario(
        "S6",
        "one trainer GPU -> 3 engine replicas: trainer GPU0 -> engine tp=1,dp=3 on GPU1-3",
        "tp=1",
        "tp=1,dp=3",
        _gpus(4),
        ("refit", "refit_fanout", "per_tensor_broadcast", "floor"),
        floor="one_link",
    ),
    Scenario(
        "S6x7",
        "one trainer GPU -> 7 engine replicas: trainer GPU0 -> engine tp=1,dp=7 on GPU1-7",
        "tp=1",
        "tp=1,dp=7",
        _gpus(8),
        ("refit", "refit_fanout", "per_tensor_broadcast", "floor"),
        floor="one_link",
    ),
    Scenario(
        "S7",
        "MoE colocated reshard (run with --model qwen3-30b-a3b): trainer ep=4,tp=2 -> engine tp=4,dp=2 on GPU0-7",
        "ep=4,tp=2",
        "tp=4,dp=2",
        _gpus(8) * 2,
        ("refit", "floor"),
    ),
)


def scenarios(device: str) -> dict[str, Scenario]:
    """The scenarios of ``device`` ("cpu" or "cuda") by name, in table order."""
    return {s.name: s for s in (CPU_SCENARIOS if device == "cpu" else CUDA_SCENARIOS)}


FP8_METHODS = ("refit", "refit_1stage", "fp8_quantize", "floor")
MX_METHODS = ("refit", "refit_1stage", "quantize", "floor")
QUANT_FORMATS = ("fp8", "mxfp8", "nvfp4")  # vLLM's 128x128 block FP8, ModelOpt's MXFP8 and NVFP4
NIXL_METHODS = ("refit_nixl",)


def only_methods(scen: Scenario, methods: tuple[str, ...]) -> Scenario:
    """``scen`` with only ``methods`` and ``floor`` (the ratios' base); all of them when ``methods`` is empty."""
    if not methods:
        return scen
    return replace(scen, methods=tuple(m for m in scen.methods if m in methods or m == "floor"))


def installed(scen: Scenario) -> Scenario:
    """``scen`` without the methods whose optional package is missing here (``refit_nixl``: nixl). On GPUs
    ``refit_nixl`` runs only when asked for (``REFIT_BENCH_NIXL=1``): its first GPU run (one H100, S2)
    printed nothing within 250 s, so it must not hold up the default bench (docs/benchmarks.md)."""
    if nixl_installed() and (scen.gpus == 0 or os.environ.get("REFIT_BENCH_NIXL") == "1"):
        return scen
    return replace(scen, methods=tuple(m for m in scen.methods if m not in NIXL_METHODS))


def parse_formats(fp8: bool, quant: str | None) -> tuple[str, ...]:
    """The engine formats of one ``refit bench`` run, in ``QUANT_FORMATS`` order: ``fp8`` (``--fp8``) and the
    comma-separated ``quant`` (``--quant``); ``ConfigError`` naming an unknown or repeated one."""
    from refit.errors import ConfigError

    asked = [f for f in (quant or "").split(",") if f] if quant is not None else []
    if quant is not None and not asked:
        raise ConfigError(f"no format in {quant!r}; choose from {', '.join(QUANT_FORMATS[1:])}")
    odd = [f for f in asked if f not in QUANT_FORMATS[1:]]
    if odd:
        raise ConfigError(f"unknown format(s) {odd}; choose from {', '.join(QUANT_FORMATS[1:])} (FP8 blocks: --fp8)")
    twice = sorted({f for f in asked if asked.count(f) > 1})
    if twice:
        raise ConfigError(f"format(s) {twice} named twice in {quant!r}")
    chosen = set(asked) | ({"fp8"} if fp8 else set())
    return tuple(f for f in QUANT_FORMATS if f in chosen)


_WHAT = {
    "fp8": "FP8 engine (128x128 blocks, quantized by the trainer)",
    "mxfp8": "MXFP8 engine (E4M3, E8M0 scales per 32 columns, quantized by the trainer)",
    "nvfp4": "NVFP4 engine (E2M1, E4M3 scales per 16 columns, one FP32 scale per tensor, quantized by the trainer)",
}


def quant_scenario(scen: Scenario, fmt: str) -> Scenario:
    """``scen`` with an engine in ``fmt`` (``QUANT_FORMATS``): rows ``<S>-<fmt>``, the quantizing methods."""
    return replace(
        scen,
        name=f"{scen.name}-{fmt}",
        what=f"{scen.what}, {_WHAT[fmt]}",
        methods=FP8_METHODS if fmt == "fp8" else MX_METHODS,
        quant=fmt,
    )
