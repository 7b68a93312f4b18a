"""The store's host (process 0) leaving first: it serves on at exit until its clients say goodbye, bounded.

No namespaces needed: the store's lifetime is the same on loopback as across hosts. One host process, two
clients in this process: one still reading after the host's program returned (it must be answered), one that
never says goodbye (the host leaves anyway once ``REFIT_STORE_LINGER_S`` has passed, naming it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from refit.transport.authstore import LINGER_ENV, StoreLost
from refit.transport.store import open_store

pytestmark = [pytest.mark.cluster, pytest.mark.multiproc, pytest.mark.timeout(120)]

SECRET, SCOPE = b"store-exit-test-secret-0123456789", "store-exit"
HOST = f"""
import sys
from refit.transport.store import open_store
store = open_store("127.0.0.1", 0, None, True, 30.0, secret={SECRET!r}, scope={SCOPE!r})
print(store.port, flush=True)
sys.stdin.readline()
store.set("last", "9")
"""  # then its program ends: the interpreter exits, with the store's clients still connected


def test_the_store_host_leaving_first_serves_its_clients_until_they_say_goodbye_at_most_the_linger_bound():
    env = {**os.environ, LINGER_ENV: "6"}
    host = subprocess.Popen(
        [sys.executable, "-c", HOST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        port = int(host.stdout.readline())
        reader, idle = (open_store("127.0.0.1", port, None, False, 10.0, secret=SECRET, scope=SCOPE) for _ in "ab")
        host.stdin.write("go\n")
        host.stdin.flush()
        said = host.stderr.readline()  # once it has waited a second for its clients (or "" had it exited)
        assert "is leaving: waiting for 2 client(s) still connected" in said, (said, host.poll())
        assert host.poll() is None
        assert reader.get("last") == b"9"  # the host's program is over; its store still answers
        reader.close()  # goodbye; the idle client never says it
        rest = host.communicate(timeout=60)[1]
        assert host.returncode == 0, rest
        assert "leaves with its host with 1 client(s) still connected after 6s" in rest, rest
        with pytest.raises(StoreLost):
            idle.get("last")
        idle.close()
    finally:
        host.kill()
        host.wait()
