"""A ``VLLMWeightSyncClient`` over an in-process ``vllm.LLM`` (vLLM ships HTTP and Ray ones)."""

from __future__ import annotations

from typing import Any


class LLMClient:
    """vLLM's four weight-sync calls on an ``LLM`` that lives in this process (trainer rank 0 owns it).

    Call order, as vLLM's ``VLLMWeightSyncClient``: ``init_weight_transfer_engine`` once, then per
    version ``start_weight_update``, ``update_weights`` (blocks until the workers received it: run it
    while the trainer ranks send), ``finish_weight_update(weight_version)``. Owns nothing but the handle.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)
