"""The device time of GPU work between two CUDA events, shared by the kernel benches."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_device_s(run: Callable[[], object], n: int) -> float:
    """Seconds ``run()`` keeps the current stream busy: one untimed call, then the median of ``n`` calls, each
    timed alone between two events."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)
