"""vLLM's engine and worker processes forked from a server that imported vLLM once, instead of spawned.

vLLM on CPU starts every engine core and every worker with ``spawn`` (``CpuPlatform`` forces it: libgomp is
not fork-safe once a process ran a parallel region), so each process imports torch and vLLM afresh: ~17 s of
CPU per process on the 2-core CI machine, 3-5 processes per engine, ~18 engines in the suite. ``use()`` hands
vLLM a ``forkserver`` context instead whose server imported vLLM's engine and worker modules (``PRELOAD``) and
never ran a parallel region, so a forked child is as safe as a spawned one and starts without the imports.

What a child sees is what ``spawn`` would have given it: the caller's ``sys.path`` and working directory
(multiprocessing's preparation data, as for spawn) and the caller's environment at the call (``_in_env``; a
forkserver's children would otherwise inherit the server's). A child starts its own vLLM processes (an engine
core's workers) through the same server. The server is this module's own, not the one ``refit.tools.launch`` forks
trainer ranks from, so refit's ranks never carry vLLM.

``start_script`` runs a script that starts engines of its own (an example, as a user runs it) as ``__main__`` in a
process forked from the server, and its engines' processes fork from the same server: in a fresh interpreter the
script and each of its engine's processes would import vLLM afresh.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing.context as mp_context
import os
import runpy
import sys
import types
from collections.abc import Callable
from multiprocessing import forkserver, popen_forkserver
from typing import Any

PRELOAD = [
    "torch",
    "vllm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    f"{__package__}.worker_ext",  # the tests' worker extension, by the name the tests import it under
]
"""What the server imports before it forks an engine core or worker (no parallel region runs in it)."""

# the modules that bound ``get_mp_context`` by name when they were imported
_USERS = ("vllm.v1.engine.utils", "vllm.v1.engine.coordinator", "vllm.v1.executor.multiproc_executor")

_SERVER = forkserver.ForkServer()
_SERVER.set_forkserver_preload(PRELOAD)


def _in_env(env: dict[str, str], target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``target`` with the environment the caller had when it started the process, the processes it starts
    for vLLM (an engine core's workers) forked from the server too."""
    os.environ.clear()
    os.environ.update(env)
    _share_server()
    use()
    return target(*args, **kwargs)


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver launch, through ``_SERVER``, the target wrapped in ``_in_env``."""

    def _launch(self, process_obj) -> None:
        process_obj._target = functools.partial(_in_env, dict(os.environ), process_obj._target)
        via = types.SimpleNamespace(
            connect_to_new_process=_SERVER.connect_to_new_process, read_signed=forkserver.read_signed
        )
        real, popen_forkserver.forkserver = popen_forkserver.forkserver, via
        try:
            super()._launch(process_obj)
        finally:
            popen_forkserver.forkserver = real


class _Process(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _Context(mp_context.ForkServerContext):
    Process = _Process


CONTEXT = _Context()


def _get_mp_context() -> _Context:
    return CONTEXT


def use() -> None:
    """From now on, vLLM engines started in this process fork their engine core and workers from ``_SERVER``."""
    import importlib

    for name in _USERS:
        importlib.import_module(name).get_mp_context = _get_mp_context


def start_script(
    script: str, argv: list[str], env: dict[str, str], out: str, err: str | None = None, cwd: str | None = None
) -> mp_context.BaseProcess:
    """A started process, forked from the server, that runs ``python SCRIPT ARGV...``: ``env`` as its environment,
    the script's directory first on ``sys.path``, ``cwd`` (if given) as its working directory, stdout into ``out`` and
    stderr into ``err`` (``out`` too if None); its exit code is the script's (1 on an exception)."""
    p = CONTEXT.Process(target=_run_script, args=(script, argv, env, out, err, cwd))
    p.start()
    return p


def _run_script(script: str, argv: list[str], env: dict[str, str], out: str, err: str | None, cwd: str | None):
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        if path is None:
            os.dup2(1, fd)
            continue
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout.reconfigure(line_buffering=True)  # what a script killed at its time limit printed is kept
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # the rest stays: its engine's processes import this module
    try:
        runpy.run_path(script, run_name="__main__")  # processes it spawns import it by path, as from a script
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child ends without them
        sys.stdout.flush()
        sys.stderr.flush()


def _share_server() -> None:
    """In a process forked from ``_SERVER``: start processes through that server too. multiprocessing leaves its
    children the server's address and the write end of its "alive" pipe (the server runs while a process holds
    one), in ``forkserver._forkserver``."""
    inherited = forkserver._forkserver
    _SERVER._forkserver_address = inherited._forkserver_address
    _SERVER._forkserver_alive_fd = inherited._forkserver_alive_fd
    _SERVER.ensure_running = lambda: None  # it runs: this process holds the pipe
