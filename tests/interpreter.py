"""Run a script of Triton kernel checks in Triton's interpreter (CPU tensors), for the tests of each kernel."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (TRITON_INTERPRET=1 on CPU)"
)


def assert_all_ok_in_interpreter(script: Path, timeout_s: int) -> None:
    """``script`` in a fresh interpreter (TRITON_INTERPRET must be set before triton is imported) exits 0
    and prints ALL OK."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ALL OK" in r.stdout
