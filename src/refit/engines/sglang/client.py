"""How trainer rank 0 drives SGLang's weight-update calls: over an in-process ``sgl.Engine`` or over HTTP.

Contract (``SGLangClient``; both implementations below keep it), called by ``RefitSGLangTrainer`` only:

* ``begin_weight_update()`` / ``end_weight_update()``: SGLang's weight-update session around each trigger;
* ``trigger(name)``: ``update_weights_from_tensor([(name, an empty tensor)], load_format=LOADER)``; blocks until
  every SGLang TP rank's loader returned (refit runs it in a thread while the trainer ranks send); raises
  where SGLang reports failure (refit's loader itself never fails the call: see ``loader``);
* ``set_weight_version(version)``: SGLang's ``weight_version`` after a committed refit;
* ``weight_version()``: the version SGLang reports now.

Nothing refit acts on passes through these calls: triggers carry a store pointer or a bare command, and
the job secret never does (the SGLang processes read it from their environment).
"""

from __future__ import annotations

import base64
from typing import Any, Protocol

from .loader import LOADER, trigger_tensor


class SGLangClient(Protocol):
    """The five calls refit's trainer makes on SGLang (the contract in the module docstring)."""

    def begin_weight_update(self) -> None: ...
    def trigger(self, name: str) -> None: ...
    def end_weight_update(self) -> None: ...
    def set_weight_version(self, version: str) -> None: ...
    def weight_version(self) -> str | None: ...


def _ok(what: str, result: Any) -> None:
    """SGLang answers ``(success, message)`` (or a dict with ``success``); raise naming the call if it failed."""
    ok = result.get("success") if isinstance(result, dict) else (result[0] if isinstance(result, tuple) else result)
    if ok is False:
        raise RuntimeError(f"refit: SGLang's {what} failed: {result}")


class EngineClient:
    """``SGLangClient`` over an ``sgl.Engine`` in this process (trainer rank 0 owns it). Owns nothing but the handle."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def begin_weight_update(self) -> None:
        _ok("begin_weight_update", self.engine.begin_weight_update())

    def trigger(self, name: str) -> None:
        _ok("update_weights_from_tensor", self.engine.update_weights_from_tensor([(name, trigger_tensor())], LOADER))

    def end_weight_update(self) -> None:
        _ok("end_weight_update", self.engine.end_weight_update())

    def set_weight_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        # the Engine has no method for it; its tokenizer manager serves /update_weight_version the same way
        req = UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        self.engine.loop.run_until_complete(self.engine.tokenizer_manager.update_weight_version(req))

    def weight_version(self) -> str | None:
        return self.engine.get_model_info()["weight_version"]


class HTTPClient:
    """``SGLangClient`` over ``python -m sglang.launch_server`` at ``url`` with ``tp_size`` TP ranks (``requests``;
    ``timeout_s`` per call).

    The trigger is sent the way SGLang's HTTP API takes tensors (``MultiprocessingSerializer``, base64, one
    payload per TP rank): SGLang's own format, made here from an empty tensor and refit's trigger
    name. Nothing refit receives from the server is unpickled (its answers are JSON)."""

    def __init__(self, url: str, tp_size: int, timeout_s: float = 600.0) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"HTTPClient.tp_size must be an integer >= 1, got {tp_size!r}")
        self.url, self.tp_size, self.timeout_s = url.rstrip("/"), tp_size, timeout_s

    def _post(self, path: str, body: dict) -> Any:
        import requests

        r = requests.post(f"{self.url}/{path}", json=body, timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"refit: SGLang's /{path} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def begin_weight_update(self) -> None:
        _ok("/begin_weight_update", self._post("begin_weight_update", {}))

    def trigger(self, name: str) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        payload = base64.b64encode(MultiprocessingSerializer.serialize([(name, trigger_tensor())])).decode()
        body = {"serialized_named_tensors": [payload] * self.tp_size, "load_format": LOADER, "flush_cache": True}
        _ok("/update_weights_from_tensor", self._post("update_weights_from_tensor", body))

    def end_weight_update(self) -> None:
        _ok("/end_weight_update", self._post("end_weight_update", {}))

    def set_weight_version(self, version: str) -> None:
        self._post("update_weight_version", {"new_version": version, "abort_all_requests": False})

    def weight_version(self) -> str | None:
        import requests

        return requests.get(f"{self.url}/model_info", timeout=self.timeout_s).json().get("weight_version")
