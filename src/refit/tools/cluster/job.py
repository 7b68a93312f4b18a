"""One job's processes placed on a cluster's hosts, joined by a rendezvous on the first one's address.

``Job(cluster, placement, argv)`` starts process ``r`` of ``len(placement)`` on host ``placement[r]`` (a host
name, or ``(host, nic)``) with the job's environment (``job_env``): a fresh secret and job id, its rank, the world
size, the store's address (process 0's) and its NIC's address as its bind address. A process placed by host name
alone uses its nearest NIC (``auto_nics``: on a host with as many NICs as processes, the host's ``k``-th process
uses NIC ``k``, as each GPU of a server uses the NIC on its PCIe switch). ``join_from_env()`` is the other half,
inside each process: gloo pinned to the bind address's interface, the store hosted by process 0 on that address
alone, the default group.
A process reports by printing one line ``REFIT-RESULT <json>`` (``report``); ``Job.wait`` returns those values
by rank, or raises ``ClusterError`` naming the first process that failed, its host and its error's last lines.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from refit.tools.cluster.harness import Cluster
from refit.tools.cluster.netns import ClusterError

RESULT = "REFIT-RESULT "
RANK_ENV, WORLD_ENV, STORE_ENV = "REFIT_RANK", "REFIT_WORLD_SIZE", "REFIT_STORE"


def job_env(
    cluster: Cluster, placement: Sequence[str], rank: int, port: int, secret: str, job_id: str, store_nic: int = 0
) -> dict:
    """What process ``rank`` of a job placed on ``placement`` (host names) needs, besides ``cluster.env(host)``;
    the store is on process 0's NIC ``store_nic``."""
    return {
        "REFIT_SECRET": secret,
        "REFIT_JOB_ID": job_id,
        RANK_ENV: str(rank),
        WORLD_ENV: str(len(placement)),
        STORE_ENV: f"{cluster.host(placement[0]).nic_at(store_nic).address}:{port}",
    }


def auto_nics(cluster: Cluster, hosts: Sequence[str]) -> list[int]:
    """Each process's nearest NIC, for processes on ``hosts``: a host's ``j``-th of ``m`` processes uses NIC
    ``j * n // m`` of its ``n`` (NIC ``j`` when ``n == m``; consecutive processes share a NIC when there are
    fewer NICs, as GPUs behind one PCIe switch do)."""
    count = {h: hosts.count(h) for h in hosts}
    seen: dict[str, int] = {}
    out = []
    for h in hosts:
        j = seen[h] = seen.get(h, -1) + 1
        out.append(j * len(cluster.host(h).nics) // count[h])
    return out


class Job:
    """``argv`` run once per entry of ``placement`` (host names), each process inside its host."""

    def __init__(
        self,
        cluster: Cluster,
        placement: Sequence[str | tuple[str, int]],
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        secret: str | None = None,
    ) -> None:
        hosts = [p if isinstance(p, str) else p[0] for p in placement]
        for h in hosts:
            cluster.host(h)  # ConfigError naming an unknown host, before anything starts
        auto = auto_nics(cluster, hosts)
        self.nics = [auto[r] if isinstance(p, str) else p[1] for r, p in enumerate(placement)]
        for h, k in zip(hosts, self.nics, strict=True):
            cluster.host(h).nic_at(k)  # ConfigError naming a NIC the host lacks
        self.cluster, self.placement = cluster, hosts
        self.port = random.randint(20000, 40000)  # the store host's namespace holds only this cluster's jobs
        self.secret = secret or secrets.token_hex(16)
        self.job_id = uuid.uuid4().hex
        self.procs = [
            cluster.spawn(
                h,
                argv,
                env={**job_env(cluster, hosts, r, self.port, self.secret, self.job_id, self.nics[0]), **(env or {})},
                nic=self.nics[r],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r, h in enumerate(hosts)
        ]

    def wait(self, timeout_s: float) -> list[Any]:
        """Every process's reported value, by rank; ``ClusterError`` for the first failure or an overrun (then
        every process of the job is killed)."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs):
            failed = [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                self.kill()
                break
            time.sleep(0.1)
        outs = [p.communicate() for p in self.procs]
        bad = [r for r, p in enumerate(self.procs) if p.returncode != 0]
        if bad:
            first = min(bad, key=lambda r: (self.procs[r].returncode < 0, r))  # a real error before a kill
            tail = "\n".join(outs[first][1].strip().splitlines()[-12:])
            raise ClusterError(
                f"process {first} on host {self.placement[first]} exited with {self.procs[first].returncode}"
                f" (of {len(bad)} failed{', deadline overrun' if time.monotonic() > deadline else ''}):\n{tail}"
            )
        return [_result(r, out) for r, (out, _) in enumerate(outs)]

    def kill(self) -> None:
        """Kill this job's processes (by their ids) and reap them."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def _result(rank: int, stdout: str) -> Any:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise ClusterError(f"process {rank} exited 0 without a result line; its output ends: {stdout[-400:]!r}")
    return json.loads(lines[-1][len(RESULT) :])  # JSON only: nothing read from a process is unpickled


def report(value: Any) -> None:
    """Print this process's result for ``Job.wait`` (JSON)."""
    print(RESULT + json.dumps(value), flush=True)


def join_from_env(timeout_s: float = 300.0):
    """Inside a job's process: pin gloo to the bind address's interface, host (process 0) or join the store,
    and make the default gloo group. Returns ``(rank, world_size, store)``."""
    import torch.distributed as dist

    from refit.transport.store import bind_address, open_store, pin_interfaces

    rank, world = int(os.environ[RANK_ENV]), int(os.environ[WORLD_ENV])
    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    address = bind_address()
    pin_interfaces(address)
    store = open_store(address if rank == 0 else host, int(port), world, rank == 0, timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return rank, world, store


def python_argv(module: str, *args: str) -> list[str]:
    """``python -m module args``, with this interpreter."""
    return [sys.executable, "-m", module, *args]
