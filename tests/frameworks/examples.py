"""The examples that tests/frameworks run, loaded from ``examples/`` by path (once per process): the tests check
what the examples compute, so each example runs under test as a user runs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (registered as ``refit_example_<name>``)."""
    key = f"refit_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        if spec is None or spec.loader is None:
            raise FileNotFoundError(f"no example {name!r} in {EXAMPLES}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
