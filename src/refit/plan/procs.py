"""Which process hosts each side-local rank, and on which device and host (``ProcessMap``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessMap:
    """Which global process hosts each side-local rank, and (optionally) each process's device.

    ``devices[p]`` is ``"cuda:0"``, ``"cpu"`` or ``"host/cuda:1"``; without a host
    prefix every process is on one host. Without ``devices`` every process is
    taken to have a device of its own.
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]
    devices: tuple[str, ...] | None = None

    def device_of(self, proc: int) -> str:
        return self.devices[proc] if self.devices is not None else f"proc{proc}"

    def host_of(self, proc: int) -> str:
        d = self.device_of(proc)
        return d.split("/", 1)[0] if "/" in d else "localhost"

    def same_device(self, a: int, b: int) -> bool:
        return a == b or (self.devices is not None and self.device_of(a) == self.device_of(b))

    def ipc_capable(self, a: int, b: int) -> bool:
        """Both processes on one host, both on CUDA devices."""
        return (
            self.devices is not None
            and self.host_of(a) == self.host_of(b)
            and "cuda" in self.device_of(a)
            and "cuda" in self.device_of(b)
        )

    def with_devices(self, devices) -> ProcessMap:
        return ProcessMap(self.src, self.dst, tuple(devices))

    @classmethod
    def disjoint(cls, n_src: int, n_dst: int) -> ProcessMap:
        """Trainer ranks are processes ``0..n_src-1``, engine ranks follow."""
        return cls(tuple(range(n_src)), tuple(range(n_src, n_src + n_dst)))

    @classmethod
    def colocated(cls, n_src: int, n_dst: int) -> ProcessMap:
        """Source rank i and destination rank i share process i."""
        return cls(tuple(range(n_src)), tuple(range(n_dst)))

    @property
    def world_size(self) -> int:
        return len(set(self.src) | set(self.dst))
