"""A host with no job secret that reaches a job's rendezvous store and forges, replays and deletes refit's keys.

``python store_stranger.py OTHER_STORE STORE SYNC_DIR`` (``address:port`` each). It imports torch (for the
store's client) and nothing of refit, and holds no secret. Steps, each begun by a file in SYNC_DIR:

* ``record``: read every value of refit's run keys (``<name>/run/v<version>.<attempt>/<what>``: votes, commit
  records, aborts) from OTHER_STORE, another job's store (the same secret, another job id); writes ``recorded``.
* ``attack``: on STORE, the job under attack, until ``stop`` appears: for the newest version whose keys it sees
  and the one after it (keys are predictable), write every value recorded from the other job and from this
  job's earlier versions under that version's keys (a replay), after deleting every key of those versions,
  then forged values (``refit1.<made-up tag>.<json>``), over and over; writes ``attacking`` after its first
  round. Prints one JSON line of counts.
"""

import json
import os
import re
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

RUN_KEY = re.compile(r"^(?P<name>[^/]+)/run/v(?P<version>\d+)\.(?P<attempt>\d+)/(?P<what>.+)$")
FORGED = b"refit1." + b"5a" * 32 + b'.{"version": %d}'
FORGED_ABORT = b"refit1." + b"a5" * 32 + b'.{"abort": "forged by a stranger"}'
OWN = (FORGED[:71], FORGED_ABORT[:71])  # its own forgeries, told apart from the job's values by their tags


def _wait(path: Path) -> None:
    while not path.exists():
        time.sleep(0.01)


def _client(address: str) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), None, False, timedelta(seconds=30))


def run_values(store: dist.TCPStore, known: dict[str, bytes] | None = None) -> list[tuple[re.Match, bytes]]:
    """Every refit run key in ``store`` (parsed) with its raw value; values already in ``known`` (key: raw) are
    not fetched again, and new ones are added to it (a version's values do not change once written)."""
    known = {} if known is None else known
    out = []
    for key in store.list_keys():
        m = RUN_KEY.match(key)
        if m and key not in known:
            try:
                known[key] = bytes(store.get(key))
            except RuntimeError:  # deleted under us
                continue
        if m:
            out.append((m, known[key]))
    return out


def _newest(seen: list[tuple[re.Match, bytes]], best: tuple[str, int] | None) -> tuple[str, int] | None:
    """The newest (session name, version) seen so far: versions only grow (keys it deleted do not count)."""
    for m, _ in seen:
        if best is None or int(m["version"]) > best[1]:
            best = (m["name"], int(m["version"]))
    return best


def attack(store: dist.TCPStore, recorded: list[tuple[str, bytes]], sync: Path) -> dict:
    """Replay, forge and delete until ``sync/stop`` appears; ``sync/attacking`` once it has done all three."""
    counts = {"replayed": 0, "forged": 0, "deleted": 0, "rounds": 0, "versions": []}
    mine: dict[tuple[int, str], bytes] = {}  # this job's values, by version and key
    known: dict[str, bytes] = {}
    planted = {raw for _, raw in recorded}  # values it writes under other keys: not the job's news
    best = None
    while not (sync / "stop").exists():
        seen = [(m, raw) for m, raw in run_values(store, known) if not raw.startswith(OWN) and raw not in planted]
        mine.update({(int(m["version"]), m["what"]): raw for m, raw in seen})  # the job's own values only
        best = _newest(seen, best)
        if best is None:
            time.sleep(0.005)
            continue
        name, version = best
        for target in (version, version + 1):
            prefix = f"{name}/run/v{target}.0/"
            for key in [k for k in store.list_keys() if k.startswith(prefix)]:
                store.delete_key(key)
                known.pop(key, None)
                counts["deleted"] += 1
            earlier = {w: raw for (v, w), raw in sorted(mine.items()) if v < target}  # the latest of each key
            planted.update(earlier.values())
            for what, raw in [*recorded, *earlier.items()]:  # the other job's values, this job's earlier ones
                store.set(prefix + what, raw)
                counts["replayed"] += 1
            for p in range(4):  # forgeries last: they stand until the next round deletes them
                store.set(f"{prefix}ok/{p}", FORGED % target)
            store.set(prefix + "commit", FORGED % target)
            store.set(prefix + "abort", FORGED_ABORT)
            counts["forged"] += 6
        counts["rounds"] += 1
        time.sleep(0.001)
        if version not in counts["versions"]:
            counts["versions"].append(version)
        if counts["rounds"] == 1:
            (sync / "attacking").touch()
    return counts


def main() -> None:
    other, target, sync = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    assert not os.environ.get("REFIT_SECRET") and not os.environ.get("REFIT_SECRET_FILE")  # a stranger
    _wait(sync / "record")
    recorded = sorted({m["what"]: raw for m, raw in run_values(_client(other))}.items())  # one value per key
    (sync / "recorded").write_text(json.dumps(sorted({w for w, _ in recorded})))
    _wait(sync / "attack")
    counts = attack(_client(target), recorded, sync)
    print(json.dumps({**counts, "recorded": len(recorded)}), flush=True)


if __name__ == "__main__":
    main()
