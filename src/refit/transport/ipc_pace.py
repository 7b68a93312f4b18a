"""Pacing IPC pulls to ``TransferConfig.pull_gbps`` (refit while generating: the pull leaves the engine its
memory bandwidth): pulls cut into runs (``pace_chunks``), each followed on its stream by a GPU sleep
(``then_sleep``) sized by the device's measured sleep rate (``sleep_cycles_per_s``); ``check_pace`` refuses a
pace that could not finish within the deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from refit.config import TransferConfig
from refit.cudart import free_stream, private_stream
from refit.errors import ConfigError
from refit.plan import Plan


def check_pace(plan: Plan, proc: int, config: TransferConfig) -> None:
    """``ConfigError`` when ``config.pull_gbps`` would make this process's IPC pulls take more than half of
    ``config.deadline_s`` (every refit would abort, and the sleeps already queued would still hold its
    stream): called before pre-flight, naming both numbers."""
    if not config.pull_gbps:
        return
    pulled = sum(
        p.nbytes for m in plan.messages if m.transport == "ipc" and plan.procs.dst[m.dst] == proc for p in m.pieces
    )
    seconds = pulled / (config.pull_gbps * 1e9)
    if seconds > config.deadline_s / 2:
        raise ConfigError(
            f"TransferConfig.pull_gbps={config.pull_gbps:g} paces process {proc}'s {pulled / 1e9:.2f} GB of IPC "
            f"pulls to at least {seconds:.1f} s, more than half of deadline_s={config.deadline_s:g}; raise "
            "pull_gbps (or deadline_s)"
        )


def pace_chunks(d: torch.Tensor, s: torch.Tensor, chunk: int | None):
    """``(dst, src)`` cut into flat runs of at most ``chunk`` bytes where both are contiguous (else whole)."""
    nbytes = d.numel() * d.element_size()
    if chunk is None or nbytes <= chunk or not (d.is_contiguous() and s.is_contiguous()):
        return [(d, s)]
    step = max(1, chunk // d.element_size())
    fd, fs = d.view(-1), s.view(-1)
    return [(fd[i : i + step], fs[i : i + step]) for i in range(0, fd.numel(), step)]


def then_sleep(fn: Callable[[torch.cuda.Stream], None], cycles: int) -> Callable[[torch.cuda.Stream], None]:
    def paced(stream: torch.cuda.Stream) -> None:
        fn(stream)
        if cycles > 0:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)

    return paced


_SLEEP_RATES: dict[torch.device, float] = {}


def sleep_cycles_per_s(device: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles make one second on ``device``, measured once per device and
    process on a private stream (no other work queued between the events): a 20 ms spin first (the clocks
    ramp up), then the fastest of three 10 ms spins, so a slow reading never makes the sleeps too short.
    The sleeps count SM cycles: under a lower clock later they last longer (the pace is then slower)."""
    if device not in _SLEEP_RATES:
        cycles, best = 20_000_000, 0.0
        stream = private_stream(device)
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)  # loaded, and the clocks up
                for _ in range(3):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    torch.cuda._sleep(cycles // 2)
                    end.record(stream)
                    end.synchronize()
                    best = max(best, (cycles // 2) / (start.elapsed_time(end) / 1e3))
        finally:
            free_stream(stream)
        _SLEEP_RATES[device] = best
    return _SLEEP_RATES[device]
