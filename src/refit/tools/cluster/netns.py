"""The iproute2 steps the cluster harness is made of: namespaces, veth pairs, a bridge, ``tc`` shaping, the
processes inside a namespace. Each function is one command (or a few), run as root; a failing command raises
``ClusterError`` with the command and iproute2's message. Nothing here picks names or addresses: the harness does.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from refit.errors import RefitError

IP = "ip"
TC = "tc"


class ClusterError(RefitError, RuntimeError):
    """A namespace, link or qdisc could not be made or changed (the command and its error are named)."""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one command; with ``check``, ``ClusterError`` naming it and its stderr when it fails."""
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(
            f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip`` or ``tc``), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (this process is not root)"
    for tool in (IP, TC):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def namespaces() -> set[str]:
    """The names of every network namespace ``ip netns`` knows."""
    out = sh(IP, "netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def add_namespace(ns: str) -> None:
    """A new namespace with its loopback up (processes inside may use 127.0.0.1 among themselves)."""
    sh(IP, "netns", "add", ns)
    sh(IP, "-n", ns, "link", "set", "lo", "up")


def delete_namespace(ns: str) -> None:
    """Delete ``ns`` (the veth ends inside go with it, and so their peers); absent is fine."""
    if ns in namespaces():
        sh(IP, "netns", "del", ns)


def add_bridge(ns: str, bridge: str) -> None:
    sh(IP, "-n", ns, "link", "add", bridge, "type", "bridge")
    sh(IP, "-n", ns, "link", "set", bridge, "up")


def add_host_link(hub: str, bridge: str, host_ns: str, port: str, nic: str, address: str, prefix: int) -> None:
    """A veth pair: ``port`` on ``bridge`` in ``hub``, ``nic`` in ``host_ns`` holding ``address/prefix``; both up."""
    sh(IP, "-n", hub, "link", "add", port, "type", "veth", "peer", "name", nic, "netns", host_ns)
    sh(IP, "-n", hub, "link", "set", port, "master", bridge)
    sh(IP, "-n", hub, "link", "set", port, "up")
    sh(IP, "-n", host_ns, "addr", "add", f"{address}/{prefix}", "dev", nic)
    sh(IP, "-n", host_ns, "link", "set", nic, "up")


def one_arp_owner(ns: str) -> None:
    """In ``ns`` (a host with several NICs on one subnet), only the NIC holding an address answers ARP for it
    (``arp_ignore=1``) and asks with that NIC's own address (``arp_announce=2``): a peer reaches each address
    through its own NIC."""
    for key, value in (("arp_ignore", 1), ("arp_announce", 2)):
        sh(IP, "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.all.{key}={value}")


def route_from(ns: str, address: str, dev: str, network: str, table: int) -> None:
    """In ``ns``, what is sent from ``address`` to ``network`` leaves through ``dev`` (a policy rule to a table
    of its own: ``ip rule add from ADDRESS table TABLE``)."""
    sh(IP, "-n", ns, "route", "add", network, "dev", dev, "src", address, "table", str(table))
    sh(IP, "-n", ns, "rule", "add", "from", address, "table", str(table))


def set_link(ns: str, dev: str, up: bool) -> None:
    """Bring ``dev`` in ``ns`` up or down (a cable pulled and plugged back)."""
    sh(IP, "-n", ns, "link", "set", dev, "up" if up else "down")


def qdisc_kinds(ns: str, dev: str) -> list[str]:
    """The kinds of the qdiscs on ``dev`` in ``ns`` (``noqueue`` for an unshaped veth)."""
    out = sh(TC, "-n", ns, "qdisc", "show", "dev", dev).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("qdisc ")]


def shape(ns: str, dev: str, rate_bit: int | None, delay_ms: float, loss_pct: float) -> None:
    """Shape what ``dev`` in ``ns`` sends: a token bucket at ``rate_bit`` bit/s, under a ``netem`` qdisc for
    delay and loss when either is asked for (``None``/0: not shaped). Replaces any earlier shaping."""
    sh(TC, "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
    parent = ["root"]
    if delay_ms or loss_pct:
        netem = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%", "limit", "100000"]
        done = sh(TC, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem, check=False)
        if done.returncode != 0:
            raise ClusterError(
                f"delay_ms={delay_ms}, loss_pct={loss_pct} need tc's netem qdisc, which this kernel lacks "
                f"({done.stderr.strip()}): shape the rate only"
            )
        parent = ["parent", "1:1"]
    if rate_bit:
        burst = max(128 << 10, rate_bit // 8 // 1000)  # at least 1 ms of bytes, and a few GSO segments
        tbf = ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", "100ms"]
        sh(TC, "-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", *tbf)


GSO_MAX_SEGS = 65535  # the kernel's default: a veth sends TCP segments in batches of up to this many
_RANDOM = 0xFFFFF038  # classic BPF's ancillary load of a random 32-bit number (SKF_AD_OFF + SKF_AD_RANDOM)


def drop_bytecode(pct: float) -> str:
    """A classic-BPF program for ``tc``'s ``bpf da`` filter that drops ``pct`` % of packets at random
    (``TC_ACT_SHOT``) and passes the rest (``TC_ACT_OK``): loss without the ``netem`` qdisc."""
    if pct >= 100:
        return "1,6 0 0 2"  # drop everything
    threshold = round(pct / 100 * 2**32)  # drop when the random word is below it
    return f"4,32 0 0 {_RANDOM},53 0 1 {threshold},6 0 0 0,6 0 0 2"


def drop_inbound(ns: str, dev: str, pct: float) -> None:
    """Drop ``pct`` % of the packets ``dev`` in ``ns`` receives, each at random (100: all; 0: none, the
    filter removed), on ``tc``'s ``clsact`` ingress hook. The sender should send unbatched packets
    (``set_gso_segs(..., 1)``) so that a drop is one packet, not a batch of them."""
    sh(TC, "-n", ns, "qdisc", "del", "dev", dev, "clsact", check=False)
    if pct <= 0:
        return
    sh(TC, "-n", ns, "qdisc", "add", "dev", dev, "clsact")
    sh(TC, "-n", ns, "filter", "add", "dev", dev, "ingress", "bpf", "bytecode", drop_bytecode(pct), "da")


def inbound_drops(ns: str, dev: str) -> tuple[int, int]:
    """``(packets seen, packets dropped)`` by ``drop_inbound``'s filter on ``dev`` in ``ns`` so far."""
    out = sh(TC, "-s", "-n", ns, "qdisc", "show", "dev", dev).stdout
    m = re.search(r"qdisc clsact .*?\n\s*Sent \d+ bytes (\d+) pkt \(dropped (\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def set_gso_segs(ns: str, dev: str, segs: int) -> None:
    """How many TCP segments ``dev`` in ``ns`` may send as one batch (1: every packet on its own)."""
    sh(IP, "-n", ns, "link", "set", "dev", dev, "gso_max_segs", str(segs))


def listeners(ns: str) -> list[tuple[str, int]]:
    """Every listening TCP socket in ``ns`` as ``(address, port)``, IPv4 and IPv6 (``/proc/net/tcp{,6}`` read
    inside it); ``0.0.0.0`` and ``::`` mean every interface."""
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        text = sh(IP, "netns", "exec", ns, "cat", f"/proc/net/{table}").stdout
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) > 3 and cols[3] == "0A":  # TCP_LISTEN
                addr, port = cols[1].split(":")
                out.append((_proc_address(addr, family), int(port, 16)))
    return out


def _proc_address(hexaddr: str, family: int) -> str:
    """An address as ``/proc/net/tcp*`` writes it (32-bit words in host byte order) in the usual notation."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return socket.inet_ntop(family, words)


def counters(ns: str, dev: str) -> tuple[int, int]:
    """Bytes ``dev`` in ``ns`` has received and sent so far (``/sys/class/net/<dev>/statistics``)."""
    base = f"/sys/class/net/{dev}/statistics"
    text = sh(IP, "netns", "exec", ns, "cat", f"{base}/rx_bytes", f"{base}/tx_bytes").stdout.split()
    return int(text[0]), int(text[1])


def pids(ns: str) -> list[int]:
    """The processes inside namespace ``ns`` (``ip netns pids``); none when it is gone."""
    done = sh(IP, "netns", "pids", ns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()] if done.returncode == 0 else []


def kill_inside(ns: str, grace_s: float = 3.0) -> list[int]:
    """SIGTERM every process inside ``ns``, SIGKILL those left after ``grace_s``; returns the pids signalled.
    Only processes in a namespace this harness made are ever signalled."""
    first = pids(ns)
    for pid in first:
        _signal(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while pids(ns) and time.monotonic() < end:
        time.sleep(0.05)
    for pid in pids(ns):
        _signal(pid, signal.SIGKILL)
    end = time.monotonic() + grace_s
    while pids(ns) and time.monotonic() < end:
        time.sleep(0.05)
    return first


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"  # where ``ip netns add`` pins each namespace


def enter(ns: str | int) -> None:
    """Move the calling thread into network namespace ``ns`` (a name ``ip netns`` knows, or an open fd of one):
    the sockets it opens and the processes it starts from then on are that namespace's. ``ClusterError`` naming
    ``ns`` and the kernel's reason when it cannot (not root, no such namespace)."""
    import ctypes

    fd = ns if isinstance(ns, int) else os.open(f"{NETNS_DIR}/{ns}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise ClusterError(f"setns into network namespace {ns!r} failed: {os.strerror(err)}")
    finally:
        if not isinstance(ns, int):
            os.close(fd)


def run_inside(ns: str, target, args: tuple = ()):
    """``target(*args)`` in a fresh (single-threaded) process, inside namespace ``ns``: for a forked or
    forkserver child whose parent is elsewhere (``multiprocessing`` pickles ``target`` and ``args``)."""
    enter(ns)
    return target(*args)
