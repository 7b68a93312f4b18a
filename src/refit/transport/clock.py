"""One refit's clock: its deadline and the check for another process's abort, polled by every wait."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from refit.errors import DeadlineExceeded

SPIN_S = 200e-6
"""How long a host wait spins before it yields the GIL on every poll (a wait this short holds it briefly)."""
YIELD_S = 0.01
"""How long a host wait then polls back to back, yielding the core between polls (``sched_yield``): a GPU copy of a
few milliseconds is seen done within microseconds; a longer wait then sleeps between polls (a loaded CPU machine's
waiting processes do not take the cores from those doing the work)."""


class RunClock:
    """The deadline (``time.monotonic()`` value, or None) and abort check (or None) of one run.

    Made per run by the executor and handed to every blocking wait of that run; holds no other state.
    """

    def __init__(self, deadline: float | None = None, check_abort: Callable[[], None] | None = None) -> None:
        self.deadline = deadline
        self.check_abort = check_abort

    @property
    def bounded(self) -> bool:
        """Whether waits must poll (a deadline or an abort check); otherwise they may block."""
        return self.deadline is not None or self.check_abort is not None

    def left(self) -> float | None:
        """Seconds until the deadline (0 once past it), or None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def watch(self, finished: Callable[[], bool], pending: Callable[[], str]) -> None:
        """Poll ``finished`` until it is true, giving up at the deadline and checking the side
        channel every 20 ms for another process's abort (the first ``SPIN_S`` spin, then each poll yields the
        GIL and the core (``sched_yield``: under a microsecond when nothing else wants them, where ``time.sleep(0)``
        sleeps for the kernel's timer slack, 50-60 us, and so sees the end of a wait that much later) until
        ``YIELD_S``, then sleeps for that slack a poll, and after 50 ms 0.1 ms)."""
        start = time.monotonic()
        next_check = start + 0.02
        while not finished():
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline:
                raise DeadlineExceeded(f"{pending()} still pending at the deadline")
            if self.check_abort is not None and now >= next_check:
                self.check_abort()
                next_check = now + 0.02
            if now - start > YIELD_S:
                time.sleep(0.0001 if now - start > 0.05 else 0)
            elif now - start >= SPIN_S:
                # then yield the GIL on every poll: a spinning waiter holds it for the interpreter's switch
                # interval (5 ms), so an engine thread beside the refit (refit while generating) would wait
                # that long per pass (os.sched_yield releases the GIL around the call)
                os.sched_yield()
