"""A host with no job secret that reaches a job's rendezvous store and tries to delete and overwrite refit's keys.

``python store_stranger.py STORE SYNC_DIR`` (``address:port``). It holds no secret. Once ``SYNC_DIR/attack``
appears, until ``stop`` does, round after round it tries every way in a stranger has:

* torch's own store client (``TCPStore``), as an attacker would try first: it never gets to an op;
* refit's store client with a made-up access key: the handshake is refused;
* a raw connection that answers the server's hello with a made-up proof, then sends frames that would delete
  and overwrite refit's commit keys (``SET`` / ``DELETE`` with made-up MACs): the server closes it;
* junk bytes at the port.

It writes ``attacking`` after its first round and prints one JSON line of counts: ``tries`` per way, and
``served``: how many of its requests got an answer (every one should be refused, so 0).
"""

import json
import os
import socket
import struct
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from refit.transport import authstore

_LEN = struct.Struct("!I")


def _wait(path: Path) -> None:
    while not path.exists():
        time.sleep(0.01)


def _answered(sock: socket.socket) -> bool:
    """Whether the server sent anything back after our bytes (it should close the connection instead)."""
    sock.settimeout(10)
    try:
        return bool(sock.recv(4096))
    except OSError:
        return False
    finally:
        sock.close()


def torch_client(host: str, port: int) -> bool:
    try:
        dist.TCPStore(host, port, None, False, timedelta(seconds=1)).set("x/run/v1.0/commit", b"overwritten")
    except RuntimeError:
        return False
    return True


def made_up_key(host: str, port: int) -> bool:
    try:
        authstore.AuthStore(host, port, os.urandom(32), 5.0).delete_key("x/run/v1.0/commit")
    except RuntimeError:
        return False
    return True


def forged_frames(host: str, port: int) -> bool:
    """A made-up proof, then DELETE and SET frames with made-up MACs for the keys refit commits under."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.recv(len(authstore._HELLO) + authstore._NONCE)
        sock.sendall(os.urandom(2 * authstore._NONCE))
        for op, items in ((authstore.DELETE, [b"r4/run/v8.0/commit"]), (authstore.SET, [b"r4/run/v8.0/ok/2", b"x"])):
            body = bytes((op,)) + authstore.pack(items)
            try:
                sock.sendall(_LEN.pack(len(body)) + body + os.urandom(authstore._MAC))
            except OSError:
                return False
        return _answered(sock)


def junk(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.recv(len(authstore._HELLO) + authstore._NONCE)  # the server's greeting: what every port-scan sees
        sock.sendall(os.urandom(4096))
        return _answered(sock)


WAYS = {"torch client": torch_client, "made-up key": made_up_key, "forged frames": forged_frames, "junk": junk}


def main() -> None:
    target, sync = sys.argv[1], Path(sys.argv[2])
    assert not os.environ.get("REFIT_SECRET") and not os.environ.get("REFIT_SECRET_FILE")  # a stranger
    host, port = target.rsplit(":", 1)
    tries = dict.fromkeys(WAYS, 0)
    served = rounds = 0
    _wait(sync / "attack")
    while not (sync / "stop").exists():
        for name, way in WAYS.items():
            tries[name] += 1
            served += way(host, int(port))
        rounds += 1
        if rounds == 1:
            (sync / "attacking").touch()
    print(json.dumps({"tries": tries, "served": served, "rounds": rounds}), flush=True)


if __name__ == "__main__":
    main()
