"""A quantizer's steps replayed as CUDA graphs (``StepGraphs``): one launch per step instead of one per tensor,
each launch tens of microseconds of host time once caches are cold (a refit between training steps)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable

import torch


class StepGraphs:
    """Steps, each named by a key, run as CUDA graphs from their second call on: a step's first call runs eagerly
    (Triton compiles its kernels then), its second records it (once, in thread-local capture mode: an engine
    thread's CUDA calls meanwhile are not refused) and replays it, every later one replays it. Eager when ``on``
    is false (the CPU, a path without Triton kernels), with ``REFIT_QUANT_GRAPH=0``, and from a failed capture on
    (with a warning naming ``what``: speed only, the bytes are the same)."""

    def __init__(self, on: bool, what: str) -> None:
        self.on = on and os.environ.get("REFIT_QUANT_GRAPH", "1") != "0"
        self.what = what
        self.calls: dict[Hashable, int] = {}
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        """Run ``step`` (the same work every time it is called with ``key``)."""
        graph = self.graphs.get(key)
        if graph is None:
            if not self.on or self.calls.setdefault(key, 0) == 0:
                self.calls[key] = 1
                step()
                return
            graph = self._record(key, step)
            if graph is None:
                return
        graph.replay()

    def _record(self, key: Hashable, step: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        """``step`` recorded into a graph (None, after running it eagerly, where recording fails)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step()
        except RuntimeError as e:
            warnings.warn(f"refit: recording {self.what} into a CUDA graph failed ({e}); it stays eager", stacklevel=4)
            self.on = False
            step()
            return None
        self.graphs[key] = graph
        return graph
