"""A cluster of N hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

Layout (``tag``: six random hex digits, in every name, so parallel clusters never collide)::

    refit-<tag>-hub            a namespace holding the bridge rfb-<tag> and one port rfp-<tag>-<i> per host
    refit-<tag>-<host>         one namespace per host: loopback, and rfn-<tag>-<i> = <address>/15 (its NIC)

Addresses are 198.18.0.1, 198.18.0.2, ... (the benchmarking range 198.18.0.0/15), and exist only inside the
namespaces made here: the machine's own namespace gets no address, route or link. Each host's link is shaped in
both directions (``LinkShape``): on its NIC (what it sends) and on its bridge port (what it receives).

A host may have more NICs (``nics={"a": 2}``): NIC ``k`` of host ``i`` is rfn-<tag>-<i>n<k> (port
rfp-<tag>-<i>n<k>) holding 198.18.<k>.<i+1>, each its own veth to the bridge, shaped like the host's link. Inside
such a host, source-address policy routing (``ip rule from <address> table 100+k``) sends what a socket bound to a
NIC's address sends through that NIC, and only the NIC holding an address answers ARP for it (``arp_ignore=1``,
``arp_announce=2``): each NIC is a link of its own, as a multi-NIC server's are.

Lifecycle: ``Cluster(...)`` only checks its arguments; ``up()`` (or ``with Cluster(...) as c``) writes the state
file ``<state_dir>/<name>.json`` first, then makes everything; ``down()`` kills every process inside the
namespaces, deletes them (the veths and the bridge go with them) and the state file. ``down()`` runs at exit
(``atexit``), on SIGINT/SIGTERM (then the signal goes on to the previous handler) and when the ``with`` block
ends, also by an exception; ``Cluster.load(name).down()`` cleans up after a process that died without it.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from refit.errors import ConfigError
from refit.tools.cluster import netns
from refit.tools.cluster.netns import ClusterError

STATE_ENV = "REFIT_CLUSTER_STATE"
STATE_DIR = "/run/refit-cluster"
NETWORK = ipaddress.ip_network("198.18.0.0/15")
MAX_HOSTS = 64
MAX_NICS = 8
RULE_TABLE = 100  # NIC k's routes are in table RULE_TABLE + k of its host's namespace
MACHINE_ONLY = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "REFIT_UCX_SET")
"""Variables naming this machine's interfaces: not passed on to a host's processes (its interfaces differ)."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
_HOST = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(text: str) -> int:
    """``"400mbit"``, ``"1gbit"``, ``"2.5g"``, ``"100000"`` (bit/s) as bit/s; ``ConfigError`` naming the text."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(?:bit)?\s*", text.lower())
    if not m:
        raise ConfigError(f"rate {text!r} is not a rate such as 400mbit or 1gbit")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class LinkShape:
    """How one host's link is shaped, the same both ways: ``rate_bit`` bit/s (None: unshaped), ``delay_ms``
    and ``loss_pct`` (need the kernel's ``netem`` qdisc; ``ClusterError`` at ``up()`` where it is missing)."""

    rate_bit: int | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bit is not None and self.rate_bit < 100_000:
            raise ConfigError(f"rate_bit={self.rate_bit} is below 100 kbit/s")
        if not 0 <= self.delay_ms <= 10_000:
            raise ConfigError(f"delay_ms={self.delay_ms} is not within 0..10000")
        if not 0 <= self.loss_pct < 100:
            raise ConfigError(f"loss_pct={self.loss_pct} is not within 0..100 (exclusive)")

    @property
    def bytes_per_s(self) -> float | None:
        """The link's rate in bytes per second (None: unshaped)."""
        return None if self.rate_bit is None else self.rate_bit / 8


@dataclass(frozen=True)
class Nic:
    """One NIC of a host: its address, its device (inside the host's namespace) and its bridge port (in the hub)."""

    address: str
    dev: str
    port: str


@dataclass(frozen=True)
class Host:
    """One host: its name, namespace, address, NIC (inside its namespace) and bridge port (in the hub); ``more``:
    its further NICs (NIC 1, 2, ...)."""

    name: str
    netns: str
    address: str
    nic: str
    port: str
    shape: LinkShape = field(default_factory=LinkShape)
    more: tuple[Nic, ...] = ()

    @property
    def nics(self) -> list[Nic]:
        """Every NIC of the host, NIC 0 (``address``, ``nic``, ``port``) first."""
        return [Nic(self.address, self.nic, self.port), *self.more]

    def nic_at(self, k: int) -> Nic:
        """NIC ``k``; ``ConfigError`` naming the host's NIC count when it has no such NIC."""
        if not isinstance(k, int) or not 0 <= k < 1 + len(self.more):
            raise ConfigError(f"nic={k!r} is not a NIC of host {self.name!r} (it has {1 + len(self.more)})")
        return self.nics[k]


def host_names(n: int) -> list[str]:
    """``a, b, c, ...`` for up to 26 hosts, then ``h26, h27, ...``."""
    return [chr(ord("a") + i) if i < 26 else f"h{i}" for i in range(n)]


def state_dir() -> Path:
    return Path(os.environ.get(STATE_ENV) or STATE_DIR)


class Cluster:
    """N hosts as network namespaces on one machine (see the module docstring for names and lifecycle).

    ``hosts``: a count or the host names (lower-case, up to 8 characters); ``shape``: one ``LinkShape`` for
    every host or one per host name (hosts not named are unshaped); ``name``: the state file's name (default
    ``refit-<tag>``); ``nics``: the NIC count of hosts with more than one (host name -> 1..8).
    ``spawn(host, argv, nic=k)`` starts a process inside a host; ``env(host, k)`` is what it gets on top of
    this process's environment (``REFIT_BIND_ADDRESS``: the address of the host's NIC ``k``).
    """

    def __init__(
        self,
        hosts: int | Sequence[str] = 3,
        shape: LinkShape | Mapping[str, LinkShape] | None = None,
        name: str | None = None,
        tag: str | None = None,
        nics: Mapping[str, int] | None = None,
    ) -> None:
        names = host_names(hosts) if isinstance(hosts, int) else list(hosts)
        if not 1 <= len(names) <= MAX_HOSTS:
            raise ConfigError(f"hosts={len(names)} is not within 1..{MAX_HOSTS}")
        bad = [h for h in names if not _HOST.match(h)] or sorted({h for h in names if names.count(h) > 1})
        if bad:
            raise ConfigError(f"host names {bad} are not unique lower-case names of up to 8 characters")
        shapes = shape if isinstance(shape, Mapping) else dict.fromkeys(names, shape or LinkShape())
        unknown = sorted(set(shapes) - set(names))
        if unknown:
            raise ConfigError(f"shape names hosts {unknown} that are not in hosts {names}")
        nics = dict(nics or {})
        unknown = sorted(set(nics) - set(names))
        if unknown:
            raise ConfigError(f"nics names hosts {unknown} that are not in hosts {names}")
        bad = {h: n for h, n in nics.items() if not isinstance(n, int) or not 1 <= n <= MAX_NICS}
        if bad:
            raise ConfigError(f"nics={bad}: a host's NIC count is not within 1..{MAX_NICS}")
        self.tag = tag or secrets.token_hex(3)
        self.name = name or f"refit-{self.tag}"
        if not _NAME.match(self.name):
            raise ConfigError(f"cluster name {self.name!r} is not 1-40 letters, digits, '.', '_' or '-'")
        self.hub = f"refit-{self.tag}-hub"
        self.bridge = f"rfb-{self.tag}"
        self.hosts = {
            h: Host(
                h,
                f"refit-{self.tag}-{h}",
                str(NETWORK.network_address + i + 1),
                f"rfn-{self.tag}-{i}",
                f"rfp-{self.tag}-{i}",
                shapes.get(h) or LinkShape(),
                tuple(
                    Nic(
                        str(NETWORK.network_address + 256 * k + i + 1),
                        f"rfn-{self.tag}-{i}n{k}",
                        f"rfp-{self.tag}-{i}n{k}",
                    )
                    for k in range(1, nics.get(h, 1))
                ),
            )
            for i, h in enumerate(names)
        }
        self.procs: list[subprocess.Popen] = []
        self._live = False
        self._lock = threading.RLock()
        self._previous: dict[int, object] = {}

    # -- making and removing -------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return state_dir() / f"{self.name}.json"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this cluster makes: the hosts', then the hub."""
        return [h.netns for h in self.hosts.values()] + [self.hub]

    def up(self, keep: bool = False) -> Cluster:
        """Make the cluster (state file first, so a crash half-way can be cleaned up by name); on any failure
        what was made is removed and the error raised. ``ClusterError`` where namespaces cannot be made.
        ``keep``: once made, it outlives this process (``refit cluster up``): no teardown at exit or on a
        signal; ``Cluster.load(name).down()`` removes it."""
        why = netns.unavailable()
        if why:
            raise ClusterError(f"cannot make cluster {self.name!r}: {why}")
        if self.state_file.exists():
            raise ConfigError(f"a cluster named {self.name!r} exists ({self.state_file}): `refit cluster down` it")
        self._write_state()
        self._live = True
        atexit.register(self.down)
        self._catch_signals()
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        if keep:
            atexit.unregister(self.down)
            self._release_signals()
        return self

    def _make(self) -> None:
        netns.add_namespace(self.hub)
        netns.add_bridge(self.hub, self.bridge)
        for h in self.hosts.values():
            netns.add_namespace(h.netns)
            for n in h.nics:
                netns.add_host_link(self.hub, self.bridge, h.netns, n.port, n.dev, n.address, NETWORK.prefixlen)
            if h.more:
                netns.one_arp_owner(h.netns)
                for k, n in enumerate(h.nics):
                    netns.route_from(h.netns, n.address, n.dev, str(NETWORK), RULE_TABLE + k)
            self.shape(h.name, h.shape)

    def down(self) -> list[str]:
        """Kill every process inside the cluster's namespaces, delete them and the state file; safe to call
        again. Returns what was still there afterwards (``leftovers``), raising ``ClusterError`` if any."""
        with self._lock:
            if self._live:
                self._live = False
                atexit.unregister(self.down)
                self._release_signals()
                for ns in self.namespaces:
                    netns.kill_inside(ns)
                    netns.delete_namespace(ns)
                for p in self.procs:
                    p.poll()
                self.state_file.unlink(missing_ok=True)
        left = self.leftovers()
        if left:
            raise ClusterError(f"cluster {self.name!r} left behind: {', '.join(left)}")
        return left

    def leftovers(self) -> list[str]:
        """Anything of this cluster still on the machine: namespaces, links in this namespace with the tag,
        processes inside its namespaces, the state file."""
        out = [f"namespace {ns}" for ns in sorted(set(self.namespaces) & netns.namespaces())]
        out += [f"process {pid} in {ns}" for ns in self.namespaces for pid in netns.pids(ns)]
        links = netns.sh(netns.IP, "-o", "link", "show").stdout
        out += [f"link {line.split(':')[1].strip()}" for line in links.splitlines() if self.tag in line]
        if self.state_file.exists():
            out.append(f"state file {self.state_file}")
        return out

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- signals -------------------------------------------------------------------------------
    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers: atexit and ``with`` still clean up
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _release_signals(self) -> None:
        for sig, old in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, old)
        self._previous.clear()

    def _on_signal(self, sig: int, frame: object) -> None:
        old = self._previous.get(sig, signal.SIG_DFL)
        self.down()
        if callable(old):
            old(sig, frame)
        elif old != signal.SIG_IGN:  # the default action: the signal again, with its default handler
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)

    # -- state ---------------------------------------------------------------------------------
    def _write_state(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "name": self.name,
            "tag": self.tag,
            "hosts": [asdict(h) for h in self.hosts.values()],
            "owner_pid": os.getpid(),
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, name: str) -> Cluster:
        """The cluster a state file names (made by this or another process), to ``down()`` or ``spawn`` in."""
        path = state_dir() / f"{name}.json"
        if not _NAME.match(name) or not path.exists():
            raise ConfigError(f"no cluster named {name!r} (no {path}); `refit cluster list` shows them")
        state = json.loads(path.read_text())
        hosts = [
            Host(**{**h, "shape": LinkShape(**h["shape"]), "more": tuple(Nic(**n) for n in h.get("more", ()))})
            for h in state["hosts"]
        ]
        nics = {h.name: len(h.nics) for h in hosts}
        c = cls([h.name for h in hosts], {h.name: h.shape for h in hosts}, state["name"], state["tag"], nics)
        c._live = True
        return c

    @staticmethod
    def names() -> list[str]:
        """The names of the clusters with a state file."""
        return sorted(p.stem for p in state_dir().glob("*.json")) if state_dir().is_dir() else []

    # -- using it ------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        if name not in self.hosts:
            raise ConfigError(f"host {name!r} is not in cluster {self.name!r} (hosts: {', '.join(self.hosts)})")
        return self.hosts[name]

    def env(self, host: str, nic: int = 0) -> dict[str, str]:
        """What a process on ``host`` using its NIC ``nic`` gets on top of the caller's environment: its bind
        address (that NIC's), and UCX's TCP transport only (the namespaces share one kernel and memory: UCX
        would otherwise move bytes between "hosts" through shared memory or CMA, which separate machines
        cannot)."""
        return {"REFIT_BIND_ADDRESS": self.host(host).nic_at(nic).address, "UCX_TLS": "tcp"}

    def process_env(self, host: str, env: Mapping[str, str] | None = None, nic: int = 0) -> dict[str, str]:
        """The whole environment of a process on ``host`` (NIC ``nic``): this process's without
        ``MACHINE_ONLY``, then ``env(host, nic)``, then ``env``."""
        mine = {k: v for k, v in os.environ.items() if k not in MACHINE_ONLY}
        return {**mine, **self.env(host, nic), **(env or {})}

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside ``host``'s namespace."""
        return [netns.IP, "netns", "exec", self.host(host).netns, *argv]

    def spawn(
        self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, nic: int = 0, **popen
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host``, bound to its NIC ``nic`` (environment: ``process_env(host, env,
        nic)``); tracked, and killed by ``down()`` with anything it started in the namespace."""
        if not self._live:
            raise ClusterError(f"cluster {self.name!r} is not up")
        environ = self.process_env(host, env, nic)
        p = subprocess.Popen(self.command(host, argv), env=environ, start_new_session=True, **popen)
        self.procs.append(p)
        return p

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[Host]:
        """The calling thread inside ``host``'s namespace for the block, then back where it was: what it
        connects to, listens on and starts (``subprocess``, threads) meanwhile is that host's, as if this
        code ran there. Leave the block before ``down()`` (which kills every process inside a host)."""
        where = self.host(host)
        if not self._live:
            raise ClusterError(f"cluster {self.name!r} is not up")
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            netns.enter(where.netns)
            try:
                yield where
            finally:
                netns.enter(back)
        finally:
            os.close(back)

    def listeners(self, host: str) -> list[tuple[str, int]]:
        """Every listening TCP socket inside ``host``: ``(address, port)``."""
        return netns.listeners(self.host(host).netns)

    def counters(self, host: str, nic: int = 0) -> tuple[int, int]:
        """Bytes ``host``'s NIC ``nic`` has received and sent so far."""
        h = self.host(host)
        return netns.counters(h.netns, h.nic_at(nic).dev)

    def _ends(self, host: str) -> list[tuple[str, str]]:
        """Both ends of each of ``host``'s links: ``(namespace, device)``, the host's NIC then its bridge port."""
        h = self.host(host)
        return [end for n in h.nics for end in ((h.netns, n.dev), (self.hub, n.port))]

    def set_link(self, host: str, up: bool) -> None:
        """Take ``host``'s links down (both ends of each: it is cut off) or bring them back up."""
        for ns, dev in reversed(self._ends(host)):  # the bridge port first
            netns.set_link(ns, dev, up)

    def drop(self, host: str, loss_pct: float) -> None:
        """Drop ``loss_pct`` % of the packets crossing ``host``'s link each way, each at random, without the
        ``netem`` qdisc (a classic-BPF filter on each end's ``clsact`` ingress; both ends send unbatched
        packets meanwhile). 100: the host is partitioned, its link up and nothing crossing it; 0: undone."""
        if not 0 <= loss_pct <= 100:
            raise ConfigError(f"loss_pct={loss_pct} is not within 0..100")
        for ns, dev in self._ends(host):
            netns.set_gso_segs(ns, dev, 1 if loss_pct else netns.GSO_MAX_SEGS)
            netns.drop_inbound(ns, dev, loss_pct)

    def dropped(self, host: str) -> tuple[int, int]:
        """``(packets seen, packets dropped)`` by ``drop``'s filters on ``host``'s link so far, both ways."""
        both = [netns.inbound_drops(ns, dev) for ns, dev in self._ends(host)]
        return sum(b[0] for b in both), sum(b[1] for b in both)

    def shape(self, host: str, shape: LinkShape) -> None:
        """Shape each of ``host``'s links both ways (its NIC's sends, its bridge port's sends toward it)."""
        h = self.host(host)
        for ns, dev in self._ends(host):
            netns.shape(ns, dev, shape.rate_bit, shape.delay_ms, shape.loss_pct)
        self.hosts[host] = replace(h, shape=shape)
        self._write_state()  # ``load`` sees the link as it is now

    def describe(self) -> dict:
        """The cluster as plain data: name, tag and each host's namespace, address, NIC and shape."""
        return {"name": self.name, "tag": self.tag, "hosts": [asdict(h) for h in self.hosts.values()]}
