"""Refits across hosts (network namespaces, 1 Gbit/s links): trainer fsdp=2 on host a, one engine replica on each
of hosts b and c, bit-exact refit after refit over P2P (gloo) and NIXL (UCX over TCP: ``"auto"`` between hosts),
every listener on its host's address only, a stranger on host d sending junk to every listener during the
refits, and a gloo group made by hand (as under torchrun) that finds its host's interface once refit is
imported."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refit.tools.cluster.job import Job, python_argv

from .helpers import STRANGER, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.multiproc, pytest.mark.timeout(600)]  # a loaded CI machine

PLACEMENT = ["a", "a", "b", "c"]  # processes 0-1: trainer ranks (fsdp=2), 2-3: engine ranks (tp=1, dp=2)
REFITS = 4


def _rank_argv(transport: str, *extra: str) -> list[str]:
    return python_argv(
        "refit.tools.cluster.rank",
        *("--src", "fsdp=2", "--dst", "tp=1,dp=2", "--refits", str(REFITS), "--transport", transport),
        *("--hosts", ",".join(PLACEMENT), "--deadline-s", "180", *extra),
    )


def _engine_bytes_in(cluster) -> dict[str, int]:
    return {h: cluster.counters(h)[0] for h in ("b", "c")}


def _stranger(cluster, listeners: dict, stop):
    targets = sorted({lst for h in ("a", "b", "c") for lst in listeners[h]})
    argv = [sys.executable, str(STRANGER), json.dumps(targets), str(stop)]
    stranger = cluster.spawn("d", argv, env={"REFIT_SECRET": ""}, stdout=subprocess.PIPE, text=True)
    assert stranger.stdout.readline().strip() == "started"
    return stranger


@pytest.fixture(scope="module", params=["p2p", "auto"])
def run(request, cluster, tmp_path_factory):
    """A job over P2P, or over ``"auto"`` (NIXL between hosts), paused after setup (every listener open)
    while the listeners are read and the stranger starts, then its refits with the stranger sending junk to
    every listener, then the listeners again."""
    sync = tmp_path_factory.mktemp("sync")
    before = _engine_bytes_in(cluster)
    job = Job(cluster, PLACEMENT, _rank_argv(request.param, "--sync", str(sync)))
    ranks = range(len(PLACEMENT))
    wait_for([sync / f"ready.{r}" for r in ranks], 300, job.procs)
    hosts = {h: cluster.host(h).address for h in ("a", "b", "c", "d")}
    at_ready = {h: cluster.listeners(h) for h in hosts}
    stop = sync / "stop-stranger"
    stranger = _stranger(cluster, at_ready, stop)
    (sync / "go").touch()
    wait_for([sync / f"done.{r}" for r in ranks], 300, job.procs)
    at_done = {h: cluster.listeners(h) for h in hosts}
    (sync / "exit").touch()
    try:
        results = job.wait(120)
    finally:
        stop.touch()
        stranger_report = json.loads(stranger.communicate(timeout=30)[0].strip().splitlines()[-1])
    after = _engine_bytes_in(cluster)
    return {
        "transport": {"p2p": "p2p", "auto": "nixl"}[request.param],  # "auto" between hosts: NIXL
        "results": results,
        "hosts": hosts,
        "listeners": [at_ready, at_done],
        "stranger": stranger_report,
        "bytes_in": {h: after[h] - before[h] for h in after},
    }


def test_refits_across_hosts_are_bit_exact_refit_after_refit(run):
    results = run["results"]
    assert [r["exact"] for r in results] == [[True] * REFITS] * len(PLACEMENT)
    assert [r["host"] for r in results] == [run["hosts"][h] for h in PLACEMENT]
    assert all(r["transports"] == [run["transport"]] for r in results)
    for rank, host in ((2, "b"), (3, "c")):  # every version crossed the engine host's own link
        assert run["bytes_in"][host] >= REFITS * results[rank]["bytes"], (host, run["bytes_in"])


def test_every_listener_is_on_its_hosts_address_only(run):
    hosts = run["hosts"]
    for when, listeners in zip(("after setup", "after the refits"), run["listeners"]):
        for h in ("a", "b", "c"):
            assert listeners[h], f"no listener on host {h} {when}"
            stray = [lst for lst in listeners[h] if lst[0] != hosts[h]]
            assert not stray, f"host {h} ({hosts[h]}) {when} listens on {stray}"
        assert listeners["d"] == [], listeners["d"]  # the stranger's host runs no refit process


def test_a_stranger_sending_junk_to_every_listener_changes_nothing(run):
    s = run["stranger"]
    # it reached every listener while the refits ran and delivered its junk to each (a listener may close a
    # connection before the junk is all sent: in one CI run 567 of 568 connections took all of it)
    assert s["connects"] > 0 and s["sent_to"] and all(n > 0 for n in s["sent_to"]), s
    assert all(r["exact"] == [True] * REFITS for r in run["results"])


BY_HAND = Path(__file__).with_name("by_hand.py")


def _by_hand(cluster, mode: str, port: int) -> list[subprocess.Popen]:
    store = f"{cluster.host('a').address}:{port}"
    return [
        cluster.spawn(h, [sys.executable, str(BY_HAND), mode, store], env={"REFIT_RANK": str(r)}, **PIPES)
        for r, h in enumerate(("a", "b"))
    ]


PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}


def test_a_gloo_group_made_by_hand_connects_across_hosts_once_refit_is_imported(cluster):
    with_refit, plain = _by_hand(cluster, "refit", 29611), _by_hand(cluster, "plain", 29612)
    outs = [p.communicate(timeout=180)[0] for p in with_refit]
    assert [p.returncode for p in with_refit] == [0, 0], outs
    assert all(o.splitlines()[-1] == "REFIT-RESULT 3" for o in outs), outs
    # the control: torch's own choice, the host name's address, is not reachable from the other host; the
    # rank that connects to it fails at once, the other waits for a connection that never comes (killed)
    end = time.monotonic() + 180
    while all(p.poll() is None for p in plain) and time.monotonic() < end:
        time.sleep(0.1)
    failed = [p for p in plain if p.poll() is not None]
    for p in plain:
        p.kill()
    outs = [p.communicate()[0] for p in plain]
    assert failed and failed[0].returncode == 3, outs
    assert any("Gloo" in o and "FAIL" in o for o in outs), outs
