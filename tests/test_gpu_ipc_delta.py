"""Deltas over CUDA IPC on GPUs (skipped without CUDA): trainer on cuda:0 and engine on cuda:1 (2 GPUs) refit over
versions with 0%, 0.1%, 1%, 30% and 100% of the elements changed, each refit bit for bit against the trainer's
tensors, under ``delta="auto"`` and forced words, the receiver's scatter reading the staging in place (on the
source's GPU) or a landing copy (``REFIT_IPC_DELTA_READ``); a receiver that lost its base (``invalidate``) gets
dense; sources on both GPUs into receivers on both (same-GPU pulls beside peer deltas, strided pieces dense); on one
GPU the rule sends every message dense (asserted from ``DeltaStats``). The CPU side (header, rule per link, config)
is tests/test_ipc_delta.py."""

import os

import pytest
import torch

from refit.config import TransferConfig
from refit.layout import box_slices
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.launch import run_local
from refit.transfer import Peer
from refit.transport.ipc_delta import NOT_ADDRESSED, OTHER_BASE, SAME_DEVICE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

# large enough that the rule's best case pays over NVLink (under "auto"); a norm too small to (dense), and a
# row-parallel weight whose tp=2 pieces are strided on an fsdp source (dense: the word kernels do not address them)
# (64 MiB each: at 1% changed the rule's words beat dense by ~13% with the pair's fixed cost, ``rule.IPC_PAIR_S``)
SHAPES = [(f"model.layers.{i}.mlp.up_proj.weight", (8192, 4096), torch.bfloat16) for i in range(8)]
SHAPES += [("model.layers.0.mlp.down_proj.weight", (4096, 8192), torch.bfloat16)]
SHAPES += [("model.layers.0.input_layernorm.weight", (4096,), torch.bfloat16)]
FRACTIONS = (0.0, 0.001, 0.01, 0.3, 1.0)


def _step(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Every element's last mantissa bit flips with probability ``fraction`` (the same on every process)."""
    for i, t in enumerate(tensors.values()):
        gen = torch.Generator(device=t.device).manual_seed(seed * 1000 + i)
        flat = t.view(-1).view(torch.int16)
        flat ^= (torch.rand(flat.shape, device=t.device, generator=gen) < fraction).to(torch.int16)


def _worker(world, src, dst, n_src, devices, mode, fractions, invalidate_at):
    """Every process holds the whole model (same seeds, same steps); a source refits its shard of it, a receiver
    checks its shard bit for bit after every refit. Returns per refit this process's delta statistics."""
    dev = world.device
    src_l = layout_from_spec(SHAPES, parse_spec(src, "src"))
    dst_l = layout_from_spec(SHAPES, parse_spec(dst, "dst"))
    procs = ProcessMap(tuple(range(n_src)), tuple(range(n_src, len(devices))), tuple(devices))
    gen = torch.Generator(device=dev).manual_seed(7)
    full = {n: torch.randn(s, device=dev, generator=gen).to(d) for n, s, d in SHAPES}
    is_src = world.rank < n_src
    layout, rank = (src_l, world.rank) if is_src else (dst_l, world.rank - n_src)
    boxes = {t.name: box_slices(b) for t, b in layout.local_tensors(rank)}
    mine = {n: full[n][sl].clone() if is_src else torch.zeros_like(full[n][sl]) for n, sl in boxes.items()}
    kw = {"src_tensors": mine} if is_src else {"dst_tensors": mine}
    cfg = TransferConfig(transport="ipc", delta=mode, name=f"ipcd-{mode}", deadline_s=120)
    peer = Peer(src_l, dst_l, world.rank, procs=procs, config=cfg, device=dev, **kw)
    out = []
    for version, fraction in enumerate((None, *fractions), start=1):
        if fraction is not None:
            _step(full, fraction, seed=version)
            if is_src:
                for n, sl in boxes.items():
                    mine[n].copy_(full[n][sl])
        if version == invalidate_at and not is_src:  # the engine reloaded its weights: no base any more
            for t in mine.values():
                t.zero_()
            peer.invalidate()
        torch.cuda.synchronize(dev)
        torch.distributed.barrier()
        d = peer.run(version).delta
        exact = is_src or all(_same(mine[n], full[n][sl]) for n, sl in boxes.items())
        out.append({"version": version, "fraction": fraction, "exact": exact, "words": d.encodings["words"],
                    "dense": d.encodings["dense"], "why": dict(d.dense_why), "wire": d.wire_bytes,
                    "dense_bytes": d.dense_bytes, "received": d.received_bytes, "diffed": d.diffed})  # fmt: skip
    peer.close()
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (bf16 as int16)."""
    return torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16))


def _run(src, dst, devices, mode, fractions=FRACTIONS, invalidate_at=None):
    """``_worker`` on a process per device of ``devices``: the sources first (one per rank of ``src``)."""
    n_src = 2 if src == "fsdp=2" else 1
    args = (src, dst, n_src, devices, mode, fractions, invalidate_at)
    return run_local(_worker, n_src, len(devices) - n_src, *args, devices=list(devices), timeout_s=280)


@TWO_GPUS
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,read", [("auto", "land"), ("words", "land"), ("words", "peer")])
def test_ipc_deltas_trainer_cuda0_engine_cuda1_exact_over_every_fraction(mode, read, monkeypatch):
    monkeypatch.setenv("REFIT_IPC_DELTA_READ", read)
    sent, got = _run("tp=1", "tp=1", ["cuda:0", "cuda:1"], mode)
    assert all(r["exact"] for r in got), [(r["version"], r["exact"]) for r in got]
    assert sent[0]["words"] == 0 and sent[0]["diffed"] == 0  # version 1: no base yet, every message dense
    large = 9  # the up and down projections: the rule's best case pays for each
    for r in sent[1:4]:  # 0%, 0.1%, 1% changed: the large pieces as words (forced words: the norm too)
        assert r["words"] == (large + 1 if mode == "words" else large), r
        assert r["wire"] < 0.1 * r["dense_bytes"], r
    assert sent[1]["wire"] < sent[2]["wire"] < sent[3]["wire"]  # more changed, more staged
    for r in sent[4:]:  # 30% (76% of the words: over the find's slots) and 100% changed: dense
        assert r["words"] == 0, r
    assert got[2]["received"] < 0.05 * sent[2]["dense_bytes"]  # the receiver read only the changes at 0.1%
    if mode == "auto":
        assert sent[5]["diffed"] == 0  # after the rule sent 30% dense, 100% is not even diffed


@TWO_GPUS
@pytest.mark.timeout(300)
@pytest.mark.parametrize("read", ["peer", "land"])
def test_ipc_delta_receiver_that_lost_its_base_gets_dense_then_deltas_again(read, monkeypatch):
    monkeypatch.setenv("REFIT_IPC_DELTA_READ", read)
    sent, got = _run("tp=1", "tp=1", ["cuda:0", "cuda:1"], "words", (0.001, 0.001, 0.001), invalidate_at=3)
    assert all(r["exact"] for r in got), [(r["version"], r["exact"]) for r in got]
    assert got[1]["why"] == {} and got[1]["received"] < 0.05 * sent[1]["dense_bytes"]  # version 2: deltas
    assert got[2]["why"] == {OTHER_BASE: 10}  # version 3: it holds none; copied dense, zeroed tensors and all
    assert got[2]["received"] >= sent[2]["dense_bytes"]
    assert got[3]["why"] == {} and got[3]["received"] < 0.05 * sent[3]["dense_bytes"]  # version 4: deltas again
    assert all(r["words"] == 10 for r in sent[1:])  # the source does not wait to hear: it staged every time


@TWO_GPUS
@pytest.mark.timeout(300)
@pytest.mark.parametrize("read", ["peer", "land"])
def test_ipc_deltas_fsdp2_to_tp2_on_two_gpus_beside_same_gpu_pulls(read, monkeypatch):
    """Sources on cuda:0 and cuda:1 into receivers on cuda:1 and cuda:0: each receiver pulls one source on its GPU
    (dense) and one on the other (deltas where the pieces are contiguous: the up projections' row halves, the norm's;
    the down projection's tp pieces are strided rows of an fsdp shard: dense)."""
    monkeypatch.setenv("REFIT_IPC_DELTA_READ", read)
    out = _run("fsdp=2", "tp=2", ["cuda:0", "cuda:1", "cuda:1", "cuda:0"], "words")
    sources, receivers = out[:2], out[2:]
    assert all(r["exact"] for rows in receivers for r in rows)
    for rows in sources:
        r = rows[2]  # 0.1% changed
        assert r["words"] > 0 and r["why"].get(SAME_DEVICE, 0) > 0 and r["why"].get(NOT_ADDRESSED, 0) > 0, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["auto", "words"])
def test_ipc_deltas_on_one_gpu_stay_dense_by_the_rule(mode):
    sent, got = _run("tp=1", "tp=1", ["cuda:0", "cuda:0"], mode)
    assert all(r["exact"] for r in got)
    for r in sent:
        assert r["words"] == 0 and r["diffed"] == 0 and r["why"] == {SAME_DEVICE: len(SHAPES)}, r
        assert r["wire"] == r["dense_bytes"]
