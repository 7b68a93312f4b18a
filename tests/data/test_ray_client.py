"""A pickled ``RayStore`` client carries its storage actors' names, not their handles, and looks the handles
up once per process, when first needed (a get through a ``trust_meta`` meta never needs them); the durable
copy thread runs at a lower scheduling priority than its actor."""

import os
import pickle
import sys
import threading

import pytest
import torch

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this test module


def _flat(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def test_a_pickled_client_carries_names_and_finds_the_same_actors(ray_store):
    from refit.data.ray_store import RayStore

    _, args = ray_store.__reduce__()
    assert not any(isinstance(x, ray.actor.ActorHandle) for x in _flat(args))
    namespace, names = ray_store._names
    assert len(names) == len(ray_store.actors) == 3 and len(set(names)) == 3
    client = pickle.loads(pickle.dumps(ray_store))
    assert isinstance(client, RayStore) and client._actors is None  # nothing looked up yet
    client.put(["c0", "c1"], {"x": torch.arange(6).view(2, 3)}, partition="client")
    assert [a._actor_id for a in client.actors] == [a._actor_id for a in ray_store.actors]
    assert torch.equal(ray_store.get(["c1"], select_fields=["x"], partition="client")["x"], torch.tensor([[3, 4, 5]]))
    again = pickle.loads(pickle.dumps(ray_store))
    assert again.actors is client.actors  # looked up once per process
    assert ray_store.clear(["c0", "c1"], partition="client") == 2


@ray.remote(num_cpus=0)
class _Reader:
    def get(self, store, meta):
        got = store.get(meta, select_fields=["x"])["x"].clone()
        return got, store._actors is None  # True: no handle was looked up for the read

    def keys(self, store, partition):
        return store.keys(partition)


def test_a_trust_meta_get_in_another_process_looks_up_no_actor(ray_store):
    from refit.data.ray_store import RayStore

    s = RayStore(len(ray_store.actors), durable=False, trust_meta=True, _names=ray_store._names)
    data = torch.arange(40).view(8, 5)
    meta = s.put([f"t{i}" for i in range(8)], {"x": data}, partition="client-tm")
    s.confirm()
    r = _Reader.remote()
    got, none_looked_up = ray.get(r.get.remote(s, meta.select([6, 1, 3])))
    assert torch.equal(got, data[[6, 1, 3]]) and none_looked_up
    assert sorted(ray.get(r.keys.remote(s, "client-tm"))) == sorted(meta.keys)  # a call looks them up
    assert s.clear(meta) == 8
    ray.kill(r)


def test_a_client_checks_the_names_it_was_given(ray_session):
    from refit.data.ray_store import RayStore

    ns = ray.get_runtime_context().namespace
    for bad in (
        (ns, ("refit-store-a",)),
        (ns, ["refit-store-a", "refit-store-b"]),
        (ns, ("other", "refit-store-b")),
        (None, ("refit-store-a", "refit-store-b")),
        (ns, ("refit-store-a", 3)),
        "refit-store-a",
    ):
        with pytest.raises(ValueError, match="not a client's actor names"):
            RayStore(2, None, True, False, bad)
    assert RayStore(2, None, True, False, (ns, ("refit-store-a", "refit-store-b")))._actors is None


def test_actor_options_may_not_name_the_actors(ray_session):
    from refit.data.ray_store import RayStore

    for opt in ({"name": "mine"}, {"namespace": "elsewhere"}):
        with pytest.raises(ValueError, match="name or namespace"):
            RayStore(num_units=1, actor_options=opt)


def test_a_client_of_a_store_shut_down_fails_loudly(ray_session):
    from refit.data.ray_store import RayStore

    s = RayStore(num_units=1)
    client = pickle.loads(pickle.dumps(s))
    s.shutdown()
    with pytest.raises((ValueError, ray.exceptions.RayActorError)):
        client.keys()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_durable_copy_thread_runs_at_a_lower_priority(ray_store):
    from refit.data.ray_actor import ADOPT_NICE

    def priorities(actor):
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        copier = actor.adopter.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
        return mine, copier

    for mine, copier in ray.get([a.__ray_call__.remote(priorities) for a in ray_store.actors]):
        assert copier == min(19, mine + ADOPT_NICE) and copier > mine
