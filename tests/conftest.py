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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
