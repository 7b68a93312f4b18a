"""One live vLLM engine shared by the tests that can use the same one (an engine start is ~40 s on CI's CPUs).

A test asks the session's ``EnginePool`` for an engine by ``EngineKey`` (model, engine TP, KV heads); the pool
keeps the last engine it started and shuts it down when a test asks for another key, so at most one pooled engine
holds memory at a time. ``conftest.py`` orders the tests marked ``vllm_engine(...)`` so that those asking for the
same key run one after the other. Each engine serves a tiny model saved with seed-1000 weights (``harness.make_llm``)
in its own directory, which also holds the seed-7 checkpoint transformers writes (``ckpt/``) that
``test_direct``'s loader comparisons read. A test that refits a pooled engine starts refit's transfer engine and
shuts it down again (``harness.run``), so the next test finds the engine as a fresh one would be, but for its
weights (the last refit's) and its counters (compare before and after).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch

from refit.layout.models import build_model, load_config

from .harness import make_llm


@dataclass(frozen=True)
class EngineKey:
    """What makes two pooled engines different: the model preset, the engine's TP size, and the number of KV heads
    when it differs from the preset's (fewer than TP: vLLM replicates them)."""

    model: str
    tp: int
    kv_heads: int | None = None

    def config(self):
        cfg = load_config(self.model)
        if self.kv_heads is not None:
            cfg.num_key_value_heads = self.kv_heads
        return cfg


class EnginePool:
    """Hands out the live engine for a key, starting it (and shutting down the previous one) when needed."""

    def __init__(self) -> None:
        self.key: EngineKey | None = None
        self.llm = None
        self.workdir: str | None = None
        self.starts = 0

    def get(self, key: EngineKey):
        """The engine for ``key`` and its model directory (``config.json``, the engine's weights, ``ckpt/``)."""
        if key != self.key:
            self.close()
            self.workdir = tempfile.mkdtemp(prefix="refit-vllm-")
            cfg = key.config()
            cfg.save_pretrained(self.workdir)
            build_model(load_config(self.workdir), torch.float32, seed=7).save_pretrained(
                os.path.join(self.workdir, "ckpt")
            )
            self.llm = make_llm(self.workdir, key.tp, self.workdir)
            self.key = key
            self.starts += 1
        return self.llm, self.workdir

    def close(self) -> None:
        """Shut down the live engine (its engine core and workers) and remove its directory."""
        if self.llm is not None:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            if core is not None:
                core.shutdown()
            self.llm = None
            gc.collect()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.key = self.workdir = None
