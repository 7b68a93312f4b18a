"""``TransferJob``: refused arguments before anything listens, the layout shared through the signed store, and
the Peer's world checked against the job. The whole job (store, group, Peer, refits between separate worlds) runs
in tests/test_megatron_doc.py, through the Megatron-Core page's example."""

import math
import socket

import pytest
import torch
import torch.distributed as dist

from refit import layout_from_spec, parse_spec
from refit.errors import ConfigError
from refit.trainers.job import TransferJob
from refit.transport import auth
from refit.transport.control import free_port
from refit.transport.store import SignedStore

SHAPES = [("model.layers.0.mlp.down_proj.weight", (4, 6), torch.float32), ("model.norm.weight", (4,), torch.float32)]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(proc=0, n_src=0, n_dst=1), "n_src must be an integer >= 1, got 0"),
        (dict(proc=0, n_src=2, n_dst=True), "n_dst must be an integer >= 1, got True"),
        (dict(proc=3, n_src=2, n_dst=1), "proc must be in 0..2 (2 + 1 processes), got 3"),
        (dict(proc=0, n_src=1, n_dst=1, port=0), "port must be in 1..65535"),
        (dict(proc=0, n_src=1, n_dst=1, timeout_s=math.nan), "timeout_s must be a finite number"),
        (dict(proc=0, n_src=1, n_dst=1, timeout_s=0), "timeout_s must be > 0, got 0"),
    ],
)
def test_join_refuses_bad_arguments_naming_them(kwargs, words, monkeypatch):
    monkeypatch.setenv("REFIT_SECRET", auth.new_secret().decode())
    port = kwargs.pop("port", 1)  # never reached: the arguments are refused before anything listens
    with pytest.raises(ConfigError) as e:
        TransferJob.join("127.0.0.1", port, kwargs.pop("proc"), **kwargs)
    assert words in str(e.value)


def test_join_without_a_secret_is_refused_before_listening(monkeypatch):
    monkeypatch.delenv("REFIT_SECRET", raising=False)
    monkeypatch.delenv("REFIT_SECRET_FILE", raising=False)
    port = free_port()
    with pytest.raises(ConfigError, match="REFIT_SECRET"):
        TransferJob.join("127.0.0.1", port, 0, n_src=1, n_dst=1, timeout_s=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # still free: no store was opened


def _jobs(n_src: int, n_dst: int) -> list[TransferJob]:
    """One in-memory store seen by every process's job (no sockets); ``group`` unused by these tests."""
    store, secret = dist.HashStore(), auth.new_secret()
    return [TransferJob(p, n_src, n_dst, SignedStore(store, secret), None, 2.0) for p in range(n_src + n_dst)]


def test_share_layout_gives_every_process_the_owners_layout():
    src = layout_from_spec(SHAPES, parse_spec("tp=2", "src"))
    jobs = _jobs(2, 1)
    assert jobs[0].share_layout(src) is src
    for job in jobs[1:]:
        got = job.share_layout()
        assert got.to_json() == src.to_json()
        assert got["model.layers.0.mlp.down_proj.weight"].box(1) == ((0, 4), (3, 6))
    dst = layout_from_spec(SHAPES, parse_spec("tp=1", "dst"))
    assert jobs[2].share_layout(dst, owner=2) is dst  # an engine process may share too
    assert jobs[0].share_layout(owner=2).to_json() == dst.to_json()


def test_share_layout_ignores_a_value_without_the_jobs_tag():
    src = layout_from_spec(SHAPES, parse_spec("tp=2", "src"))
    jobs = _jobs(2, 1)
    forger = TransferJob(0, 2, 1, SignedStore(jobs[0].store.raw, auth.new_secret()), None, 2.0)  # another secret
    forger.share_layout(layout_from_spec(SHAPES, parse_spec("tp=1", "src")))
    with pytest.warns(UserWarning, match="without a valid job-secret tag"):
        with pytest.raises(TimeoutError, match="invalid tags"):
            jobs[1].share_layout()  # the forged value is not taken for the owner's
    jobs[0].share_layout(src)
    assert jobs[1].share_layout().to_json() == src.to_json()


def test_share_layout_refuses_an_owner_without_a_layout_or_outside_the_job():
    jobs = _jobs(1, 1)
    with pytest.raises(ConfigError, match="process 0 shares the layout; it passed NoneType"):
        jobs[0].share_layout()
    with pytest.raises(ConfigError, match="owner must be a process of the job, got 2"):
        jobs[1].share_layout(owner=2)


def test_peer_refuses_layouts_of_another_world():
    job = _jobs(2, 1)[0]
    src = layout_from_spec(SHAPES, parse_spec("tp=4", "src"))
    dst = layout_from_spec(SHAPES, parse_spec("tp=1", "dst"))
    with pytest.raises(ConfigError, match="2 trainer and 1 engine processes; the layouts have 4 source and 1"):
        job.peer(src, dst, src_tensors={})
