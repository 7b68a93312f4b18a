"""RDMA NIC discovery and selection, and the UCX settings that follow from it.

``discover_nics(sysfs_root="/sys")`` reads ``<root>/class/infiniband/*``: per device its active
ports (rate in Gb/s from ``ports/N/rate``, ``state``, ``link_layer``), NUMA node and PCI path.
``discover_gpus`` reads NVIDIA GPUs from ``<root>/bus/pci/devices`` (PCI bus order).
``select_nics(gpu, nics, mode)`` picks for one GPU either the nearest single NIC (``auto``:
fewest PCI hops between the two, then the same NUMA node, then the name) or every NIC of the
compute fabric (``stripe``: those at the highest rate among the NICs that pass the minimum-rate
filter, nearest first) — a low-rate side-fabric NIC (a management or storage port) is never
striped over. ``ucx_env(nics, env)`` gives ``UCX_NET_DEVICES`` and, only when the environment
does not already set it, ``UCX_MAX_RMA_RAILS``.

Knobs from the environment: ``REFIT_NIC_MODE`` (``auto``, ``stripe`` or ``off``) and
``REFIT_NIC_MIN_RATE_GBPS`` (a number >= 0). A setting that is not valid (``nan``, ``inf``,
``-1``, ``abc``, an unknown mode) falls back to the default with a warning naming the
variable and the value; it never silently changes which NICs are used.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MODES = ("auto", "stripe", "off")


@dataclass(frozen=True)
class Nic:
    """One active RDMA port as ``discover_nics`` read it from sysfs: device ``name`` and
    ``port`` (``ucx_name``: ``"name:port"``, as ``UCX_NET_DEVICES`` wants it), its rate, NUMA
    node (None when unknown) and PCI path (compared with a ``Gpu``'s by ``pci_hops``)."""

    name: str  # e.g. mlx5_0
    port: int
    rate_gbps: float
    numa_node: int | None
    pci_path: tuple[str, ...]  # PCI devices from the root complex down, e.g. ("pci0000:17", "0000:17:01.0", ...)
    link_layer: str = "InfiniBand"

    @property
    def ucx_name(self) -> str:
        return f"{self.name}:{self.port}"


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU as ``discover_gpus`` read it from sysfs. ``index`` counts the node's GPUs
    in PCI bus order: CUDA's device index only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` with every
    GPU visible."""

    index: int  # in PCI bus order
    pci_address: str
    numa_node: int | None
    pci_path: tuple[str, ...]


def _read(p: Path, default: str = "") -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return default


def _numa(p: Path) -> int | None:
    try:
        n = int(_read(p, "-1"))
    except ValueError:
        return None
    return n if n >= 0 else None


def _pci_path(dev: Path, root: Path) -> tuple[str, ...]:
    real = Path(os.path.realpath(dev))
    try:
        rel = real.relative_to(Path(os.path.realpath(root)) / "devices")
    except ValueError:
        return tuple(real.parts[-4:])
    return tuple(rel.parts)


def _rate(text: str) -> float | None:
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else None


def discover_nics(sysfs_root: str | os.PathLike = "/sys") -> list[Nic]:
    """Active RDMA ports under ``<root>/class/infiniband``, sorted by name and port."""
    root = Path(sysfs_root)
    base = root / "class" / "infiniband"
    out: list[Nic] = []
    if not base.is_dir():
        return out
    for dev in sorted(base.iterdir()):
        ports = dev / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            state = _read(port / "state")
            rate = _rate(_read(port / "rate"))
            if "ACTIVE" not in state or rate is None:
                continue
            out.append(
                Nic(
                    dev.name,
                    int(port.name),
                    rate,
                    _numa(dev / "device" / "numa_node"),
                    _pci_path(dev / "device", root),
                    _read(port / "link_layer", "InfiniBand"),
                )
            )
    return out


def discover_gpus(sysfs_root: str | os.PathLike = "/sys") -> list[Gpu]:
    """NVIDIA display/3D controllers under ``<root>/bus/pci/devices``, in PCI bus order."""
    root = Path(sysfs_root)
    base = root / "bus" / "pci" / "devices"
    gpus = []
    if not base.is_dir():
        return gpus
    for dev in sorted(base.iterdir()):
        if _read(dev / "vendor") == "0x10de" and _read(dev / "class").startswith(("0x0302", "0x0300")):
            gpus.append((dev.name, _numa(dev / "numa_node"), _pci_path(dev, root)))
    return [Gpu(i, a, n, p) for i, (a, n, p) in enumerate(gpus)]


def pci_hops(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """Edges between two PCI devices through their deepest common bridge (different root
    complexes: through the CPU interconnect, counted as both full paths plus one)."""
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    if common == 0:
        return len(a) + len(b) + 1
    return (len(a) - common) + (len(b) - common)


def env_number(name: str, default: float | None, env: Mapping[str, str] | None = None) -> float | None:
    """A finite number >= 0 from the environment; unset or empty gives ``default``; anything
    else gives ``default`` and a warning naming the variable and the value."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        warnings.warn(f"{name}={raw!r} is not a finite number >= 0; using {default!r} instead", stacklevel=2)
        return default
    return v


def env_mode(env: Mapping[str, str] | None = None, default: str = "auto") -> str:
    """``REFIT_NIC_MODE`` (case-insensitive): one of ``MODES``; unset or empty gives ``default``,
    anything else ``default`` and a warning naming the value."""
    env = os.environ if env is None else env
    raw = env.get("REFIT_NIC_MODE")
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() not in MODES:
        warnings.warn(
            f"REFIT_NIC_MODE={raw!r} is not one of {', '.join(MODES)}; using {default!r} instead", stacklevel=2
        )
        return default
    return raw.strip().lower()


def compute_nics(nics: list[Nic], min_rate_gbps: float | None = None) -> list[Nic]:
    """The compute fabric: NICs at or above ``min_rate_gbps`` (default: none filtered), then
    only those at the highest rate left (side-fabric NICs are slower)."""
    kept = [n for n in nics if min_rate_gbps is None or n.rate_gbps >= min_rate_gbps]
    if not kept:
        return []
    top = max(n.rate_gbps for n in kept)
    return [n for n in kept if n.rate_gbps == top]


def select_nics(gpu: Gpu, nics: list[Nic], mode: str = "auto", min_rate_gbps: float | None = None) -> list[Nic]:
    """NICs for ``gpu``: ``auto`` the nearest one, ``stripe`` all compute NICs (nearest first),
    ``off`` none (leave UCX to choose). Empty when the node has no RDMA NIC."""
    if mode not in MODES:
        raise ValueError(f"select_nics: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return []
    cands = compute_nics(nics, min_rate_gbps)
    ranked = sorted(
        cands,
        key=lambda n: (
            pci_hops(gpu.pci_path, n.pci_path),
            0 if gpu.numa_node is not None and n.numa_node == gpu.numa_node else 1,
            n.name,
            n.port,
        ),
    )
    return ranked[:1] if mode == "auto" else ranked


def ucx_env(selected: list[Nic], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The UCX variables to set for ``selected`` (nothing when it is empty);
    ``UCX_MAX_RMA_RAILS`` only when the environment does not already set it."""
    env = os.environ if env is None else env
    if not selected:
        return {}
    out = {"UCX_NET_DEVICES": ",".join(n.ucx_name for n in selected)}
    if "UCX_MAX_RMA_RAILS" not in env:
        out["UCX_MAX_RMA_RAILS"] = str(len(selected))
    return out


def nic_settings(
    gpu_index: int, sysfs_root: str | os.PathLike = "/sys", env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What a process driving GPU ``gpu_index`` should export, from sysfs and the knobs."""
    mode = env_mode(env)
    min_rate = env_number("REFIT_NIC_MIN_RATE_GBPS", None, env)
    gpus = discover_gpus(sysfs_root)
    if not 0 <= gpu_index < len(gpus):
        raise ValueError(f"nic_settings: GPU {gpu_index} not found ({len(gpus)} NVIDIA GPUs under {sysfs_root})")
    return ucx_env(select_nics(gpus[gpu_index], discover_nics(sysfs_root), mode, min_rate), env)


def process_nics(
    device: str, sysfs_root: str | os.PathLike = "/sys", env: Mapping[str, str] | None = None
) -> list[Nic]:
    """The NICs a process on ``device`` (``"cuda:N"``, ``"cpu"``) should use, by ``REFIT_NIC_MODE`` and
    ``REFIT_NIC_MIN_RATE_GBPS``: for a GPU found in sysfs, ``select_nics``; otherwise (a CPU process, or
    a GPU sysfs does not list) no PCI locality is known: ``auto`` the first compute NIC, ``stripe`` all."""
    mode = env_mode(env)
    min_rate = env_number("REFIT_NIC_MIN_RATE_GBPS", None, env)
    nics = discover_nics(sysfs_root)
    if mode == "off" or not nics:
        return []
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        gpus = discover_gpus(sysfs_root)
        if 0 <= index < len(gpus):
            return select_nics(gpus[index], nics, mode, min_rate)
    cands = compute_nics(nics, min_rate)
    return cands[:1] if mode == "auto" else cands


def ucx_settings(selected: list[Nic], interface: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The UCX variables for a NIXL agent: ``UCX_NET_DEVICES`` lists the ``selected`` NICs' ports and
    ``interface`` (the network interface of the address refit's listeners bind to, so UCX's TCP
    wire-up listener binds there only: ``lo`` on one host; None: every interface, asked for by
    binding to ``0.0.0.0``), ``UCX_MAX_RMA_RAILS`` the number of NICs (``ucx_env``). A variable the
    environment already sets is the user's choice and is left out."""
    env = os.environ if env is None else env
    out = ucx_env(selected, env)
    devices = [n.ucx_name for n in selected] + ([interface] if interface else [])
    if devices and "UCX_NET_DEVICES" not in env:
        out["UCX_NET_DEVICES"] = ",".join(devices)
    else:
        out.pop("UCX_NET_DEVICES", None)
    return out
