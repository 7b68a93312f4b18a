"""``refit cluster up | down | run | list``: hosts as network namespaces on this machine, to try a multi-host
plan on one machine (root and iproute2 needed).

* ``up [--hosts N | --host-names a,b,c] [--rate 1gbit] [--nics a=2] [--name NAME] [--json]``: make a cluster
  that stays until ``down``; prints each host's namespace, addresses and NICs.
* ``down NAME ... | --all``: kill every process inside its namespaces and remove them (also after a crash).
* ``run [--nic K] NAME HOST -- CMD ...``: run CMD inside HOST with ``REFIT_BIND_ADDRESS`` set to the address of
  its NIC K (default 0) and UCX on TCP; exits with CMD's status.
* ``list``: the clusters with a state file, and whether their namespaces are still there.

Bad input (a count, rate, name or host that does not fit) exits 2 with one line before anything is made
(``Cluster`` and ``LinkShape`` check the values; the flags are only parsed here); a command of ``ip`` or ``tc``
that fails exits 1 naming it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from refit.errors import ConfigError
from refit.tools.cluster import netns
from refit.tools.cluster.harness import Cluster, LinkShape, parse_rate
from refit.tools.cluster.netns import ClusterError


def add_cluster_parser(sub) -> None:
    """Add ``cluster`` and its four commands to the CLI's subparsers ``sub``."""
    p = sub.add_parser("cluster", help="hosts as network namespaces on this machine (root): up, down, run, list")
    cs = p.add_subparsers(dest="cluster_cmd", required=True)
    up = cs.add_parser("up", help="make a cluster that stays until `refit cluster down`")
    up.add_argument("--hosts", type=int, default=3, help="how many hosts (named a, b, c, ...)")
    up.add_argument("--host-names", default=None, help="the hosts' names, comma-separated (instead of --hosts)")
    up.add_argument("--rate", default=None, help="each host's link rate, both ways (e.g. 400mbit, 1gbit)")
    up.add_argument("--delay-ms", type=float, default=None, help="added delay (needs tc's netem)")
    up.add_argument("--loss-pct", type=float, default=None, help="random loss (needs tc's netem)")
    up.add_argument("--nics", default=None, help="hosts with more NICs than one, e.g. a=2 or a=2,b=4")
    up.add_argument("--name", default=None, help="the cluster's name (default refit-<tag>)")
    up.add_argument("--json", action="store_true", help="print the cluster as one JSON object")
    down = cs.add_parser("down", help="remove clusters: their processes, namespaces, links")
    down.add_argument("names", nargs="*")
    down.add_argument("--all", action="store_true", help="every cluster `refit cluster list` shows")
    run = cs.add_parser("run", help="run a command inside one host of a cluster")
    run.add_argument("name")
    run.add_argument("host")
    run.add_argument("--nic", type=int, default=0, help="the host's NIC whose address the command binds to")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command")
    cs.add_parser("list", help="the clusters with a state file")


def cmd_cluster(args: argparse.Namespace, console) -> int:
    """Dispatch ``refit cluster <cmd>``; a failing ``ip``/``tc`` command prints one line and returns 1."""
    command = {"up": _up, "down": _down, "run": _run, "list": _list}[args.cluster_cmd]
    try:
        return command(args, console)
    except ClusterError as e:
        print(f"refit: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


def _cluster_from(args: argparse.Namespace) -> Cluster:
    hosts = [h.strip() for h in args.host_names.split(",")] if args.host_names else args.hosts
    rate = parse_rate(args.rate) if args.rate else None
    shape = LinkShape(rate, args.delay_ms or 0.0, args.loss_pct or 0.0)
    return Cluster(hosts, shape, name=args.name, nics=_nics(args.nics))


def _nics(text: str | None) -> dict[str, int]:
    """``--nics a=2,b=4`` as ``{"a": 2, "b": 4}``; ``ConfigError`` naming the text when it does not parse."""
    out: dict[str, int] = {}
    for item in (text or "").split(","):
        host, _, count = item.strip().partition("=")
        if not item.strip():
            continue
        if not count.strip().isdigit():
            raise ConfigError(f"--nics {text!r} is not HOST=COUNT[,HOST=COUNT...], e.g. a=2")
        out[host.strip()] = int(count)
    return out


def _up(args: argparse.Namespace, console) -> int:
    cluster = _cluster_from(args)  # every argument checked before anything is made
    cluster.up(keep=True)
    if args.json:
        print(json.dumps(cluster.describe()))
        return 0
    console.print(f"cluster {cluster.name} (remove it with `refit cluster down {cluster.name}`)")
    for h in cluster.hosts.values():
        rate = f"{h.shape.rate_bit / 1e9:g} Gbit/s" if h.shape.rate_bit else "unshaped"
        nics = ", ".join(f"{n.address} on {n.dev}" for n in h.nics)
        console.print(f"  host {h.name}: {nics} in namespace {h.netns}, {rate}")
    console.print(f"run a process in a host: refit cluster run {cluster.name} {next(iter(cluster.hosts))} -- CMD")
    return 0


def _down(args: argparse.Namespace, console) -> int:
    names = Cluster.names() if args.all else args.names
    if not names and not args.all:
        raise ConfigError("cluster down: name a cluster (or --all)")
    clusters = [Cluster.load(n) for n in names]  # every name checked before anything is removed
    for c in clusters:
        c.down()
        console.print(f"removed cluster {c.name}")
    return 0


def _run(args: argparse.Namespace, console) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("cluster run: give the command after --, e.g. refit cluster run NAME a -- python x.py")
    cluster = Cluster.load(args.name)
    env = cluster.process_env(args.host, nic=args.nic)  # ConfigError naming a host or NIC the cluster lacks
    return subprocess.run(cluster.command(args.host, argv), env=env).returncode


def _list(args: argparse.Namespace, console) -> int:
    present = netns.namespaces()
    for name in Cluster.names():
        c = Cluster.load(name)
        up = sum(ns in present for ns in c.namespaces)
        hosts = ", ".join(f"{h.name}={h.address}" for h in c.hosts.values())
        console.print(f"{name}: {hosts} ({up} of {len(c.namespaces)} namespaces present)")
    return 0
