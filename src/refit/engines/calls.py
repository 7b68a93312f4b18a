"""A blocking engine call run in a thread while this trainer rank sends: engine-neutral (vLLM and SGLang)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BackgroundCall:
    """Run ``fn(*args)`` in a daemon thread named ``refit-rpc``, started at once.

    ``join(timeout_s=None)`` waits (at most ``timeout_s``: then ``TimeoutError``) and re-raises the call's
    error as ``RuntimeError``; ``settle(timeout_s)`` only waits, for error paths where the caller raises its
    own error; ``failed()`` is the call's error once it has failed (polled while waiting on something else)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in join
                self.error = e

        self.thread = threading.Thread(target=run, name="refit-rpc", daemon=True)
        self.thread.start()

    def failed(self) -> BaseException | None:
        """The call's error once it has failed, else None (still running, or succeeded)."""
        return self.error

    def settle(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"refit: the engine's weight-sync call did not return within {timeout_s:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"refit: the engine's weight-sync call failed: {self.error}") from self.error
