"""Versioned replay buffer: eligibility, exactly once, no leaked keys."""

import threading

import pytest
import torch

from refit.data import BufferFull, InProcessStore, ReplayBuffer


def _add(store, buf, name, gen, target=None, n=2):
    keys = [f"{name}/{i}" for i in range(n)]
    meta = store.put(
        keys,
        {"ids": torch.full((n, 3), gen), "gen": torch.full((n,), gen)},
        partition="rollouts",
        tags={"version": gen},
    )
    buf.add(meta, gen, target)
    return keys


def test_only_eligible_entries_exactly_once_and_keys_cleared(store):
    buf = ReplayBuffer(store, max_age=2)
    _add(store, buf, "a", gen=0)
    _add(store, buf, "b", gen=1)
    _add(store, buf, "c", gen=1, target=3)  # meant for version 3: not before
    assert buf.sample(3, current_version=1, select_fields=["gen"]) is None  # only 2 eligible, nothing taken
    assert buf.eligible(1) == 2 and len(buf) == 3
    meta, data = buf.sample(2, current_version=1, select_fields=["ids", "gen"])
    assert meta.keys == ("a/0", "a/1", "b/0", "b/1")  # oldest first
    assert data["gen"].tolist() == [0, 0, 1, 1]
    assert sorted(store.keys("rollouts")) == ["c/0", "c/1"]  # consumed keys gone
    assert buf.sample(1, current_version=2, select_fields=["gen"]) is None  # c targets 3
    meta, data = buf.sample(1, current_version=3, select_fields=["gen"])
    assert meta.keys == ("c/0", "c/1")
    assert store.keys() == [] and len(buf) == 0
    s = buf.stats()
    assert (s.added, s.consumed, s.expired, s.keys_cleared, s.ages) == (3, 3, 0, 6, [1, 0, 2])


def test_stale_entries_expire_and_are_cleared(store):
    buf = ReplayBuffer(store, max_age=2)
    _add(store, buf, "old", gen=0)
    _add(store, buf, "new", gen=3)
    meta, _ = buf.sample(1, current_version=3, select_fields=["gen"])
    assert meta.keys == ("new/0", "new/1")  # "old" (age 3 > 2) is never returned
    assert store.keys() == [] and buf.stats().expired == 1


def test_failed_fetch_loses_nothing(store):
    buf = ReplayBuffer(store, max_age=5)
    keys = _add(store, buf, "a", gen=0)
    with pytest.raises(KeyError):
        buf.sample(1, current_version=0, select_fields=["never_written"])
    assert len(buf) == 1 and sorted(store.keys("rollouts")) == keys
    meta, data = buf.sample(1, current_version=0, select_fields=["ids"], copy=True)
    assert data["ids"].shape == (2, 3)
    data["ids"].zero_()  # copy=True: private and writable, even though the keys are cleared


def test_concurrent_samplers_get_each_entry_once():
    store = InProcessStore()
    buf = ReplayBuffer(store, max_age=100)
    for i in range(200):
        _add(store, buf, f"e{i}", gen=i % 50, n=1)
    got: list[str] = []
    lock = threading.Lock()

    def worker():
        while True:
            out = buf.sample(3, current_version=60, select_fields=["gen"])
            if out is None:
                return
            with lock:
                got.extend(out[0].keys)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == 198  # 66 draws of 3; 2 left (fewer than 3)
    assert buf.close() == 2 and store.keys() == []


def test_no_leak_after_many_steps(store):
    buf = ReplayBuffer(store, max_age=1, max_size=16)
    for step in range(12):
        for j in range(3):
            _add(store, buf, f"s{step}/w{j}", gen=step, target=step + 1)
        if step % 3 != 2:  # skip some steps: their entries age out
            while buf.sample(2, current_version=step + 1, select_fields=["ids"]) is not None:
                pass
    buf.close()
    assert store.keys() == []
    s = buf.stats()
    assert s.consumed + s.expired + (s.added - s.consumed - s.expired) == s.added
    assert all(a <= 1 for a in s.ages)


def test_arguments_checked():
    store = InProcessStore()
    with pytest.raises(ValueError, match="max_age must be >= 0"):
        ReplayBuffer(store, max_age=-1)
    buf = ReplayBuffer(store, max_age=1, max_size=1)
    _add(store, buf, "a", gen=0)
    with pytest.raises(BufferFull, match="max_size=1"):
        _add(store, buf, "b", gen=0)
    meta = store.meta(["a/0"], partition="rollouts")
    with pytest.raises(ValueError, match="target_version 0 < generated_version 1"):
        buf.add(meta, 1, 0)
