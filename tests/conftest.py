import os
import secrets

import pytest
import torch
from hypothesis import settings

# processes that tests start by hand (not through refit's launcher, which makes its own) share one job secret
os.environ.setdefault("REFIT_SECRET", "refit-tests-" + secrets.token_hex(16))

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# Tests that share something one process owns run in one pytest-xdist worker, one after the other: the pooled vLLM
# engines (and the cores their workers are bound to), Ray's local cluster, the network namespaces of the cluster
# harness (one 198.18.0.0/15 range on this machine); every other file is a group of its own, so that a module's
# fixture (one spawned job whose results its tests read) runs once, not once per worker.
_XDIST_GROUPS = {"vllm_backend": "vllm", "sglang_backend": "sglang", "data": "ray", "cluster": "cluster"}
_FIRST = ["vllm_backend", "data"]


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        parts = item.nodeid.split("/")
        group = _XDIST_GROUPS.get(parts[1]) if len(parts) > 2 else None
        item.add_marker(pytest.mark.xdist_group(group or item.nodeid.split("::")[0]))
    # the longest groups first, so that neither worker starts one of them when the other is nearly done
    items.sort(key=lambda item: _FIRST.index(item.nodeid.split("/")[1]) if item.nodeid.split("/")[1] in _FIRST else 9)
