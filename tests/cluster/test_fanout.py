"""Fan-out across hosts (network namespaces, 1 Gbit/s links): trainer fsdp=2 on host a, a pipelined relay down a
chain of tp=1 replicas on hosts b, c and d (``Fanout(relay=1)``), bit exact refit after refit, and every replica
host's link carrying each version once, the trainer host's uplink one copy however many replicas follow."""

from __future__ import annotations

import pytest

from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.cluster.job import Job, python_argv

pytestmark = [pytest.mark.cluster, pytest.mark.multiproc, pytest.mark.timeout(300)]

PLACEMENT = ["a", "a", "b", "c", "d"]  # processes 0-1: trainer ranks (fsdp=2), 2-4: one replica (tp=1) each
REFITS = 3


def test_a_relay_across_hosts_is_bit_exact_and_the_trainer_host_sends_one_copy(cluster):
    model = layout_from_spec(param_shapes("tiny-llama"), parse_spec("tp=1", "dst")).nbytes
    before = {h: cluster.counters(h) for h in ("a", "b", "c", "d")}
    argv = python_argv(
        "refit.tools.cluster.fanout_rank",
        *("--src", "fsdp=2", "--replicas", "3", "--refits", str(REFITS), "--modes", "relay"),
        *("--hosts", ",".join(PLACEMENT), "--deadline-s", "60"),
    )
    results = Job(cluster, PLACEMENT, argv).wait(240)
    after = {h: cluster.counters(h) for h in before}
    assert [r["modes"]["relay"]["exact"] for r in results] == [[True] * REFITS] * len(PLACEMENT)
    sent = {h: after[h][1] - before[h][1] for h in before}
    received = {h: after[h][0] - before[h][0] for h in before}
    # payload plus TCP/IP headers and the control plane's store traffic: within 25% of one copy per refit
    assert REFITS * model <= sent["a"] <= 1.25 * REFITS * model, (sent, model)
    for h in ("b", "c", "d"):  # every replica receives each version once
        assert REFITS * model <= received[h] <= 1.25 * REFITS * model, (h, received, model)
    assert sent["d"] < 0.15 * REFITS * model, sent  # the end of the chain forwards nothing
