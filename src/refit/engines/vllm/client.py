"""The engine's weight-sync calls as the trainer drives them: a client over an in-process ``vllm.LLM``, and
what refit asks of any client (vLLM's own HTTP and Ray clients, or yours).

vLLM's clients (``vllm.distributed.weight_transfer.clients``): ``HTTPVLLMWeightSyncClient(base_url)`` posts
to a ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1`` (its weight-transfer routes exist only then);
``RayVLLMWeightSyncClient(actor)`` calls a vLLM ``LLM``/``AsyncLLM`` Ray actor. refit hands every client plain
JSON only (``RefitInitInfo`` fields, ``{"version": v}``), so nothing needs vLLM's pickling.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

SYNC_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class LLMClient:
    """vLLM's four weight-sync calls on an ``LLM`` that lives in this process (trainer rank 0 owns it).

    Call order, as vLLM's ``VLLMWeightSyncClient``: ``init_weight_transfer_engine`` once, then per
    version ``start_weight_update``, ``update_weights`` (blocks until the workers received it: run it
    while the trainer ranks send), ``finish_weight_update(weight_version)``. Owns nothing but the handle.
    ``private_channel``: what it carries stays inside this process and the engine it started.
    """

    private_channel = True

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


def check_client(client: Any) -> None:
    """Refuse, naming what is missing, a client without vLLM's four weight-sync methods (the protocol is
    structural, as vLLM's ``VLLMWeightSyncClient``: any object with them will do)."""
    missing = [m for m in SYNC_METHODS if not callable(getattr(client, m, None))]
    if missing:
        raise TypeError(
            f"refit: the engine client {type(client).__name__} lacks {', '.join(missing)}; pass "
            "refit.engines.vllm.client.LLMClient(llm), vLLM's HTTPVLLMWeightSyncClient(base_url) or "
            "RayVLLMWeightSyncClient(actor), or any object with all of: " + ", ".join(SYNC_METHODS)
        )


def private_channel(client: Any) -> bool:
    """Whether a job secret refit made may travel through ``client``: True for clients whose calls stay
    inside the job's trusted processes, i.e. an in-process ``LLMClient``, vLLM's ``RayVLLMWeightSyncClient``
    (Ray's own channel: whoever reaches a Ray cluster can run code in it anyway), or any client whose
    ``private_channel`` attribute is True. False for HTTP (plain text on the network) and unknown clients."""
    if getattr(client, "private_channel", False) is True:
        return True
    try:
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    except ImportError:  # an older vLLM: no Ray client to recognize
        return False
    return isinstance(client, RayVLLMWeightSyncClient)


def server_host(client: Any) -> str | None:
    """The host of the engine server ``client`` posts to (its ``base_url``, as vLLM's HTTP client keeps it),
    or None for a client without one."""
    url = getattr(client, "base_url", None)
    if not isinstance(url, str):
        return None
    return urlsplit(url if "//" in url else f"//{url}").hostname
