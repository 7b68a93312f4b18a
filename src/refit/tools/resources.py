"""Memory a local run needs against what this machine has: a run that cannot fit is refused before any
process starts (``ConfigError`` with both numbers), not discovered by the OOM killer half way.

The tools (``verify``, ``soak``, ``demo``, ``--inject``) estimate a lower bound of the bytes their
processes hold together from the layouts (``held_bytes``) and call ``check_memory`` before ``run_local``.
"""

from __future__ import annotations

import os

from refit.errors import ConfigError
from refit.layout import ModelLayout, box_numel

GIB = 1 << 30


def held_bytes(layout: ModelLayout) -> int:
    """Bytes all ranks of ``layout`` hold together (a replicated box counts once per rank holding it)."""
    return sum(box_numel(box) * t.itemsize * len(ranks) for t in layout for box, ranks in t.holders().items())


def available_memory() -> int | None:
    """Bytes this machine can still give its processes: psutil's ``available`` (else ``MemAvailable`` in
    /proc/meminfo, else free pages from ``os.sysconf``), lowered to a cgroup v2 limit's headroom; None if
    none of them can be read."""
    have = _system_available()
    limit = _cgroup_headroom()
    if have is None or limit is None:
        return have if limit is None else limit
    return min(have, limit)


def check_memory(need: int, what: str) -> None:
    """``ConfigError`` naming both numbers if ``need`` bytes exceed ``available_memory()``."""
    have = available_memory()
    if have is not None and need > have:
        raise ConfigError(
            f"{what} needs at least {need / GIB:.1f} GiB of memory, but this machine has {have / GIB:.1f} GiB "
            "available (plan such layouts with `refit plan`)"
        )


def _system_available() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_headroom() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup (v2); None without a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        return None if limit == "max" else max(int(limit) - used, 0)
    except (OSError, ValueError):
        return None


def rank_bytes(layout: ModelLayout, rank: int) -> int:
    """Bytes rank ``rank`` of ``layout`` holds."""
    return sum(box_numel(box) * t.itemsize for t, box in layout.local_tensors(rank))


def device_available(device: str) -> int | None:
    """Bytes ``device`` can still give: this machine's (``available_memory``) for ``cpu``, the free
    memory CUDA reports for ``cuda:<i>``; None if it cannot be read."""
    if not device.startswith("cuda"):
        return available_memory()
    import torch

    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} does not exist here ({torch.cuda.device_count()} CUDA devices)")
    return int(torch.cuda.mem_get_info(index)[0])


def check_devices(need: dict[str, int], what: str) -> None:
    """``ConfigError`` naming the device and both numbers if one of ``need`` (device -> bytes its
    processes hold together) exceeds what that device has available. Called before anything is allocated."""
    for device, n in need.items():
        have = device_available(device)
        if have is not None and n > have:
            raise ConfigError(
                f"{what} needs at least {n / GIB:.1f} GiB on {device}, which has {have / GIB:.1f} GiB available"
            )
