"""What a process holds that refit may leave behind: threads and TCP sockets, as plain data.

Used in the trainer processes and, through ``worker_ext.TestWorkerExtension``, in vLLM's workers:
``snapshot()`` before refit starts, again after ``shutdown()``; ``leftovers(before, after)`` must be empty.
"""

from __future__ import annotations

import threading

import psutil


def snapshot() -> dict[str, list]:
    """This process's threads (``[ident, name]``) and TCP sockets (``[local, remote, status]``)."""
    socks = [
        [f"{c.laddr.ip}:{c.laddr.port}", f"{c.raddr.ip}:{c.raddr.port}" if c.raddr else "", c.status]
        for c in psutil.Process().net_connections(kind="tcp")
    ]
    return {"threads": [[t.ident, t.name] for t in threading.enumerate()], "sockets": socks}


def leftovers(before: dict[str, list], after: dict[str, list]) -> dict[str, list]:
    """What ``after`` holds that ``before`` did not, plus any thread named ``refit*`` (which must never outlive
    ``shutdown``); ``{"threads": [], "sockets": []}`` when nothing was left behind. A socket is its two ends: one
    that was open before and only changed state since (the process group's store connection going to CLOSE_WAIT
    when the other trainer rank tears its group down first) is not a leftover."""
    seen = {tuple(x) for x in before["threads"]}
    threads = [t for t in after["threads"] if tuple(t) not in seen or t[1].startswith("refit")]
    known = {(local, remote) for local, remote, _ in before["sockets"]}
    return {"threads": threads, "sockets": [s for s in after["sockets"] if (s[0], s[1]) not in known]}
