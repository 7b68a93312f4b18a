"""Every ```python block in README.md and docs/**/*.md runs as written, as a script on CPU.

A block runs as a script (``__main__``) in a fresh temp directory and must exit 0: in a process forked from
refit's launcher, whose server imported torch and refit once (a fresh interpreter per block would spend most of
its time importing them), or, for a block that imports vLLM (it starts an engine), from the vLLM tests' server
(``vllm_backend.engine_procs``), which its engine's processes fork from too; with this process's environment less
the job secret that conftest sets (a snippet sets up what it needs, as a new user would).
The line before a block (blank lines aside) may say why it does not run here:

* ``<!-- snippet: not run on CPU: REASON -->``: skipped, with REASON (which must not be empty) shown;
* ``<!-- snippet: run by tests/NAME.py -->``: that test runs the block (the file must exist).

Any other ``<!-- snippet: ... -->`` line is an error, and so is a ```py fence (it would escape this test).
Identical blocks (the README and a page sharing one example) run once.
"""

from __future__ import annotations

import atexit
import os
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from refit.tools.launch import start_process

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<body>.*?)\s*-->$")
NOT_RUN = re.compile(r"^not run on CPU:\s*(?P<reason>.*)$")
RUN_BY = re.compile(r"^run by (?P<path>tests/[\w/.-]+\.py)$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Snippet:
    """One fenced block: where it starts (file and 1-based line of the fence), its code and the marker above it."""

    path: Path
    line: int
    code: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _marker_before(lines: list[str], i: int) -> str | None:
    """The ``<!-- snippet: ... -->`` body on the nearest non-blank line before line ``i``, if it is one."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    m = MARKER.match(lines[j].strip()) if j >= 0 else None
    return m.group("body") if m else None


def python_blocks(path: Path) -> list[Snippet]:
    """The ```python blocks of one file (a fence's indentation is removed from its lines)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        start, lang, indent = i, m.group("lang"), len(m.group("indent"))
        i += 1
        body = []
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i][indent:])
            i += 1
        i += 1  # the closing fence
        if lang in ("py", "python3", "pycon"):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: use ```python (```{lang} is not run)")
        if lang == "python":
            out.append(Snippet(path, start + 1, "\n".join(body) + "\n", _marker_before(lines, start)))
    return out


def all_snippets() -> list[Snippet]:
    return [s for p in markdown_files() for s in python_blocks(p)]


def _runnable() -> list[pytest.param]:
    seen: dict[str, Snippet] = {}
    for s in all_snippets():
        if s.marker is None:
            seen.setdefault(s.code, s)
    return [pytest.param(s, id=s.where) for s in seen.values()]


def _skipped() -> list[pytest.param]:
    return [pytest.param(s, id=s.where) for s in all_snippets() if s.marker is not None]


def test_markdown_has_runnable_snippets():
    """The README's example runs, and the site has more than it (a parser that finds nothing fails here)."""
    readme = [s for s in python_blocks(ROOT / "README.md") if s.marker is None]
    assert readme, "README.md has no runnable ```python block"
    assert len(_runnable()) > len(readme), f"only {len(_runnable())} runnable blocks in README.md and docs/"


@pytest.mark.parametrize("snippet", _skipped())
def test_marker_is_valid(snippet: Snippet):
    """A block that does not run here says why (a non-empty reason), or names the test that runs it."""
    not_run, run_by = NOT_RUN.match(snippet.marker), RUN_BY.match(snippet.marker)
    if not_run:
        assert not_run.group("reason").strip(), f"{snippet.where}: 'not run on CPU' needs a reason"
    elif run_by:
        path = ROOT / run_by.group("path")
        assert path.is_file(), f"{snippet.where}: the marker names {run_by.group('path')}, which does not exist"
    else:
        raise AssertionError(f"{snippet.where}: unknown snippet marker {snippet.marker!r}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REFIT_SECRET", "REFIT_SECRET_FILE", "REFIT_JOB_ID")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("snippet", _runnable())
def test_snippet_runs(snippet: Snippet, tmp_path: Path):
    """Run the block as a script in a temp directory; it must exit 0 within the time limit."""
    script, log = tmp_path / "snippet.py", tmp_path / "output.txt"
    script.write_text(snippet.code)
    if "from vllm import" in snippet.code:  # it starts an engine: forked from a server that imported vLLM, its
        # engine's processes too (``engine_procs.start_script``), instead of importing vLLM in each
        from vllm_backend import engine_procs

        p = engine_procs.start_script(str(script), [], _env(), str(log), cwd=str(tmp_path))
    else:
        p = start_process(run_script, (str(script), _env(), str(log)))
    p.join(TIMEOUT_S)
    if p.is_alive():
        p.kill()
        p.join()
        raise AssertionError(f"{snippet.where}: still running after {TIMEOUT_S} s; output:\n{_tail(log)}")
    assert p.exitcode == 0, f"{snippet.where} exited with {p.exitcode}:\n{_tail(log)}"


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no output)"


def run_script(script: str, env: dict[str, str], log: str) -> None:
    """``python SCRIPT`` in this (forked) process: ``env`` as its environment, the script's directory as its
    working directory and ``sys.path[0]``, stdout and stderr into ``log``; run as ``__main__`` (processes it spawns
    import it by path, as from a script); the exit code is the script's, 1 on an exception; atexit handlers run."""
    os.environ.clear()
    os.environ.update(env)
    folder = os.path.dirname(script)
    os.chdir(folder)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)  # what a timed-out script printed is kept
    sys.argv, sys.path[0] = [script], folder
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
