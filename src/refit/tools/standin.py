"""An engine stand-in for overlapped refits: a thread runs a forward pass on the live weights in a
loop, and a refit may pause it (``pause`` / ``resume``, the hooks ``Peer.commit`` takes).

Used by the overlap tests (CPU) and ``bench/overlap_gpu.py`` (a real model's forward on CUDA).
``stall(t0, t1)`` is the longest interval with no forward pass completing inside ``[t0, t1]``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class ForwardLoop:
    """Runs ``forward()`` back to back in a thread; ``pause()`` returns once the pass in flight has
    finished and no new one starts until ``resume()``.

    ``records``: ``(completion time, forward()'s result)`` per pass, ``time.perf_counter`` clock.
    ``forward`` must finish its device work before returning (the completion time is taken then).
    An exception in ``forward`` stops the loop; ``stop()`` re-raises it.
    """

    def __init__(self, forward: Callable[[], Any]) -> None:
        self.forward = forward
        self.records: list[tuple[float, Any]] = []
        self._cond = threading.Condition()
        self._paused = False  # a pause holds the loop
        self._running = False  # a pass is in flight
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="refit-standin-forward", daemon=True)

    def start(self) -> ForwardLoop:
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    while self._paused:
                        self._cond.wait()
                    self._running = True
                try:
                    out = self.forward()
                    self.records.append((time.perf_counter(), out))
                finally:
                    with self._cond:
                        self._running = False
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised by stop()
            self._error = e

    def pause(self) -> None:
        """Hold the loop: no pass starts until ``resume()``; returns once the pass in flight finished."""
        with self._cond:
            self._paused = True
            while self._running:
                self._cond.wait()

    def resume(self) -> None:
        """Let the loop run again."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        """End the loop (after the pass in flight); re-raise what ``forward`` raised, if anything."""
        self._stop.set()
        self.resume()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def between(self, t0: float, t1: float) -> list[tuple[float, Any]]:
        """The records whose pass completed inside ``[t0, t1]``."""
        return [r for r in list(self.records) if t0 <= r[0] <= t1]

    def stall(self, t0: float, t1: float) -> float:
        """The longest interval inside ``[t0, t1]`` with no pass completing (its ends count)."""
        times = [t0, *(t for t, _ in self.between(t0, t1)), t1]
        return max(b - a for a, b in zip(times, times[1:]))

    def typical(self, t0: float, t1: float) -> float:
        """The median interval between passes completing inside ``[t0, t1]`` (0 with fewer than two)."""
        times = [t for t, _ in self.between(t0, t1)]
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        return gaps[len(gaps) // 2] if gaps else 0.0
