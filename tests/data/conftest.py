import pytest


@pytest.fixture(scope="package")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="package")
def ray_store(ray_session):
    from refit.data.ray_store import RayStore

    s = RayStore(num_units=3)  # actors start in seconds on a small machine: one set for the session
    yield s
    s.shutdown()


def _empty(store):
    for partition in {p for p, _ in store.keys()}:
        store.clear_partition(partition)
    assert store.keys() == []
    return store


@pytest.fixture(params=["inprocess", "ray"])
def store(request):
    if request.param == "inprocess":
        from refit.data import InProcessStore

        yield InProcessStore()
        return
    s = _empty(request.getfixturevalue("ray_store"))
    yield s
    _empty(s)
