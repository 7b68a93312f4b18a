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
    """Wait until every path exists; fail early (with what is missing) if a process of ``procs`` exited, naming
    it, its exit status and the end of its error output (where it was piped)."""
    end = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        dead = [(k, p) for k, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > end:
            missing = [p.name for p in paths if not p.exists()]
            why = "; ".join(f"process {k} exited with {p.returncode}: {_tail(p)}" for k, p in dead) or "timed out"
            pytest.fail(f"{missing} never appeared ({why})")
        time.sleep(0.05)


def _tail(p: subprocess.Popen, lines: int = 15) -> str:
    """The last ``lines`` of an exited process's piped error output ("" where it was not piped or is held open)."""
    if p.stderr is None:
        return ""
    try:
        _, err = p.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return "(its error output could not be read)"
    err = err.decode(errors="replace") if isinstance(err, bytes) else err or ""
    return "\n".join(err.strip().splitlines()[-lines:])
