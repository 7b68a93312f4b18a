"""Faults and strangers across hosts (network namespaces, 1 Gbit/s links), in one job whose processes live
through all of them: trainer fsdp=2 on host a (processes 0-1, the store on a), one tp=1 engine on each of hosts
b (process 2) and c (process 3), staged commit, a few seconds' deadline. Round by round (``fault_rank.py``):

1. version 1; then host b's link goes down while version 2 is half way (trainer process 1 paused at its middle
   step), and comes back: the next refit, on a new Peer in the same processes, moves versions 2 and 3;
2. host c partitioned (its link up, nothing crossing it) before version 4; healed, version 4 again;
3. 5% of packets lost each way on host b's link during versions 5 and 6;
4. a stranger on host d without the secret tries to connect to the store and delete and overwrite refit's keys
   (torch's store client, a made-up access key, forged frames, junk) during versions 7-9; then version 10;
5. every process of host c SIGKILLed while version 11 is half way; then a new process in process 3's place on
   host c (joining the job's store, not the default group), and version 12 on the survivors and it.

Each fault: every live process ends within the deadline (plus a margin for a loaded machine), also one cut off
from the store's host (its store calls are bounded by the refit's deadline); those that reach the store end
with one error naming the process that failed, the one cut off with the store's timeout; the engines hold
their last version bit for bit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from refit.tools.cluster import netns
from refit.tools.cluster.job import Job, job_env

from .helpers import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.multiproc, pytest.mark.timeout(600)]

PLACEMENT = ["a", "a", "b", "c"]  # processes 0-1: trainer ranks (fsdp=2), 2: engine on b, 3: engine on c
RANK = Path(__file__).with_name("fault_rank.py")
STRANGER = Path(__file__).with_name("store_stranger.py")
DEADLINE_S = 3.0
MARGIN_S = 20.0  # the loaded 2-core machine: a generous bound that still catches a hang


class Rounds:
    """Writes round specs for the job's processes and collects their results."""

    def __init__(self, cluster, sync: Path) -> None:
        self.cluster, self.sync, self.k = cluster, sync, 0
        self.job = Job(cluster, PLACEMENT, [sys.executable, str(RANK), str(sync)])
        self.live = list(range(len(PLACEMENT)))
        self.out: dict[str, dict[int, list[dict]]] = {}

    def start(self, spec: dict) -> int:
        k, self.k = self.k, self.k + 1
        tmp = self.sync / f"round.{k}.tmp"
        tmp.write_text(json.dumps({"deadline_s": DEADLINE_S, **spec}))
        tmp.replace(self.sync / f"round.{k}")  # whole: a process polls for the file and reads it at once
        return k

    def finish(self, label: str, k: int, ranks: list[int] | None = None) -> dict[int, list[dict]]:
        """The results of round ``k`` of ``ranks`` (default: every live process), once all are written."""
        ranks = self.live if ranks is None else ranks
        wait_for([self.sync / f"result.{k}.{r}" for r in ranks], 300, [self.job.procs[r] for r in ranks])
        got = {r: json.loads((self.sync / f"result.{k}.{r}").read_text()) for r in ranks}
        self.out.setdefault(label, {}).update(got)
        return got

    def run(self, label: str, spec: dict) -> dict[int, list[dict]]:
        return self.finish(label, self.start(spec))

    def held(self, k: int) -> None:
        wait_for([self.sync / f"held.{k}"], 300, [])

    def go(self, k: int) -> None:
        (self.sync / f"go.{k}").touch()

    def replace(self, rank: int) -> None:
        """A new process in process ``rank``'s place, on its host, from the next round on."""
        job, host = self.job, PLACEMENT[rank]
        env = job_env(self.cluster, PLACEMENT, rank, job.port, job.secret, job.job_id)
        argv = [sys.executable, str(RANK), str(self.sync), str(self.k)]
        job.procs[rank] = self.cluster.spawn(
            host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.live = sorted({*self.live, rank})


def _kill_host(cluster, host: str) -> list[int]:
    """SIGKILL every process inside ``host`` (no SIGTERM first: a machine that lost power)."""
    victims = netns.pids(cluster.host(host).netns)
    for pid in victims:
        netns._signal(pid, signal.SIGKILL)
    return victims


@pytest.fixture(scope="module")
def scenario(cluster, tmp_path_factory):
    sync = tmp_path_factory.mktemp("faults")
    rounds = Rounds(cluster, sync)
    stranger = cluster.spawn(
        "d",
        [sys.executable, str(STRANGER), f"{cluster.host('a').address}:{rounds.job.port}", str(sync)],
        env={"REFIT_SECRET": "", "REFIT_SECRET_FILE": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield _play(cluster, rounds, stranger)
    finally:
        (sync / "stop").touch()
        stranger.kill()
        rounds.job.kill()


def _play(cluster, rounds: Rounds, stranger) -> dict:
    out = {"rounds": rounds.out}
    rounds.run("v1", {"name": "r0", "versions": [1]})
    # 1. a link taken down half way through version 2, brought back; the next refit in the same processes
    k = rounds.start({"name": "r0", "versions": [2], "hold": [1, 2]})
    rounds.held(k)
    cluster.set_link("b", False)
    rounds.go(k)
    rounds.finish("link down", k)  # process 2, cut off from the store, too: its calls end at its deadline
    cluster.set_link("b", True)
    rounds.run("after link", {"name": "r1", "versions": [2, 3]})
    # 2. an engine host partitioned before version 4; healed
    cluster.drop("c", 100)
    k = rounds.start({"name": "r1", "versions": [4]})
    rounds.finish("partition", k)  # process 3 as well, by its deadline
    cluster.drop("c", 0)
    rounds.run("after partition", {"name": "r2", "versions": [4]})
    # 3. 5% loss each way on an engine host's link
    cluster.drop("b", 5)
    before = cluster.dropped("b")
    rounds.run("loss", {"name": "r3", "versions": [5, 6], "deadline_s": 60.0})
    out["loss"] = [n - m for n, m in zip(cluster.dropped("b"), before)]
    cluster.drop("b", 0)
    # 4. a stranger trying to delete and overwrite store keys
    (rounds.sync / "attack").touch()
    wait_for([rounds.sync / "attacking"], 60, [stranger])
    rounds.run("stranger", {"name": "r4", "versions": [7, 8, 9]})
    (rounds.sync / "stop").touch()
    said, why = stranger.communicate(timeout=60)
    assert stranger.returncode == 0 and said.strip(), f"the stranger exited with {stranger.returncode}: {why[-2000:]}"
    out["stranger"] = json.loads(said.strip().splitlines()[-1])
    rounds.run("after stranger", {"name": "r5", "versions": [10]})
    # 5. every process of host c SIGKILLed half way through version 11
    k = rounds.start({"name": "r5", "versions": [11], "hold": [1, 11]})
    rounds.held(k)
    out["killed"] = _kill_host(cluster, "c")
    rounds.live = [0, 1, 2]
    rounds.go(k)
    rounds.finish("host killed", k)
    out["survivors"] = {r: rounds.out["host killed"][r][0]["pid"] for r in rounds.live}
    rounds.replace(3)  # the survivors keep running; process 3 is new
    rounds.run("replaced", {"name": "r6", "versions": [12]})
    rounds.start({"exit": True})
    return out


FAULTS = [  # the round, the process that failed, the version every engine must still hold, a process cut off
    ("link down", 2, 1, 2),
    ("partition", 3, 3, 3),
    ("host killed", 3, 10, None),
]


def _engines(rows: dict[str, list[dict]]) -> dict[str, list[dict]]:
    return {r: vs for r, vs in rows.items() if int(r) >= 2}


@pytest.mark.parametrize("label,failed,last,cut_off", FAULTS, ids=[f[0].replace(" ", "-") for f in FAULTS])
def test_a_fault_ends_every_process_with_one_error_naming_the_failed_rank_engines_keep_their_version(
    scenario, label, failed, last, cut_off
):
    rows = scenario["rounds"][label]
    assert all(len(vs) == 1 and vs[0]["error"] for vs in rows.values()), rows
    for r, vs in rows.items():  # every process by its deadline, also one cut off from the store's host
        assert vs[0]["seconds"] < DEADLINE_S + MARGIN_S, (r, vs)
    errors = {vs[0]["error"] for r, vs in rows.items() if int(r) != cut_off}
    assert len(errors) == 1, errors  # one error, the same on every process that reaches the store
    assert f"process {failed}" in errors.pop(), rows
    if cut_off is not None:  # it cannot read that error: it says the store did not answer by the deadline
        assert "store is unreachable (StoreTimeout)" in rows[cut_off][0]["error"], rows[cut_off]
    for r, vs in _engines(rows).items():
        assert vs[0]["committed"] == last and vs[0]["holds"] == last, (r, vs)


@pytest.mark.parametrize("label", ["after link", "after partition", "after stranger"])
def test_once_the_fault_is_gone_the_same_processes_refit_again_bit_exact(scenario, label):
    rows = scenario["rounds"][label]
    assert len(rows) == len(PLACEMENT)  # no process was restarted: the job's processes, still running
    for r, vs in rows.items():
        assert all(v["error"] is None and v["committed"] == v["version"] for v in vs), (r, vs)
    for r, vs in _engines(rows).items():
        assert [v["holds"] for v in vs] == [v["version"] for v in vs], (r, vs)


def test_after_a_host_died_the_survivors_refit_with_a_new_process_in_its_place_bit_exact(scenario):
    rows = scenario["rounds"]["replaced"]
    assert sorted(rows) == [0, 1, 2, 3], rows
    assert {r: rows[r][0]["pid"] for r in scenario["survivors"]} == scenario["survivors"]  # not restarted
    assert rows[3][0]["pid"] not in scenario["survivors"].values()
    for r, vs in rows.items():
        assert [(v["error"], v["committed"]) for v in vs] == [(None, 12)], (r, vs)
    for r, vs in _engines(rows).items():  # the survivor from version 10, the new one from nothing
        assert [v["holds"] for v in vs] == [12], (r, vs)


def test_five_percent_of_packets_lost_each_way_still_refits_bit_exact(scenario):
    rows = scenario["rounds"]["loss"]
    for r, vs in rows.items():
        assert [(v["error"], v["committed"]) for v in vs] == [(None, 5), (None, 6)], (r, vs)
    for r, vs in _engines(rows).items():
        assert [v["holds"] for v in vs] == [5, 6], (r, vs)
    seen, dropped = scenario["loss"]
    assert dropped >= 20 and 0.02 <= dropped / seen <= 0.10, scenario["loss"]  # each packet at random


def test_a_stranger_without_the_secret_cannot_touch_the_store_and_every_refit_commits_everywhere(scenario):
    s, rows = scenario["stranger"], scenario["rounds"]["stranger"]
    assert s["rounds"] >= 1 and all(n >= 1 for n in s["tries"].values()), s  # every way, during the refits
    assert s["served"] == 0, s  # not one of its requests was answered
    for r, vs in rows.items():  # nothing it did reached refit: every version commits on every process
        assert [(v["error"], v["committed"]) for v in vs] == [(None, 7), (None, 8), (None, 9)], (r, vs)
        assert all(v["rejected"] == 0 for v in vs), (r, vs)  # no forged value ever reached a reader
    for r, vs in _engines(rows).items():  # both engines on the same version, bit for bit, after every refit
        assert [v["holds"] for v in vs] == [7, 8, 9], (r, vs)
