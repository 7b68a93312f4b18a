"""Worker methods the driver calls by name: ``llm.collective_rpc("refit_stats")``.

Start the engine with ``LLM(..., worker_extension_cls="refit.engines.vllm.extension.RefitWorkerExtension")``
(``--worker-extension-cls`` for ``vllm serve``); vLLM mixes the class into every worker.
"""

from __future__ import annotations

import json
from typing import Any

QUALNAME = "refit.engines.vllm.extension.RefitWorkerExtension"


class RefitWorkerExtension:
    """refit's methods on every vLLM worker, called by name through ``collective_rpc``.

    Why by name: ``collective_rpc`` can also ship a Python function, but vLLM must then pickle it,
    which it refuses unless its insecure-serialization switch is on, and with that switch on
    whoever reaches the engine's control channel can run code in the workers. refit's vLLM path
    needs no such switch: its worker-side code is installed here (and in the weight-transfer
    engine the ``refit`` backend registers), the driver names a method, and arguments and results
    are plain data (dicts, lists, str, int, float, bool, None) that vLLM's msgspec encoder
    carries without pickle. No code crosses a process boundary.

    Contract: every method returns plain data; ``collective_rpc`` returns one result per worker,
    in worker order. Methods raise ``RuntimeError`` on a worker whose weight-transfer backend is
    not ``refit``. Names start with ``refit_`` so they cannot shadow the worker's own (vLLM
    refuses an extension that would).
    """

    def refit_stats(self) -> dict[str, Any]:
        """This worker's refit statistics, as plain data: ``refits`` (completed), ``version`` (the last
        one received, ``None`` before the first), ``bytes_received`` (all refits), ``bytes_per_refit``,
        ``load_path`` (``"direct"`` or ``"loader"``), ``direct_tensors``, ``rules`` (how many tensors
        each mapping rule served; ``{"lora": n}`` for a LoRA adapter's tensors), ``lora_adapters`` (a LoRA
        adapter: the adapter ids vLLM held right after the last refit installed its version),
        ``transfer_s`` / ``load_s`` (the last refit). Keys that only exist
        after init (or after a refit) are absent before it. Still readable after the engine's
        ``shutdown``."""
        return json.loads(json.dumps(_refit_engine(self).stats))


def _refit_engine(worker: Any) -> Any:
    """The worker's refit weight-transfer engine; ``RuntimeError`` if it has another (or none)."""
    from .worker import RefitWeightTransferEngine

    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, RefitWeightTransferEngine):
        raise RuntimeError(
            f"refit: this vLLM worker's weight-transfer engine is {type(engine).__name__}, not refit's "
            "(start the LLM with weight_transfer_config={'backend': 'refit'})"
        )
    return engine
