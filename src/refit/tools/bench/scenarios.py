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


def fp8_scenario(scen: Scenario) -> Scenario:
    return replace(
        scen,
        name=f"{scen.name}-fp8",
        what=scen.what + ", FP8 engine (128x128 blocks, quantized by the trainer)",
        methods=FP8_METHODS,
    )
