"""A host with two NICs: each NIC's address answers through that NIC, what a socket bound to a NIC's address sends
leaves through that NIC (its own counters), both links are shaped, a job's processes on the host get one NIC each,
and teardown leaves nothing of the extra NICs behind."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from refit.errors import ConfigError
from refit.tools.cli import main as refit_main
from refit.tools.cluster import Cluster, LinkShape, netns, parse_rate
from refit.tools.cluster.job import auto_nics

from .helpers import skip_without_namespaces

pytestmark = pytest.mark.cluster

PAYLOAD = 4 << 20  # 4 MiB: well above what ARP, SYNs and ACKs add to a counter
NOISE = 256 << 10


def _sink(server: socket.socket, got: list[int]) -> None:
    """Accept one connection on ``server`` and count what it sends until it closes."""
    conn, _ = server.accept()
    with conn:
        n = 0
        while chunk := conn.recv(1 << 20):
            n += len(chunk)
    got.append(n)


def _send(c: Cluster, src_host: str, src_address: str, dst_host: str, dst_address: str) -> int:
    """Send ``PAYLOAD`` bytes from a socket on ``src_host`` bound to ``src_address`` to a listener on
    ``dst_host`` at ``dst_address``; returns what the listener received."""
    with c.inside(dst_host):
        server = socket.create_server((dst_address, 0))
    got: list[int] = []
    t = threading.Thread(target=_sink, args=(server, got))
    t.start()
    try:
        with c.inside(src_host):
            s = socket.socket()
        with s:
            s.bind((src_address, 0))
            s.settimeout(30)
            s.connect(server.getsockname())
            s.sendall(b"\0" * PAYLOAD)
    finally:
        t.join(30)
        server.close()
    return got[0] if got else 0


def test_each_nic_of_a_two_nic_host_carries_what_its_address_sends_and_receives():
    skip_without_namespaces()
    with Cluster(["a", "b"], LinkShape(parse_rate("400mbit")), nics={"a": 2}) as c:
        a, b = c.host("a"), c.host("b")
        assert [n.address for n in a.nics] == ["198.18.0.1", "198.18.1.1"] and len(b.nics) == 1
        for n in a.nics:
            assert netns.qdisc_kinds(a.netns, n.dev) == ["tbf"] and netns.qdisc_kinds(c.hub, n.port) == ["tbf"]
        assert Cluster.load(c.name).host("a") == a  # the state file describes both NICs
        for k, n in enumerate(a.nics):
            before = [c.counters("a", j) for j in range(2)]
            assert _send(c, "a", n.address, "b", b.address) == PAYLOAD  # out through NIC k
            assert _send(c, "b", b.address, "a", n.address) == PAYLOAD  # in through NIC k: its address answers
            after = [c.counters("a", j) for j in range(2)]
            rx = [after[j][0] - before[j][0] for j in range(2)]
            tx = [after[j][1] - before[j][1] for j in range(2)]
            assert tx[k] >= PAYLOAD and rx[k] >= PAYLOAD, (k, rx, tx)
            assert tx[1 - k] < NOISE and rx[1 - k] < NOISE, (k, rx, tx)  # the other NIC stayed quiet
        assert auto_nics(c, ["a", "a", "b"]) == [0, 1, 0]  # trainer rank i on host a uses NIC i
        assert c.env("a", 1)["REFIT_BIND_ADDRESS"] == "198.18.1.1"
        with pytest.raises(ConfigError, match="nic=2 is not a NIC of host 'a' \\(it has 2\\)"):
            c.env("a", 2)
    assert c.leftovers() == []
    assert c.tag not in netns.sh("ip", "-o", "link", "show").stdout


@pytest.mark.parametrize(
    "nics,error",
    [({"z": 2}, "nics names hosts \\['z'\\]"), ({"a": 9}, "not within 1..8"), ({"a": 0}, "not within 1..8")],
)
def test_bad_nic_counts_are_refused_naming_them(nics, error):
    with pytest.raises(ConfigError, match=error):
        Cluster(["a", "b"], nics=nics)


def test_refit_cluster_up_with_two_nics_runs_a_command_bound_to_each(capfd):
    skip_without_namespaces()
    name = f"nics-{os.getpid()}"
    assert refit_main(["cluster", "up", "--hosts", "2", "--nics", "a=2", "--name", name]) == 0
    try:
        assert "198.18.0.1 on rfn-" in capfd.readouterr().out
        for k, address in enumerate(("198.18.0.1", "198.18.1.1")):
            argv = ["cluster", "run", "--nic", str(k), name, "a", "--", "sh", "-c", "echo $REFIT_BIND_ADDRESS"]
            assert refit_main(argv) == 0
            assert capfd.readouterr().out.strip() == address
        assert refit_main(["cluster", "run", "--nic", "1", name, "b", "--", "true"]) == 2
        assert "nic=1 is not a NIC of host 'b'" in capfd.readouterr().err
    finally:
        assert refit_main(["cluster", "down", name]) == 0


@pytest.mark.parametrize("text,error", [("a=x", "is not HOST=COUNT"), ("z=2", "nics names hosts ['z']")])
def test_refit_cluster_up_refuses_bad_nics_in_one_line(text, error, capsys):
    assert refit_main(["cluster", "up", "--hosts", "2", "--nics", text]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err, err
