"""The store contract, on every backend (in-process and Ray storage actors)."""

import pickle

import numpy as np
import pytest
import torch

from refit.data import BatchMeta, MissingFieldError, MissingKeyError
from refit.data.meta import _unpickled
from refit.data.placed import Placed, PutRows


def _batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 50_000, (n, 7), generator=g, dtype=torch.int64),
        "logprobs": torch.randn(n, 7, generator=g).to(torch.bfloat16),
        "reward": torch.randn(n, generator=g, dtype=torch.float32),  # 1-D: one scalar per key
        "mask": torch.rand(n, 7, generator=g) > 0.5,
    }


def _same(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8) if b.dtype != torch.bool else b
        )
    )


def test_put_get_round_trip_exact(store):
    keys = [f"k{i}" for i in range(6)]
    data = _batch()
    meta = store.put(keys, data, partition="rollouts", tags={"version": 3}, seq_lens=[7] * 6)
    assert meta.keys == tuple(keys) and meta.partition == "rollouts" and meta.tags[0] == {"version": 3}
    got = store.get(meta, select_fields=list(data))
    for f, t in data.items():
        assert _same(got[f], t), f
    assert got["reward"].dim() == 1  # 1-D fields stay 1-D
    # a reordered subset comes back in the asked order
    sub = store.get(["k4", "k1", "k2"], select_fields=["logprobs", "reward"], partition="rollouts")
    assert _same(sub["logprobs"], data["logprobs"][[4, 1, 2]])
    assert _same(sub["reward"], data["reward"][[4, 1, 2]])


def test_get_with_copy_returns_private_memory(store):
    data = _batch()
    store.put(["a", "b", "c", "d", "e", "f"], data)
    got = store.get(["a", "b"], select_fields=["input_ids"], copy=True)
    got["input_ids"].zero_()  # writable, and the store is unaffected
    again = store.get(["a", "b"], select_fields=["input_ids"])
    assert torch.equal(again["input_ids"], data["input_ids"][:2])


def test_get_returns_zero_copy_views_of_consecutive_rows(store):
    data = _batch()
    keys = ["a", "b", "c", "d", "e", "f"]
    store.put(keys, data)
    if hasattr(store, "settle"):
        store.settle()  # the Ray store's own copy exists: both gets read it
    run = store.get(["b", "c", "d"], select_fields=["input_ids", "reward"])  # consecutive rows, in order
    again = store.get(["b", "c", "d"], select_fields=["input_ids"])
    assert run["input_ids"].data_ptr() == again["input_ids"].data_ptr()  # the same memory: no copy made
    assert torch.equal(run["input_ids"], data["input_ids"][1:4]) and torch.equal(run["reward"], data["reward"][1:4])
    scattered = store.get(["d", "a", "c"], select_fields=["input_ids"])  # gathered once, in the asked order
    assert torch.equal(scattered["input_ids"], data["input_ids"][[3, 0, 2]])
    copied = store.get(["b", "c", "d"], select_fields=["input_ids"], copy=True)
    assert copied["input_ids"].data_ptr() != run["input_ids"].data_ptr()
    store.clear(keys)
    assert torch.equal(run["input_ids"], data["input_ids"][1:4])  # a view outlives the clear of its keys


def test_caller_buffers_may_be_reused_after_put(store):
    ids = torch.arange(12).reshape(3, 4)
    store.put(["x", "y", "z"], {"ids": ids})
    ids.fill_(-1)
    assert torch.equal(store.get(["x", "y", "z"], select_fields=["ids"])["ids"], torch.arange(12).reshape(3, 4))


def test_ragged_rows(store):
    rows = [torch.arange(n, dtype=torch.int32) for n in (3, 5, 1)]
    store.put(["r0", "r1", "r2"], {"ids": rows})
    got = store.get(["r2", "r0", "r1"], select_fields=["ids"])["ids"]
    assert isinstance(got, list) and [t.tolist() for t in got] == [[0], [0, 1, 2], [0, 1, 2, 3, 4]]
    assert all(t.dtype == torch.int32 for t in got)


def test_fields_added_later_and_overwrite_guard(store):
    keys = ["a", "b", "c"]
    store.put(keys, {"ids": torch.ones(3, 2)}, partition="p")
    store.put(keys, {"adv": torch.tensor([1.0, -1.0, 0.5])}, partition="p")  # driver writes advantages
    assert set(store.meta(keys, partition="p").fields) == {"ids", "adv"}
    with pytest.raises(ValueError, match="already has field 'adv'"):
        store.put(["c", "a"], {"adv": torch.zeros(2)}, partition="p")
    store.put(["c"], {"adv": torch.tensor([9.0])}, partition="p", overwrite=True)
    assert store.get(keys, select_fields=["adv"], partition="p")["adv"].tolist() == [1.0, -1.0, 9.0]


def test_refused_put_writes_nothing(store):
    store.put(["a"], {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="already has field"):
        store.put(["b", "c", "a", "d"], {"x": torch.ones(4)})
    assert sorted(store.keys("default")) == ["a"]


def test_missing_field_and_key_raise(store):
    store.put(["a", "b"], {"ids": torch.zeros(2, 3)})
    with pytest.raises(MissingFieldError, match=r"field 'logprobs' was never produced for key 'a'.*\['ids'\]"):
        store.get(["a", "b"], select_fields=["ids", "logprobs"])
    with pytest.raises(MissingKeyError, match="key 'zz' is not in partition 'default'"):
        store.get(["a", "zz"], select_fields=["ids"])
    with pytest.raises(MissingKeyError):
        store.get(["a"], select_fields=["ids"], partition="other")


def test_select_fields_required(store):
    store.put(["a"], {"ids": torch.zeros(1, 3)})
    for bad in (None, [], "ids"):
        with pytest.raises(ValueError, match="select_fields"):
            store.get(["a"], select_fields=bad)
    with pytest.raises(TypeError):
        store.get(["a"])  # keyword required, no default


def test_bad_put_names_the_field(store):
    with pytest.raises(
        ValueError, match=r"field 'ids' has shape \[3, 2\]; its first dimension must be the number of keys \(2\)"
    ):
        store.put(["a", "b"], {"ids": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="duplicate keys"):
        store.put(["a", "a"], {"ids": torch.zeros(2)})
    assert store.keys() == []


def test_clear_idempotent_and_partitions(store):
    store.put(["a", "b"], {"x": torch.zeros(2)}, partition="p1")
    store.put(["a", "c"], {"x": torch.zeros(2)}, partition="p2")
    assert store.clear(["a", "nope"], partition="p1") == 1
    assert store.clear(["a", "nope"], partition="p1") == 0  # again: no error
    assert sorted(store.keys("p1")) == ["b"] and sorted(store.keys("p2")) == ["a", "c"]
    assert store.clear_partition("p2") == 2
    assert store.clear_partition("p2") == 0
    assert store.keys() == [("p1", "b")]
    meta = store.meta(["b"], partition="p1")
    store.clear(meta)
    assert store.keys() == []


def test_memory_freed_when_rows_cleared(store):
    store.put([f"k{i}" for i in range(4)], {"x": torch.zeros(4, 1000), "y": torch.zeros(4)})
    held = store.chunks()
    assert held >= 2  # one payload per field (per storage unit holding some of the keys)
    store.clear(["k0", "k1", "k2"])
    assert 2 <= store.chunks() <= held  # k3's rows keep their payloads
    store.clear(["k3"])
    assert store.chunks() == 0
    store.put(["a"], {"x": torch.zeros(1)})
    store.put(["a"], {"x": torch.ones(1)}, overwrite=True)  # the overwritten payload is dropped
    assert store.chunks() == 1


def test_keys_of_one_put_and_keys_written_again_read_clear_and_release_alike():
    """A put of new keys keeps one (shared field map, row) entry per key; a key written again gets its
    own entry. Reads, metas, refusals, clears and the chunks' counts are the same over both kinds."""
    from refit.data.store import StorageUnit

    dropped = []
    u = StorageUnit(on_drop=dropped.append)
    keys = ["a", "b", "c", "d"]
    u.put("p", keys, {"x": torch.arange(8).reshape(4, 2), "y": torch.arange(4)}, [{}] * 4, None)
    u.put("p", ["b", "c"], {"adv": torch.tensor([1.0, 2.0])}, [{}, {"t": 1}], None)  # b, c: their own entries
    u.put("p", ["c"], {"x": torch.tensor([[70, 71]])}, [{}], None, overwrite=True)
    assert u.clash("p", ["a", "b"], ["y"]) == (
        "put: key 'a' in partition 'p' already has field 'y' (pass overwrite=True to replace it)"
    )
    assert u.clash("p", ["a", "d"], ["adv"]) is None
    got = u.get_stacked("p", ["d", "c", "b", "a"], ["x", "y"])
    assert got["x"].tolist() == [[6, 7], [70, 71], [2, 3], [0, 1]] and got["y"].tolist() == [3, 2, 1, 0]
    assert u.get_stacked("p", ["c", "b"], ["adv"])["adv"].tolist() == [2.0, 1.0]
    with pytest.raises(MissingFieldError, match=r"field 'adv' was never produced for key 'a'.*\['x', 'y'\]"):
        u.get_stacked("p", ["b", "a"], ["adv"])
    assert u.meta("p", ["a", "c"]).fields == ("x", "y") and list(u.meta("p", ["b", "c"]).tags) == [{}, {"t": 1}]
    assert set(u.meta("p", ["b", "c"]).fields) == {"x", "y", "adv"}
    assert u.chunks() == 4 and dropped == []  # x, y, adv, c's new x
    assert u.clear("p", ["a", "c"], only=lambda i, payloads: i == 1) == 1  # c only: its new x goes
    assert u.chunks() == 3 and len(dropped) == 1 and dropped[0].tolist() == [[70, 71]]
    assert u.clear("p", ["a", "b", "d"]) == 3
    assert u.chunks() == 0 and len(dropped) == 4 and u.keys() == []


def test_a_uniform_clear_asks_once_per_shared_map_and_still_per_key_elsewhere():
    """``clear(only=..., uniform=True)`` (a clear through one put's meta): ``only`` is asked once for the keys
    that share one put's field map, once per key with its own entry, and each key gets its map's answer:
    a key written again by another put is kept where that put is not the one asked for."""
    from refit.data.store import StorageUnit

    u = StorageUnit()
    x = torch.arange(4)
    u.put("p", ["a", "b", "c", "d"], {"x": x}, [{}] * 4, None)  # put 1: one shared map
    u.put("p", ["e", "f"], {"x": torch.arange(2)}, [{}] * 2, None)  # put 2: another
    u.put("p", ["c"], {"x": torch.tensor([9])}, [{}], None, overwrite=True)  # c: written again, its own entry
    asked = []

    def of_put_1(i, payloads):
        asked.append(i)
        return any(p is x for p in payloads)

    assert u.clear("p", ["a", "b", "c", "d", "e", "f", "zz"], only=of_put_1, uniform=True) == 3  # a, b, d
    assert sorted(asked) == [0, 2, 4]  # put 1's map (first asked at a), c's own entry, put 2's map
    assert sorted(k for _, k in u.keys()) == ["c", "e", "f"]
    asked.clear()
    assert u.clear("p", ["e", "f"], only=lambda i, payloads: asked.append(i) or True, uniform=True) == 2
    assert asked == [0]  # one put's keys: one question
    assert u.clear("p", ["c"], only=lambda i, payloads: False, uniform=True) == 0 and u.chunks() == 1


def test_fields_written_back_row_for_row_then_overwritten_read_and_release_exactly():
    """The README's flow on one unit: a rollout put, advantages written back to the same keys in the same
    order, a field overwritten the same way, a key re-put alone; reads, refusals, metas, chunk counts and
    drops stay exact."""
    from refit.data.store import StorageUnit

    dropped = []
    u = StorageUnit(on_drop=dropped.append)
    keys = ["a", "b", "c", "d"]
    u.put("p", keys, {"x": torch.arange(8).reshape(4, 2), "y": torch.arange(4)}, [{}] * 4, [5, 6, 7, 8])
    u.put("p", keys, {"adv": torch.tensor([0.5, 1.5, 2.5, 3.5])}, [{}] * 4, None)
    with pytest.raises(ValueError, match="key 'a' in partition 'p' already has field 'adv'"):
        u.put("p", ["e", "a"], {"adv": torch.zeros(2)}, [{}] * 2, None)
    assert u.keys() == [("p", k) for k in keys]  # "e" was not written
    u.put("p", keys, {"y": torch.tensor([40, 41, 42, 43])}, [{}] * 4, None, overwrite=True)
    assert len(dropped) == 1 and dropped[0].tolist() == [0, 1, 2, 3]  # the first y, replaced in every key
    u.put("p", ["c"], {"x": torch.tensor([[90, 91]])}, [{"t": 1}], None, overwrite=True)  # c: its own entry
    got = u.get_stacked("p", ["d", "c", "b", "a"], ["x", "y", "adv"])
    assert got["x"].tolist() == [[6, 7], [90, 91], [2, 3], [0, 1]] and got["y"].tolist() == [43, 42, 41, 40]
    assert got["adv"].tolist() == [3.5, 2.5, 1.5, 0.5]
    meta = u.meta("p", keys)
    assert set(meta.fields) == {"x", "y", "adv"} and list(meta.seq_lens) == [5, 6, 7, 8]
    assert list(meta.tags) == [{}, {}, {"t": 1}, {}]
    assert u.chunks() == 4  # x, adv, the second y, c's x
    assert u.clear("p", ["a", "c"]) == 2 and len(dropped) == 2 and dropped[1].tolist() == [[90, 91]]
    assert u.clear("p", ["b", "d"]) == 2 and u.chunks() == 0 and len(dropped) == 5
    with pytest.raises(ValueError, match="put: no keys"):
        u.put("p", [], {"x": torch.zeros(0, 2)}, [], None)
    assert u.chunks() == 0  # nothing left behind


def test_meta_rebuilds_tags_and_lengths(store):
    store.put(["a", "b"], {"x": torch.zeros(2)}, tags=[{"version": 1}, {"version": 2}], seq_lens=[10, 20])
    m = store.meta(["b", "a"])
    assert m.tags == ({"version": 2}, {"version": 1}) and m.seq_lens == (20, 10) and m.fields == ("x",)


def _five(**more) -> BatchMeta:
    """Five keys k0..k4 of partition p, field x, tag v=i, lengths 5..1, and ``more``."""
    tags = [{"v": i} for i in range(5)]
    return BatchMeta(
        keys=[f"k{i}" for i in range(5)], partition="p", fields=["x"], tags=tags, seq_lens=[5, 4, 3, 2, 1], **more
    )


def test_batch_meta_ops():
    m = _five(extra_info={"step": 1})
    parts = m.chunk(2)
    assert [p.keys for p in parts] == [("k0", "k1", "k2"), ("k3", "k4")]
    assert BatchMeta.concat(parts) == m
    r = m.reorder([4, 3, 2, 1, 0])
    assert r.keys[0] == "k4" and r.seq_lens == (1, 2, 3, 4, 5) and r.tags[0] == {"v": 4}
    assert m.select([1, 3]).total_tokens == 6
    assert len(m.chunk(7)) == 7 and sum(len(p) for p in m.chunk(7)) == 5
    with pytest.raises(ValueError, match="not a permutation"):
        m.reorder([0, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="different partitions"):
        BatchMeta.concat([m, BatchMeta(keys=["z"], partition="q")])
    with pytest.raises(ValueError, match="duplicate keys"):
        BatchMeta.concat([m, m])


def test_select_equals_the_validated_constructor_and_names_bad_positions():
    m = _five(extra_info={"plan": [1, 2]}, where=[("w", i) for i in range(5)])
    for idx in ([4, 0, 2], [-1, 1], [3], [], range(5), np.array([2, 0]), torch.tensor([1, -2])):
        got = m.select(idx)
        pos = [int(i) % 5 for i in idx]
        want = BatchMeta(
            keys=[m.keys[i] for i in pos],
            partition="p",
            fields=["x"],
            tags=[m.tags[i] for i in pos],
            seq_lens=[m.seq_lens[i] for i in pos],
            extra_info={"plan": [1, 2]},
            where=[m.where[i] for i in pos],
        )
        assert got == want and got.where == want.where and repr(got) == repr(want)
    share = m.select([3, 1])
    share.tags[0]["v"] = 99  # a copy: the source meta's tags are not shared
    share.extra_info["plan"].append(3)
    assert m.tags[3] == {"v": 3} and m.extra_info == {"plan": [1, 2]}
    with pytest.raises(IndexError, match=r"indices \[5, -6\] out of range for 5 keys"):
        m.select([0, 5, -6])
    with pytest.raises(ValueError, match=r"duplicate keys \['k4'\] in partition 'p'"):
        m.select([4, 0, -1])
    for bad in ([0, 1.7], ["1"], [True, False], torch.tensor([True, False]), np.array([False, True])):
        with pytest.raises(TypeError, match=r"BatchMeta\.select: positions"):  # not truncated, not a mask
            m.select(bad)
    assert m.reorder(iter([4, 3, 2, 1, 0])).keys == ("k4", "k3", "k2", "k1", "k0")  # an iterator read once
    with pytest.raises(TypeError, match=r"BatchMeta\.reorder: positions must be integers"):
        m.reorder([4.0, 3.0, 2.0, 1.0, 0.0])


def test_a_pickled_meta_comes_back_equal_with_its_own_tags_and_refuses_misaligned_counts():
    plain = BatchMeta(keys=["a", "b", "c"], partition="p", fields=["x"], seq_lens=[1, 2, 3], where=[(0, 0)] * 3)
    tagged = _five(extra_info={"plan": [1]})
    for m in (plain, tagged, plain.select([])):
        back = pickle.loads(pickle.dumps(m))
        assert back == m and back.where == m.where and repr(back) == repr(m)
        assert all(a is not b for a, b in zip(back.tags, m.tags))  # fresh dicts, not shared
    _, args = plain.__reduce__()
    assert args[3] is None  # no tags: no empty dict per key on the wire
    back = pickle.loads(pickle.dumps(plain))
    back.tags[0]["v"] = 1  # one dict per key, not one shared by all
    assert back.tags[1] == {}
    share = BatchMeta.trusted(
        ("a", "b"), "p", ("x",), ({}, {}), None, PutRows(Placed([1], [2], ("x",), "o", "w"), (4, 1))
    )
    back = pickle.loads(pickle.dumps(share))
    assert isinstance(back.where, PutRows) and back.where.rows == (4, 1) and back.where.placed.origin == "o"
    keys, partition, fields, _, lens, info, where = args
    for crafted in (
        (list(keys), partition, fields, None, lens, info, where),
        (keys, 7, fields, None, lens, info, where),
        (keys, partition, fields, "abc", lens, info, where),
        (keys, partition, fields, None, lens, [1], where),
    ):
        with pytest.raises(ValueError, match="not a pickled meta"):
            _unpickled(*crafted)
    for bad, what in (
        ((keys, partition, fields, ({},), lens, info, where), "1 tags"),
        ((keys, partition, fields, None, (1,), info, where), "1 seq_lens"),
        ((keys, partition, fields, None, lens, info, ((0, 0),)), "1 locations"),
    ):
        with pytest.raises(ValueError, match=f"BatchMeta: {what} for 3 keys"):
            _unpickled(*bad)


def test_trusted_meta_equals_the_validated_one():
    keys, tags = [f"k{i}" for i in range(4)], [{"v": i} for i in range(4)]
    fast = BatchMeta.trusted(tuple(keys), "p", ("x", "y"), tuple(tags), (3, 2, 1, 0), where=None)
    slow = BatchMeta(keys=keys, partition="p", fields=["x", "y"], tags=tags, seq_lens=[3, 2, 1, 0])
    assert fast == slow and repr(fast) == repr(slow) and hash(fast.keys) == hash(slow.keys)
    assert fast.extra_info == {} and fast.where is None and isinstance(fast.tags, tuple)
    assert fast.select([2, 0]) == slow.select([2, 0]) and BatchMeta.concat([fast, slow.select([])]) == slow
    with pytest.raises(AttributeError):  # frozen, as the validated one
        fast.keys = ()  # type: ignore[misc]


def test_put_returns_the_validated_meta_and_bad_input_still_names_its_error(store):
    meta = store.put(["a", "b"], {"x": torch.zeros(2, 3)}, partition="m", tags={"v": 1}, seq_lens=torch.tensor([4, 5]))
    want = BatchMeta(keys=["a", "b"], partition="m", fields=["x"], tags=[{"v": 1}, {"v": 1}], seq_lens=[4, 5])
    assert meta == want and type(meta.seq_lens[0]) is int and type(meta.keys) is tuple
    meta.tags[0]["v"] = 99  # the meta's dicts are its own: not the store's, not each other's
    assert meta.tags[1] == {"v": 1} and store.meta(["a"], partition="m").tags == ({"v": 1},)
    with pytest.raises(ValueError, match=r"put: duplicate keys \['a'\]"):
        store.put(["a", "a"], {"x": torch.zeros(2, 3)}, partition="m2")
    with pytest.raises(ValueError, match="put: 1 seq_lens for 2 keys"):
        store.put(["c", "d"], {"x": torch.zeros(2, 3)}, partition="m2", seq_lens=[1])
    with pytest.raises(ValueError, match="BatchMeta: duplicate keys"):  # a user's own meta is still checked
        BatchMeta(keys=["a", "a"], partition="m")
    assert store.keys("m2") == []


def test_take_is_get_then_clear_in_one_step(store):
    data = _batch()
    keys = ["a", "b", "c", "d", "e", "f"]
    meta = store.put(keys, data, partition="t")
    with pytest.raises(MissingFieldError):
        store.take(meta, select_fields=["never_written"])
    assert sorted(store.keys("t")) == keys  # a refused take clears nothing
    got = store.take(meta.select([4, 0, 1]), select_fields=["input_ids", "reward"])
    assert torch.equal(got["input_ids"], data["input_ids"][[4, 0, 1]]) and torch.equal(
        got["reward"], data["reward"][[4, 0, 1]]
    )
    assert sorted(store.keys("t")) == ["c", "d", "f"]
    with pytest.raises(MissingKeyError):
        store.take(["a"], select_fields=["input_ids"], partition="t")  # taken once
    rest = store.take(["c", "d"], select_fields=["input_ids"], partition="t", copy=True)
    rest["input_ids"].zero_()
    assert store.take(["f"], select_fields=["input_ids"], partition="t")["input_ids"].shape == (1, 7)
    assert store.keys("t") == [] and store.chunks() == 0


def test_group_rows_groups_pairs_by_owner_key_in_first_seen_order():
    from refit.data.store import group_rows

    def no_key(_):
        raise AssertionError("one owner: key is not called")

    one = object()
    assert group_rows([(one, 4), (one, 2)], no_key) == [(one, [0, 1], [4, 2])]
    assert group_rows([]) == []
    assert group_rows([(7, 0), (3, 5), (7, 1)]) == [(7, [0, 2], [0, 1]), (3, [1], [5])]
    a, b, a2 = ("x", 1), ("y", 2), ("x", 3)  # a2: another owner of a's key, grouped with it
    assert group_rows([(a, 0), (b, 1), (a2, 2)], key=lambda o: o[0]) == [(a, [0, 2], [0, 2]), (b, [1], [1])]


def test_gather_of_ranges_is_the_view_lists_give():
    from refit.data.store import gather

    t = torch.arange(24).reshape(6, 4)
    whole = gather(6, [(t, range(6), range(6))])
    assert whole.data_ptr() == t.data_ptr() and torch.equal(whole, gather(6, [(t, list(range(6)), list(range(6)))]))
    tail = gather(2, [(t, range(2), range(4, 6))])
    assert torch.equal(tail, t[4:6]) and tail.data_ptr() == t[4].data_ptr()
    private = gather(6, [(t, range(6), range(6))], copy=True)
    assert torch.equal(private, t) and private.data_ptr() != t.data_ptr()


def test_zero_copy_decode_of_read_only_bytes_is_exact_and_silent():
    import warnings

    from refit.data.ray_actor import decode, encode

    t = torch.randn(3, 5).to(torch.bfloat16)
    arr, dtype, shape = encode(t)
    arr = arr.copy()
    arr.flags.writeable = False  # as an object-store buffer is
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        view = decode((arr, dtype, shape), copy=False)
    assert view.dtype == torch.bfloat16 and torch.equal(view.view(torch.int16), t.view(torch.int16))
    assert view.data_ptr() == arr.ctypes.data  # a view of the bytes, not a copy
