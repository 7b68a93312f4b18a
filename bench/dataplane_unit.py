"""The storage actor's bookkeeping alone: ``StorageUnit`` in-process, no Ray, the README's flow.

    python -m bench.dataplane_unit [--keys 512 --fields 4 --runs 400]

Each run, on a fresh unit: a put of ``--keys`` new keys with ``--fields`` batch fields (tiny payloads: the
bytes are not the point), the advantages written back to the same keys in the same order (``adv``), then a
take of every field (``locate(clear=True)``); then, through the storage actor's own methods (``_StorageActor``,
in-process), a ``trust_meta`` put of the same keys and a clear through its meta (``clear(..., expect=origin)``:
only the rows of that put). Prints the median of each step over ``--runs`` runs, in ms.
Run it with another checkout's ``src`` first on ``PYTHONPATH`` to compare two versions."""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch

from refit.data.store import StorageUnit

STEPS = ("put", "write back", "take", "total", "actor put", "clear (meta)")


def one_run(keys: list[str], fields: dict, adv: dict) -> tuple[float, ...]:
    u, tags = StorageUnit(), [{}] * len(keys)
    t0 = time.perf_counter()
    u.put("p", keys, fields, tags, None)
    t1 = time.perf_counter()
    u.put("p", keys, adv, tags, None)
    t2 = time.perf_counter()
    u.locate("p", keys, [*fields, "adv"], clear=True)
    t3 = time.perf_counter()
    assert u.chunks() == 0
    return t1 - t0, t2 - t1, t3 - t2, t3 - t0, *actor_put_and_clear(keys, tuple(fields))


def actor_put_and_clear(keys: list[str], names: tuple[str, ...]) -> tuple[float, float]:
    """A ``trust_meta`` put's record on a fresh storage actor object (no Ray call: its methods run here),
    then the clear through that put's meta."""
    from refit.data.ray_store import _StorageActor

    a, origin = _StorageActor(), f"{uuid.uuid4().hex}@{time.time():.3f}"
    t0 = time.perf_counter()
    assert a.put(("p", keys, [None], names, None, None, False, False, origin)) is None
    t1 = time.perf_counter()
    assert a.clear("p", keys, origin) == len(keys)
    t2 = time.perf_counter()
    a.adopter.shutdown()
    return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--fields", type=int, default=4)
    ap.add_argument("--runs", type=int, default=400)
    args = ap.parse_args(argv)
    keys = [f"k{i}" for i in range(args.keys)]
    fields = {f"f{j}": torch.zeros(args.keys, 4) for j in range(args.fields)}
    adv = {"adv": torch.zeros(args.keys)}
    runs = [one_run(keys, fields, adv) for _ in range(args.runs)]
    print("  ".join(f"{s} {1e3 * statistics.median(r[i] for r in runs):.3f}" for i, s in enumerate(STEPS)), "ms")


if __name__ == "__main__":
    main()
