"""What a LoRA refit moves and what the merged path computes per refit, at a real model's shapes.

    python -m bench.lora_merge [--model llama-3.1-8b] [--ranks 16,64] [--device cuda] [--out FILE]

For LoRA on every attention and MLP projection (q, k, v, o, gate, up, down) at each rank: the bytes an
adapter refit moves (A and B of every module, in the model's dtype), the bytes a merged refit moves
(``MergedLoraSource``: the adapted weights and their fused engine layers), the model's bytes, and the
time of ``MergedLoraSource.prepare``'s work (``layout.lora.merge_weight`` of every adapted module into
buffers allocated once; median of ``--repeats``, the device synchronized around each). Tensors are random (the cost does
not depend on values); nothing is sent. Needs no PEFT and no vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from refit.layout.hf_names import Role, param_role
from refit.layout.lora import LoraSpec, adapter_shapes, engine_layer_params, merge_weight
from refit.layout.models import param_shapes

PROJ = {Role.Q_PROJ, Role.K_PROJ, Role.V_PROJ, Role.O_PROJ, Role.GATE_PROJ, Role.UP_PROJ, Role.DOWN_PROJ}


def _time(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (one warm-up), the device synchronized around each."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def case(model: str, rank: int, device: str, repeats: int) -> dict:
    shapes = param_shapes(model)
    dtype = shapes[0][2]
    esize = torch.empty((), dtype=dtype).element_size()
    base_shapes = {
        n.removesuffix(".weight"): s for n, s, _ in shapes if param_role(n) in PROJ and n.endswith(".weight")
    }
    spec = LoraSpec("bench", rank, 2.0 * rank, tuple(sorted(base_shapes)))
    adapter = adapter_shapes(spec, base_shapes)
    engine_params = engine_layer_params(spec.modules, [n for n, _, _ in shapes])
    by_name = {n: s for n, s, _ in shapes}
    g = torch.Generator(device=device).manual_seed(0)
    jobs = []
    for o, i in base_shapes.values():
        w = torch.randn(o, i, generator=g, device=device, dtype=dtype)
        a = torch.randn(rank, i, generator=g, device=device, dtype=dtype)
        b = torch.randn(o, rank, generator=g, device=device, dtype=dtype)
        jobs.append((w, a, b, torch.empty_like(w)))

    def merge_all():
        for w, a, b, out in jobs:
            merge_weight(w, a, b, spec.scale, out=out)

    seconds = _time(merge_all, device, repeats)
    numel = lambda s: int(torch.Size(s).numel())  # noqa: E731
    return {
        "model": model,
        "rank": rank,
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "dtype": str(dtype),
        "modules": len(spec.modules),
        "model_bytes": sum(numel(s) for _, s, _ in shapes) * esize,
        "adapter_bytes": sum(numel(s) for s in adapter.values()) * esize,
        "merged_bytes": sum(numel(by_name[n]) for n in engine_params) * esize,
        "merge_ms": seconds * 1e3,
        "merge_extra_bytes": sum(numel(base_shapes[m]) for m in spec.modules) * esize,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [case(args.model, int(r), args.device, args.repeats) for r in args.ranks.split(",")]
    for r in rows:
        print(
            f"{r['model']} r={r['rank']} {r['dtype']} on {r['device']}: model {r['model_bytes'] / 1e9:.2f} GB, "
            f"adapter refit {r['adapter_bytes'] / 1e6:.1f} MB ({r['adapter_bytes'] / r['model_bytes']:.2%}), "
            f"merged refit {r['merged_bytes'] / 1e9:.2f} GB ({r['merged_bytes'] / r['model_bytes']:.1%}), "
            f"merge {r['merge_ms']:.2f} ms over {r['modules']} modules, buffers {r['merge_extra_bytes'] / 1e9:.2f} GB"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
