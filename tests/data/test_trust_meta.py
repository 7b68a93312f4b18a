"""``RayStore(trust_meta=True)``: reads through a put's ``BatchMeta`` make no call to the storage
actors, puts return before their record is confirmed, and what that trades is exactly what the
docs say: a refusal is never lost, a take stays exactly-once, and the rows read are the put's."""

import re
import sys

import pytest
import torch

from refit.data import MissingKeyError

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this test module


def _batch(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 1 << 30, (n, 40_000), generator=g, dtype=torch.int32),  # in the object store
        "logprobs": torch.randn(n, 7, generator=g).to(torch.bfloat16),
    }


@pytest.fixture(params=[True, False], ids=["durable", "durable=False"])
def trusting(request, ray_store):
    """A trust_meta client of the package's storage actors, emptied before and after."""
    from refit.data.ray_store import RayStore

    s = RayStore(len(ray_store.actors), durable=request.param, trust_meta=True, _names=ray_store._names)
    for p in {p for p, _ in s.keys()}:
        s.clear_partition(p)
    yield s
    for p in {p for p, _ in s.keys()}:
        s.clear_partition(p)
    s.settle()


class _NoCalls:
    """Stands in for the storage actors: any call through it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"a call to the storage actor ({name}) was made")


def test_get_through_the_meta_makes_no_call_and_returns_exact_rows(trusting, monkeypatch):
    data = _batch(6, 0)
    meta = trusting.put([f"k{i}" for i in range(6)], data, partition="tm")
    trusting.confirm()
    monkeypatch.setattr(trusting, "_unit", lambda partition: _NoCalls())
    got = trusting.get(meta, select_fields=["ids", "logprobs"])
    assert torch.equal(got["ids"], data["ids"]) and torch.equal(
        got["logprobs"].view(torch.int16), data["logprobs"].view(torch.int16)
    )
    shard = trusting.get(meta.select([5, 0, 3]), select_fields=["ids"])  # a DP rank's scattered share
    assert torch.equal(shard["ids"], data["ids"][[5, 0, 3]])
    with pytest.raises(AssertionError, match="call to the storage actor"):
        trusting.get(list(meta.keys), select_fields=["ids"], partition="tm")  # by key list: asks the actor


def test_shares_read_in_other_processes_and_concatenated_metas(trusting):
    a, b = _batch(4, 1), _batch(3, 2)
    ma = trusting.put([f"a{i}" for i in range(4)], a, partition="tm")
    mb = trusting.put([f"b{i}" for i in range(3)], b, partition="tm")
    both = type(ma).concat([ma, mb])
    assert both.where is not None and len(both.where) == 7

    @ray.remote(num_cpus=0)
    def read(store, meta):
        return store.get(meta, select_fields=["ids"], copy=True)["ids"]

    got = ray.get(read.remote(trusting, both.select([6, 1, 4])))
    assert torch.equal(got, torch.cat([b["ids"][[2]], a["ids"][[1]], b["ids"][[0]]]))
    assert trusting.clear(both) == 7


def test_take_through_the_meta_is_exactly_once(trusting):
    data = _batch(5, 3)
    meta = trusting.put([f"t{i}" for i in range(5)], data, partition="tm")
    got = trusting.take(meta.select([3, 4]), select_fields=["ids"])
    assert torch.equal(got["ids"], data["ids"][3:5])
    assert sorted(trusting.keys("tm")) == ["t0", "t1", "t2"]
    with pytest.raises(MissingKeyError):
        trusting.take(meta.select([4, 0]), select_fields=["ids"])  # t4 was taken: nothing dropped
    assert sorted(trusting.keys("tm")) == ["t0", "t1", "t2"]
    with pytest.raises(KeyError):  # a field the put never wrote: refused, nothing dropped
        trusting.take(meta.select([0]).with_fields(["reward"]), select_fields=["reward"])
    assert trusting.take(meta.select([0, 1, 2]), select_fields=["logprobs"])["logprobs"].shape == (3, 7)
    assert trusting.keys("tm") == []


def test_a_refused_put_is_reported_and_never_taken(trusting):
    first = _batch(3, 4)
    trusting.put(["x0", "x1", "x2"], first, partition="tm")
    clash = trusting.put(["x2", "x3"], _batch(2, 5), partition="tm")  # returns: not confirmed yet
    with pytest.raises(ValueError, match="trust_meta.*'x2'.*already has field"):
        trusting.take(clash, select_fields=["ids"])  # waits for the record: refused, drops nothing
    assert sorted(trusting.keys("tm")) == ["x0", "x1", "x2"]  # the first put's keys are whole
    got = trusting.get(["x2"], select_fields=["ids"], partition="tm")["ids"]
    assert torch.equal(got, first["ids"][[2]])  # the first put's row, not the refused one's
    trusting.put(["x1"], {"ids": torch.zeros(1, 4, dtype=torch.int32)}, partition="tm")
    with pytest.raises(ValueError, match="'x1'.*already has field"):
        trusting.confirm()  # the writer's next call reports its refused put
    trusting.confirm()  # reported once


def test_fields_outside_the_meta_go_through_the_actor(trusting):
    data = _batch(4, 6)
    meta = trusting.put([f"f{i}" for i in range(4)], data, partition="tm")
    adv = torch.arange(4, dtype=torch.float32)
    trusting.put(list(meta.keys), {"advantages": adv}, partition="tm")
    both = meta.with_fields(["advantages"])
    got = trusting.get(both, select_fields=["advantages", "ids"])  # advantages: not in the meta's put
    assert torch.equal(got["advantages"], adv) and torch.equal(got["ids"], data["ids"])


def test_the_documented_trade_reads_the_puts_rows_after_a_clear(trusting):
    data = _batch(2, 7)
    meta = trusting.put(["s0", "s1"], data, partition="tm")
    assert trusting.clear(meta) == 2
    with pytest.raises(MissingKeyError):
        trusting.get(["s0"], select_fields=["ids"], partition="tm")  # the store no longer holds it
    stale = trusting.get(meta, select_fields=["ids"])  # the meta holds the object: what the put wrote
    assert torch.equal(stale["ids"], data["ids"])
    with pytest.raises(MissingKeyError):
        trusting.take(meta, select_fields=["ids"])  # but a consuming read is refused


def test_a_store_that_does_not_trust_metas_ignores_their_locations(trusting, ray_store):
    meta = trusting.put(["u0"], _batch(1, 8), partition="tm")
    assert trusting.clear(meta) == 1
    with pytest.raises(MissingKeyError):
        ray_store.get(meta, select_fields=["ids"])  # the default client asks the actor


@ray.remote(num_cpus=0)
class Writer:
    def put(self, store, keys):
        meta = store.put(keys, _batch(len(keys), 9), partition="tm")
        store.confirm()  # recorded (and, durable, pinned by the storage actor)
        return meta


def test_a_durable_put_outlives_its_writer_when_read_through_the_meta(trusting):
    if not trusting.durable:
        pytest.skip("durable=False: the keys die with the writer, as documented")
    w = Writer.remote()
    meta = ray.get(w.put.remote(trusting, ["w0", "w1"]))
    ray.kill(w, no_restart=True)
    got = trusting.take(meta, select_fields=["ids"], copy=True)  # the writer's object is gone: the copy
    assert torch.equal(got["ids"], _batch(2, 9)["ids"])
    assert trusting.keys("tm") == []


def test_a_take_through_an_old_meta_never_consumes_a_newer_put(trusting):
    old = trusting.put(["r0"], {"ids": torch.ones(1, 4, dtype=torch.int32)}, partition="tm")
    trusting.take(old, select_fields=["ids"])
    new = trusting.put(["r0"], {"ids": torch.full((1, 4), 2, dtype=torch.int32)}, partition="tm")
    with pytest.raises(MissingKeyError, match="'r0'.*no longer holds the put its meta names"):
        trusting.take(old, select_fields=["ids"])  # taken once: the new put's row stays
    trusting.put(["r0"], {"ids": torch.full((1, 4), 3, dtype=torch.int32)}, partition="tm", overwrite=True)
    with pytest.raises(MissingKeyError, match="no longer holds"):
        trusting.take(new, select_fields=["ids"])  # overwritten since: not this meta's row
    assert trusting.clear(new) == 0 and trusting.keys("tm") == ["r0"]  # a clear through it drops nothing
    got = trusting.take(["r0"], select_fields=["ids"], partition="tm")["ids"]
    assert got.tolist() == [[3, 3, 3, 3]]


def test_a_clients_puts_of_the_same_keys_keep_their_order(trusting):
    for r in range(20):  # the storage actor is threaded: without the wait, a later overwrite could land first
        trusting.put([f"o{r}"], {"ids": torch.zeros(1, 4, dtype=torch.int32)}, partition="tm")
        trusting.put([f"o{r}"], {"ids": torch.ones(1, 4, dtype=torch.int32)}, partition="tm", overwrite=True)
        rollout = trusting.put([f"p{r}"], {"ids": torch.zeros(1, 4, dtype=torch.int32)}, partition="tm")
        trusting.put([f"p{r}"], {"adv": torch.ones(1)}, partition="tm")  # a new field for the same key
        trusting.take(rollout, select_fields=["ids"])  # waits for this client's pending puts first
    got = trusting.get([f"o{r}" for r in range(20)], select_fields=["ids"], partition="tm")["ids"]
    assert bool((got == 1).all())
    assert sorted(trusting.keys("tm")) == sorted(f"o{r}" for r in range(20))  # no key re-created after its take


def test_every_refusal_is_reported_once_and_none_is_lost(trusting):
    trusting.put(["a", "b"], {"ids": torch.zeros(2, 4, dtype=torch.int32)}, partition="tm")
    trusting.confirm()
    trusting.put(["a"], {"ids": torch.ones(1, 4, dtype=torch.int32)}, partition="tm")
    try:  # a's refusal is reported by the next put where its reply is in by then (that put is not made) ...
        trusting.put(["b"], {"ids": torch.ones(1, 4, dtype=torch.int32)}, partition="tm")
    except ValueError as e:
        assert re.search(r"^1 put\(s\) refused.*'a'", str(e)) and "'b'" not in str(e), e
        trusting.confirm()  # ... and not again
    else:  # ... else by confirm, with b's
        with pytest.raises(ValueError, match=r"2 put\(s\) refused.*'a'.*'b'"):
            trusting.confirm()
    trusting.confirm()  # reported once
    assert trusting.get(["a", "b"], select_fields=["ids"], partition="tm")["ids"].sum() == 0


def test_a_put_that_reports_an_earlier_refusal_is_not_made(trusting):
    trusting.put(["c"], {"ids": torch.zeros(1, 4, dtype=torch.int32)}, partition="tm")
    trusting.confirm()
    trusting.put(["c"], {"ids": torch.ones(1, 4, dtype=torch.int32)}, partition="tm")  # refused later
    ray.get(trusting._pending._items[0][0])  # its reply is in
    with pytest.raises(ValueError, match="'c'.*already has field"):
        trusting.put(["d"], {"ids": torch.ones(1, 4, dtype=torch.int32)}, partition="tm")
    assert trusting.keys("tm") == ["c"]  # "d" was not written


def test_zero_copy_survives_chunking_pickling_and_concat(trusting):
    data = _batch(4, 10)
    meta = trusting.put([f"z{i}" for i in range(4)], data, partition="tm")
    parts = [ray.get(ray.put(m)) for m in meta.chunk(2)]  # two separate deserializations
    joined = type(meta).concat(parts)
    assert joined == meta  # locations take no part in equality
    one = trusting.get(joined, select_fields=["ids"])["ids"]
    again = trusting.get(meta, select_fields=["ids"])["ids"]
    assert one.data_ptr() == again.data_ptr()  # one put, one object: a view, not a gather


def test_a_puts_locations_are_one_compact_sequence_equal_to_its_pairs(trusting):
    from refit.data.placed import Placed, PutRows

    data = _batch(5, 11)
    meta = trusting.put([f"c{i}" for i in range(5)], data, partition="tm")
    where = meta.where
    assert isinstance(where, PutRows) and isinstance(where[0][0], Placed)
    pairs = tuple((where.placed, i) for i in range(5))
    assert tuple(where) == pairs and list(where) == list(pairs) and len(where) == 5
    assert where[-1] == pairs[-1] and where[1:3] == pairs[1:3]
    with pytest.raises(IndexError, match="out of range for 5 rows"):
        where[5]
    shipped = ray.get(ray.put(meta))  # pickled as (placed, rows), not one pair per key
    assert isinstance(shipped.where, PutRows) and len(shipped.where) == 5 and shipped == meta
    share = meta.select([4, 1, -2])  # a DP rank's share stays one compact sequence of its put's rows
    assert isinstance(share.where, PutRows) and share.where == (pairs[4], pairs[1], pairs[3])
    assert share.select([2, 0]).where.rows == (3, 4)
    flipped = meta.reorder([1, 0, 2, 3, 4]).where
    assert isinstance(flipped, PutRows) and flipped == (pairs[1], pairs[0], *pairs[2:])
    assert all(isinstance(part.where, PutRows) for part in meta.chunk(2)) and meta.select([]).where == ()
    assert type(meta).concat([share, meta.select([0])]).where == (pairs[4], pairs[1], pairs[3], pairs[0])
    sent = ray.get(ray.put(share))
    assert isinstance(sent.where, PutRows) and sent == share
    assert torch.equal(trusting.get(sent, select_fields=["ids"])["ids"], data["ids"][[4, 1, 3]])
    got = trusting.get(shipped, select_fields=["ids"])["ids"]
    assert torch.equal(got, data["ids"])
    assert got.data_ptr() == trusting.get(meta, select_fields=["ids"])["ids"].data_ptr()  # one object, a view
    tail = meta.chunk(2)[1]  # rows 3, 4 in order: a view of the put's object, not a gather
    assert tail.where.rows == (3, 4)
    assert trusting.get(tail, select_fields=["ids"])["ids"].data_ptr() == got.data_ptr() + 3 * data["ids"][0].nbytes
    torn = type(meta).trusted(meta.keys[:2], meta.partition, meta.fields, meta.tags[:2], None, meta.where)
    with pytest.raises(ValueError, match="5 locations for 2 keys"):
        trusting.get(torn, select_fields=["ids"])


def test_a_take_through_a_concatenated_meta_checks_each_keys_own_put(trusting):
    a = trusting.put(["m0", "m1"], _batch(2, 12), partition="tm")
    b = trusting.put(["m2"], _batch(1, 13), partition="tm")
    trusting.take(b, select_fields=["ids"])
    trusting.put(["m2"], _batch(1, 14), partition="tm")  # m2 written again: not b's put any more
    both = type(a).concat([a, b])  # per-key origins: a's for m0 and m1, b's for m2
    with pytest.raises(MissingKeyError, match="'m2'.*no longer holds"):
        trusting.take(both, select_fields=["ids"])
    assert sorted(trusting.keys("tm")) == ["m0", "m1", "m2"]  # nothing dropped
    assert trusting.clear(both) == 2 and trusting.keys("tm") == ["m2"]  # only a's keys were both's


@ray.remote(num_cpus=0)
def _take_elsewhere(store, meta):
    """A trainer rank's take through a share it was sent: returns the rows and the share's reply as received."""
    return store.take(meta, select_fields=["ids"], copy=True)["ids"], meta.where.placed.reply


def test_a_shipped_share_carries_no_reply_and_is_taken_exactly_once_elsewhere(trusting):
    data = _batch(4, 15)
    meta = trusting.put([f"s{i}" for i in range(4)], data, partition="tm")  # not confirmed: the take may come first
    got, reply = ray.get(_take_elsewhere.remote(trusting, meta.select([3, 0])))
    assert reply is None and meta.where.placed.reply is not None  # the writer keeps it; the share does not carry it
    assert torch.equal(got, data["ids"][[3, 0]]) and sorted(trusting.keys("tm")) == ["s1", "s2"]
    with pytest.raises(MissingKeyError, match="'s3'"):  # taken once: the second take fails at once, drops nothing
        ray.get(_take_elsewhere.remote(trusting, meta.select([1, 3])))
    assert sorted(trusting.keys("tm")) == ["s1", "s2"]
    clash = trusting.put(["s1"], _batch(1, 16), partition="tm")  # refused later by the storage actor
    with pytest.raises(ValueError, match="refused.*'s1'.*already has field"):
        ray.get(_take_elsewhere.remote(trusting, clash))
    with pytest.raises(ValueError, match="'s1'.*already has field"):
        trusting.confirm()  # the writer still hears of its refusal
    assert sorted(trusting.keys("tm")) == ["s1", "s2"]


def _call(origin, keys=("a0", "a1"), partition="arr"):
    """A storage actor's put call for a ``durable=False`` ``trust_meta`` put of ``keys`` (see ``_record``)."""
    return (partition, list(keys), [None], ("ids",), None, None, False, False, origin)


def test_a_take_or_clear_through_a_shipped_meta_waits_for_its_put_to_arrive(monkeypatch):
    """The storage actor's side, in this process: the put's call may reach the actor after a take or clear
    through the meta it returned (the share was shipped without the put's reply)."""
    import threading
    import time

    from refit.data import ray_actor as rs

    actor = rs._StorageActor()
    late = f"{'1' * 32}@{time.time():.3f}"
    timer = threading.Timer(0.3, actor.put, (_call(late),))
    timer.start()  # the put arrives while the take below waits for it
    actor.drop("arr", ["a0", "a1"], ["ids"], late)
    timer.join()
    assert actor.keys() == []  # taken: both keys dropped, once
    with pytest.raises(MissingKeyError):  # arrived and taken: a second take fails at once
        actor.drop("arr", ["a0", "a1"], ["ids"], late)
    cleared = f"{'2' * 32}@{time.time():.3f}"
    timer = threading.Timer(0.3, actor.put, (_call(cleared, ("c0", "c1")),))
    timer.start()
    assert actor.clear("arr", ["c0", "c1"], cleared) == 2  # not 0 with the keys left behind
    timer.join()
    assert actor.keys() == []
    refused = f"{'3' * 32}@{time.time():.3f}"
    actor.put(_call(f"{'4' * 32}@{time.time():.3f}", ("r0",)))
    assert "already has field" in actor.put(_call(refused, ("r0",)))
    with pytest.raises(ValueError, match="refused.*'r0'.*already has field"):
        actor.drop("arr", ["r0"], ["ids"], refused)
    assert actor.clear("arr", ["r0"], refused) == 0 and len(actor.keys()) == 1  # the rival's key stays
    waits = []
    real = actor.arrival.wait
    monkeypatch.setattr(actor.arrival, "wait", lambda timeout: waits.append(timeout) or real(timeout))
    with pytest.raises(MissingKeyError):  # made long ago and never arrived (or forgotten): no wait
        actor.drop("arr", ["old"], ["ids"], f"{'5' * 32}@1000.0")
    for timeless in ("6" * 32, f"{'6' * 32}@nan", f"{'6' * 32}@inf"):  # no finite time: no wait either
        with pytest.raises(MissingKeyError):
            actor.drop("arr", ["old"], ["ids"], timeless)
    assert waits == []
    monkeypatch.setattr(rs, "ARRIVAL_WINDOW_S", 0.2)
    with pytest.raises(MissingKeyError):  # made just now but never arrives: waits out the window, then fails
        actor.drop("arr", ["gone"], ["ids"], f"{'7' * 32}@{time.time():.3f}")
    assert waits and all(0.0 < w <= 0.2 for w in waits)


def test_a_put_that_arrives_between_a_take_and_its_wait_is_not_missed(monkeypatch):
    """The put lands after the take or clear first looked at the keys and before it asks whether the put has
    arrived: it must still try again (the put is new since it first looked), not fail or leave keys."""
    import time

    from refit.data import ray_actor as rs

    actor = rs._StorageActor()
    for op, token in (("clear", "8"), ("take", "9")):
        origin = f"{token * 32}@{time.time():.3f}"
        keys = [f"{op}0", f"{op}1"]
        name = "clear" if op == "clear" else "locate"
        real = getattr(actor.unit, name)
        landed = []

        def first_then_put(*a, real=real, origin=origin, keys=keys, landed=landed, **kw):
            try:
                return real(*a, **kw)
            finally:
                if not landed:
                    landed.append(actor.put(_call(origin, keys)))  # the put, right after the first look

        monkeypatch.setattr(actor.unit, name, first_then_put)
        if op == "clear":
            assert actor.clear("arr", keys, origin) == 2
        else:
            actor.drop("arr", keys, ["ids"], origin)
        monkeypatch.undo()
        assert landed == [None] and actor.keys() == []


def test_a_clear_through_two_puts_clears_the_one_that_arrived(monkeypatch):
    import threading
    import time

    from refit.data import ray_actor as rs

    monkeypatch.setattr(rs, "ARRIVAL_WINDOW_S", 0.5)
    actor = rs._StorageActor()
    a, b = f"{'a' * 32}@{time.time():.3f}", f"{'b' * 32}@{time.time():.3f}"
    timer = threading.Timer(0.1, actor.put, (_call(a, ("a0", "a1")),))
    timer.start()  # a arrives while the clear waits; b never does (its writer died before its call went out)
    assert actor.clear("arr", ["a0", "a1", "b0"], [a, a, b]) == 2
    timer.join()
    assert actor.keys() == []


@ray.remote(num_cpus=0)
def _direct(store, method, *args):
    """A call to the partition's storage actor as the client makes it (takes and clears on their own threads)."""
    from refit.data.ray_actor import AWAITS

    actor = store._unit("arr")
    call = getattr(actor, method)
    return call.options(concurrency_group=AWAITS).remote(*args) if method != "put" else call.remote(*args)


def test_takes_waiting_for_their_puts_do_not_hold_up_the_puts(ray_store):
    """More takes waiting than the storage actor has threads for them: the puts they wait for still run."""
    import time

    from refit.data.ray_actor import AWAIT_THREADS

    soon = time.time() - 60.0 + 10.0  # made 50 s ago: each waits up to 10 s for a put that never comes
    waits = [
        ray.get(_direct.remote(ray_store, "drop", "arr", [f"w{i}"], ["ids"], f"{i:032x}@{soon:.3f}"))
        for i in range(AWAIT_THREADS + 2)
    ]
    put = ray.get(_direct.remote(ray_store, "put", _call(f"{'e' * 32}@{time.time():.3f}", ("q0",))))
    ready, _ = ray.wait([put], timeout=8)
    assert ready and ray.get(put) is None  # recorded while every take thread is waiting
    assert ray.wait(waits, num_returns=len(waits), timeout=0)[0] == []  # the takes still wait
    assert ray_store.clear(["q0"], partition="arr") == 1
    for w in waits:
        with pytest.raises(MissingKeyError):  # the window ends: nothing to take
            ray.get(w)


def test_the_writer_does_not_pin_a_put_whose_keys_were_taken_elsewhere(trusting):
    """The writer's pending list keeps each put's reply, not its object: once a reader took the keys
    through a shipped share and no meta names the put, the object is released though the writer made
    no call since (before, it stayed pinned until the writer's next call)."""
    import pickle
    import time

    meta = trusting.put(["p0", "p1"], _batch(2, 3), partition="tm")
    counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts  # the owner's table
    ref_id = meta.where.placed.holder[0].hex().encode()
    assert ref_id in counts()  # the table's key form: else the check below could not fail
    shipped = pickle.loads(pickle.dumps(meta))  # as a reader receives it: no reply
    assert shipped.where.placed.reply is None
    reader = pickle.loads(pickle.dumps(trusting))  # another client of the same storage actors
    assert reader.take(shipped, select_fields=["ids"])["ids"].shape == (2, 40_000)
    del meta, shipped
    assert len(trusting._pending) == 1  # still unconfirmed: the writer made no call since its put
    deadline = time.monotonic() + 30
    while ref_id in counts() and time.monotonic() < deadline:
        time.sleep(0.05)  # the storage actor's release reaches the owner asynchronously
    assert ref_id not in counts(), f"the writer still holds its put's object: {counts()[ref_id]}"
    trusting.confirm()


def test_two_threads_confirming_at_once_report_a_refusal_once(trusting, monkeypatch):
    """Two threads of one client read the same pending reply at once (held at a barrier after reading
    it): the refusal is raised in one of them, not both."""
    import threading

    trusting.put(["c"], {"ids": torch.zeros(1, 4, dtype=torch.int32)}, partition="tm")
    trusting.confirm()
    trusting.put(["c"], {"ids": torch.ones(1, 4, dtype=torch.int32)}, partition="tm")  # refused later
    real_get, barrier = ray.get, threading.Barrier(2, timeout=30)

    def get(refs, *args, **kwargs):
        out = real_get(refs, *args, **kwargs)
        if threading.current_thread().name.startswith("confirm-"):
            barrier.wait()  # both threads have read the reply before either reports it
        return out

    monkeypatch.setattr(ray, "get", get)
    errors = []

    def confirm():
        try:
            trusting.confirm()
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=confirm, name=f"confirm-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.undo()
    assert len(errors) == 1 and "'c'" in errors[0] and "already has field" in errors[0], errors
    trusting.confirm()  # nothing left to report
