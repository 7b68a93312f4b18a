"""Helpers of the cluster tests."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from refit.tools.cluster import unavailable

STRANGER = Path(__file__).with_name("stranger.py")


def skip_without_namespaces() -> None:
    """Skip the calling test, naming why, where network namespaces cannot be made."""
    why = unavailable()
    if why:
        pytest.skip(f"cluster tests need network namespaces: {why}")


def wait_for(paths: list[Path], timeout_s: float, procs: list[subprocess.Popen]) -> None:
    """Wait until every path exists; fail early (with what is missing) if a process of ``procs`` exited."""
    end = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > end:
            missing = [p.name for p in paths if not p.exists()]
            pytest.fail(f"{missing} never appeared ({'a process exited' if dead else 'timed out'})")
        time.sleep(0.05)
