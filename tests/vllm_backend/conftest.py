"""The session's shared vLLM engines (``engines.EnginePool``) and the order that lets tests share them."""

from __future__ import annotations

import pytest

from .engines import EngineKey, EnginePool


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm_engine(model, tp, kv_heads=None): the test uses the pooled engine of that key"
    )


def engine_key(item) -> EngineKey | None:
    mark = item.get_closest_marker("vllm_engine")
    if mark is None:
        return None
    if mark.args:
        return EngineKey(*mark.args, **mark.kwargs)
    params = item.callspec.params  # parametrized: the key comes from the case's own parameters
    return EngineKey(params["model"], params.get("tp", params.get("engine_tp")), params.get("kv_heads"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests on pooled engines run as one block where the first of them was collected, those on the same
    engine one after the other (in the order the first of each key was collected, file order within a key);
    every other test keeps its order around the block."""
    pooled = [item for item in items if engine_key(item) is not None]
    if not pooled:
        return
    first: dict[EngineKey, int] = {}
    for n, item in enumerate(pooled):
        first.setdefault(engine_key(item), n)
    pooled.sort(key=lambda item: first[engine_key(item)])  # stable: file order within a key
    at = next(i for i, item in enumerate(items) if engine_key(item) is not None)
    rest = [item for item in items if engine_key(item) is None]
    items[:] = rest[:at] + pooled + rest[at:]


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def pooled(request, engine_pool):
    """``(llm, model_dir)``: the pooled engine for this test's ``vllm_engine`` key."""
    return engine_pool.get(engine_key(request.node))


@pytest.fixture(autouse=True)
def _no_idle_pooled_engine(request, engine_pool):
    """A test that starts engines of its own runs with no pooled engine alive (memory, and CPU cores its workers
    are bound to)."""
    if engine_key(request.node) is None:
        engine_pool.close()
