"""A host with no job secret that sends junk to every listening port it is given, until a stop file appears.

``python stranger.py TARGETS_JSON STOP_FILE``: TARGETS_JSON is ``[[address, port], ...]``. It imports nothing of
refit and holds no secret. Each round it connects to every target, sends random bytes (and bytes shaped like a
length-prefixed message with a huge length), and closes; prints ``started`` after its first round and, at the
end, one JSON line ``{"rounds", "connects", "refused", "sent", "sent_to"}`` (``sent_to``: per target, how many
connections took all of their junk; a listener may close a connection before it has all of it).
"""

import json
import os
import socket
import struct
import sys
import time


def junk(round_: int) -> bytes:
    if round_ % 2:
        return struct.pack("<Q", 1 << 40) + os.urandom(2048)  # a length no reader should trust
    return os.urandom(256 + 4096 * (round_ % 5))


def main() -> None:
    targets = [tuple(t) for t in json.loads(sys.argv[1])]
    stop = sys.argv[2]
    rounds = connects = refused = sent = 0
    sent_to = [0] * len(targets)
    while not os.path.exists(stop):
        for i, (address, port) in enumerate(targets):
            try:
                with socket.create_connection((address, port), timeout=1.0) as s:
                    connects += 1
                    s.sendall(junk(rounds))
                    sent += 1
                    sent_to[i] += 1
            except OSError:
                refused += 1
        rounds += 1
        if rounds == 1:
            print("started", flush=True)
        time.sleep(0.01)
    report = {"rounds": rounds, "connects": connects, "refused": refused, "sent": sent, "sent_to": sent_to}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
