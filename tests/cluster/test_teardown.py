"""The cluster harness leaves nothing behind: after a ``with`` block, a block that raised, a SIGINT or SIGTERM to
the process that made it, and ``refit cluster down`` after that process was SIGKILLed, no namespace, link, qdisc,
process or state file of the cluster is left (``ip netns list``, ``ip link``, ``/proc``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from refit.tools.cli import main as refit_main
from refit.tools.cluster import Cluster, LinkShape, netns, parse_rate

from .helpers import skip_without_namespaces

pytestmark = pytest.mark.cluster

# a host process that starts a child of its own: teardown must reach both
TREE = ["sh", "-c", "sleep 300 & sleep 300"]


def _nothing_of(tag: str, pids: list[int]) -> None:
    assert not [ns for ns in netns.namespaces() if tag in ns], netns.namespaces()
    links = netns.sh("ip", "-o", "link", "show").stdout
    assert tag not in links, links
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
    assert not alive, f"processes {alive} outlived the cluster"


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_cluster_is_made_as_described_and_leaves_nothing_behind():
    skip_without_namespaces()
    with Cluster(["a", "b"], LinkShape(parse_rate("400mbit"))) as c:
        spawned = [c.spawn(h.name, TREE).pid for h in c.hosts.values()]
        assert set(c.namespaces) <= netns.namespaces()
        assert c.host("b").address == "198.18.0.2" and c.state_file.exists()
        for h in c.hosts.values():
            assert netns.qdisc_kinds(h.netns, h.nic) == ["tbf"]  # both directions of each link shaped
            assert netns.qdisc_kinds(c.hub, h.port) == ["tbf"]
        pids = [p for ns in c.namespaces for p in netns.pids(ns)]
        assert set(spawned) < set(pids)  # the shells and the sleeps they started
    assert c.leftovers() == []
    _nothing_of(c.tag, pids)


def test_a_block_that_raises_still_tears_the_cluster_down():
    skip_without_namespaces()
    with pytest.raises(RuntimeError, match="the test failed"):
        with Cluster(2) as c:
            c.spawn("a", TREE)
            pids = netns.pids(c.host("a").netns)
            raise RuntimeError("the test failed")
    _nothing_of(c.tag, pids)


HOLDER = """
import json, signal, sys, time
from refit.tools.cluster import Cluster, netns
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal: a run started in the background ignores it
c = Cluster(2, name=sys.argv[1] or None).up()
c.spawn("a", ["sh", "-c", "sleep 300 & sleep 300"])
time.sleep(0.3)
print(json.dumps({"tag": c.tag, "name": c.name, "pids": [p for ns in c.namespaces for p in netns.pids(ns)]}),
      flush=True)
time.sleep(300)
"""


def _holder(name: str = "") -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, name], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        p.wait()
        pytest.fail(f"the process making the cluster exited with {p.returncode} before it was up")
    return p, json.loads(line)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_maker_tears_the_cluster_down(sig):
    skip_without_namespaces()
    p, made = _holder()
    assert made["pids"] and any(made["tag"] in ns for ns in netns.namespaces())
    p.send_signal(sig)
    assert p.wait(timeout=60) != 0  # it still dies of the signal (KeyboardInterrupt for SIGINT)
    _nothing_of(made["tag"], made["pids"])


def test_refit_cluster_down_cleans_up_after_a_killed_maker(capsys):
    skip_without_namespaces()
    name = f"crash-{os.getpid()}"
    p, made = _holder(name)
    p.send_signal(signal.SIGKILL)  # no teardown can run
    p.wait(timeout=30)
    assert any(made["tag"] in ns for ns in netns.namespaces())
    assert refit_main(["cluster", "list"]) == 0 and name in capsys.readouterr().out
    assert refit_main(["cluster", "down", name]) == 0
    _nothing_of(made["tag"], made["pids"])
    assert refit_main(["cluster", "down", name]) == 2  # gone: a user error, one line
    assert "no cluster named" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,error",
    [
        (["up", "--hosts", "0"], "hosts=0 is not within 1..64"),
        (["up", "--hosts", "65"], "hosts=65 is not within 1..64"),
        (["up", "--rate", "fast"], "rate 'fast' is not a rate"),
        (["up", "--host-names", "a,a"], "are not unique"),
        (["up", "--name", "../x"], "cluster name '../x' is not"),
        (["down"], "name a cluster"),
        (["run", "no-such-cluster", "a", "--", "true"], "no cluster named 'no-such-cluster'"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_anything_is_made(argv, error, capsys):
    before = netns.namespaces() if not netns.unavailable() else set()
    assert refit_main(["cluster", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err, err
    if not netns.unavailable():
        assert netns.namespaces() == before
