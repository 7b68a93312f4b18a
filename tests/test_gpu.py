"""GPU correctness of the IPC and NCCL paths (skipped on CPU).

Tests that fit on one GPU (colocated IPC pulls, checksums, CUDA graphs, FP8 kernels and staged pulls,
fan-out) run there with every process on cuda:0; peer pulls across GPUs and NCCL need 2 GPUs.
"""

import os

import pytest
import torch

from refit.config import TransferConfig
from refit.layout import box_slices
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.launch import run_local
from refit.tools.verify import reference_tensor
from refit.transfer import Peer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _two_gpus_or_one() -> list[str]:
    """Four processes over the GPUs there are: alternating over 2, or all on one."""
    return ["cuda:0", "cuda:1", "cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cuda:0"] * 4


os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _layouts(model, src, dst, dtype):
    shapes = [(n, s, dtype) for n, s, _ in param_shapes(model)]
    return layout_from_spec(shapes, parse_spec(src, "src")), layout_from_spec(shapes, parse_spec(dst, "dst"))


def _worker(world, src_l, dst_l, procs, transport, use_data_group, graph=True, checksums=False, pull_gbps=None):
    dev = world.device
    srank = procs.src.index(world.rank) if world.rank in procs.src else None
    drank = procs.dst.index(world.rank) if world.rank in procs.dst else None
    src = (
        {
            t.name: reference_tensor(t.name, t.shape, t.dtype, seed=1)[box_slices(b)].clone().to(dev)
            for t, b in src_l.local_tensors(srank)
        }
        if srank is not None
        else None
    )
    dst = (
        {
            t.name: torch.full(tuple(y - x for x, y in b), float("nan"), dtype=t.dtype, device=dev)
            for t, b in dst_l.local_tensors(drank)
        }
        if drank is not None
        else None
    )
    cfg = TransferConfig(
        num_buffers=2,
        buffer_bytes=64 << 10,
        transport=transport,
        cuda_graph=graph,
        checksums=checksums,
        pull_gbps=pull_gbps,
    )
    peer = Peer(
        src_l,
        dst_l,
        world.rank,
        src_tensors=src,
        dst_tensors=dst,
        procs=procs,
        group=world.data_group if use_data_group else None,
        config=cfg,
        device=dev,
    )
    ok = []
    for v in (1, 2, 3):
        if src is not None:  # new weights each version, changed in place
            for t, b in src_l.local_tensors(srank):
                src[t.name].copy_(reference_tensor(t.name, t.shape, t.dtype, seed=v)[box_slices(b)])
        torch.cuda.synchronize(dev)
        torch.distributed.barrier()
        peer.run(v)
        if dst is not None:
            ok.append(
                all(
                    torch.equal(
                        dst[t.name].cpu().view(torch.uint8),
                        reference_tensor(t.name, t.shape, t.dtype, seed=v)[box_slices(b)].view(torch.uint8),
                    )
                    for t, b in dst_l.local_tensors(drank)
                )
            )
    kinds = sorted({m.transport for m in peer.plan.messages})
    puller = peer.executor.puller
    # every copy the puller issues is recorded in its graph (with checksums on one GPU the checksum
    # kernel copies every piece itself: nothing is left to record)
    in_graph = puller is not None and (puller.graph is not None or not puller.lanes)
    staging = peer.executor.staging_bytes
    paced = (puller.paced_s, peer.executor.bytes_received) if puller is not None else None
    peer.close()  # every process (collective for all-IPC plans): no mapping outlives its producer
    return ok, kinds, staging, in_graph, paced


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "dtype,graph,checksums",
    [
        (torch.bfloat16, True, False),
        (torch.float32, True, False),
        (torch.bfloat16, False, False),
        (torch.bfloat16, True, True),
    ],
)
def test_ipc_colocated_reshard_fsdp2_to_tp2(dtype, graph, checksums):
    src_l, dst_l = _layouts("tiny-qwen2", "fsdp=2", "tp=2", dtype)
    devices = _two_gpus_or_one()
    procs = ProcessMap.disjoint(2, 2).with_devices(devices)
    out = run_local(_worker, 2, 2, src_l, dst_l, procs, "ipc", False, graph, checksums, devices=devices, timeout_s=240)
    for ok, kinds, staging, used_graph, _ in out[2:]:
        assert ok == [True, True, True]
        assert kinds == ["ipc"] and staging == 0
        assert used_graph == graph


@pytest.mark.timeout(300)
def test_ipc_paced_pull_is_exact_and_sleeps_for_its_bytes_at_the_pace():
    """``pull_gbps``: each copy is followed by a sleep on its stream, recorded in the graph; the recorded sleep
    cycles add up to the pulled bytes at the pace (the pull's time is not asserted: wall-clock)."""
    src_l, dst_l = _layouts("tiny-qwen2", "fsdp=2", "tp=2", torch.bfloat16)
    devices = _two_gpus_or_one()
    procs = ProcessMap.disjoint(2, 2).with_devices(devices)
    out = run_local(_worker, 2, 2, src_l, dst_l, procs, "ipc", False, True, False, 5.0, devices=devices, timeout_s=240)
    for ok, kinds, _, used_graph, (paced_s, received) in out[2:]:
        assert ok == [True, True, True] and kinds == ["ipc"] and used_graph
        assert received > 0 and paced_s == pytest.approx(received / 5e9, rel=1e-3), (paced_s, received)


@pytest.mark.timeout(300)
@TWO_GPUS
def test_ipc_peer_pull_1_to_1():
    src_l, dst_l = _layouts("tiny-llama", "tp=1", "tp=1", torch.bfloat16)
    devices = ["cuda:0", "cuda:1"]
    procs = ProcessMap.disjoint(1, 1).with_devices(devices)
    out = run_local(_worker, 1, 1, src_l, dst_l, procs, "auto", False, devices=devices, timeout_s=240)
    assert out[1][0] == [True, True, True] and out[1][1] == ["ipc"]
    assert out[1][3] is True  # the pull replays a CUDA graph


@pytest.mark.timeout(300)
@TWO_GPUS
@pytest.mark.parametrize(
    "src,dst,checksums", [("fsdp=2", "tp=2", False), ("tp=2", "dp=2", False), ("fsdp=2", "tp=2", True)]
)
def test_nccl_pipelined_with_packing(src, dst, checksums):
    # processes are both trainer and engine ranks (one per GPU): cross-GPU pieces go over NCCL,
    # through small staging buffers; same-process pieces are local copies
    src_l, dst_l = _layouts("tiny-qwen2", src, dst, torch.bfloat16)
    procs = ProcessMap.colocated(2, 2).with_devices(["cuda:0", "cuda:1"])
    out = run_local(
        _worker, 2, 2, src_l, dst_l, procs, "p2p", True, True, checksums, colocated=True, backend="nccl", timeout_s=240
    )
    for ok, kinds, staging, _, _ in out:
        assert ok == [True, True, True]
        assert kinds == ["p2p"]
        assert staging <= 2 * (64 << 10)


@pytest.mark.parametrize(
    "shape,block,dtype",
    [
        ((3, 2, 384, 2048), (128, 128), torch.bfloat16),
        ((200, 130), (128, 128), torch.bfloat16),
        ((5, 96, 80), (32, 16), torch.float32),
    ],
)
def test_triton_fp8_quantizer_bytes_equal_the_torch_expression(shape, block, dtype):
    from refit.quant import AMAX_FLOOR, FP8_MAX, fp8_triton, quantize_fp8_block
    from refit.quant.fp8_triton import quantize_into_triton

    if not fp8_triton.AVAILABLE:
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(11)
    w = (torch.randn(shape, generator=g, device="cuda") * torch.logspace(-4, 2, shape[-1], device="cuda")).to(dtype)
    w[..., :3, :5] = 0  # the amax floor
    q_ref, s_ref = quantize_fp8_block(w, block)  # the multi-pass torch expression (tested against numpy on CPU)
    q, s = torch.empty_like(q_ref), torch.empty_like(s_ref)
    quantize_into_triton(w, q, s, block, FP8_MAX, AMAX_FLOOR)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _fp8_staged_worker(world, stages, src="fsdp=2", dst="tp=2", n=2):
    from refit.quant import Fp8Quantizer, fp8_layout, quantize_fp8_block, quantized_names, scale_name

    dev = world.device
    plain_src, plain_dst = _layouts("qwen3-30b-a3b", src, dst, torch.bfloat16)

    def keep(lay):  # layer 0 and the tensors outside the layers
        return type(lay)(tuple(t for t in lay if ".layers." not in t.name or ".layers.0." in t.name), lay.world_size)

    plain_src, plain_dst = keep(plain_src), keep(plain_dst)
    src_l, dst_l = fp8_layout(plain_src), fp8_layout(plain_dst, side="destination")
    devices = _two_gpus_or_one() if n == 2 else ["cuda:0"] * 2
    procs = ProcessMap.disjoint(n, n).with_devices(devices)
    srank = world.rank if world.rank < n else None
    drank = world.rank - n if world.rank >= n else None
    quantizer = live = dst = None
    if srank is not None:
        live = {
            t.name: reference_tensor(t.name, t.shape, t.dtype, seed=1)[box_slices(b)].clone().to(dev)
            for t, b in plain_src.local_tensors(srank)
        }
        quantizer = Fp8Quantizer(src_l, srank, live)
    else:
        dst = {
            t.name: torch.zeros(tuple(y - x for x, y in b), dtype=t.dtype, device=dev)
            for t, b in dst_l.local_tensors(drank)
        }
    cfg = TransferConfig(transport="ipc", stages=stages, name=f"fp8s{stages}")
    peer = Peer(
        src_l,
        dst_l,
        world.rank,
        src_tensors=quantizer.tensors if quantizer else None,
        dst_tensors=dst,
        procs=procs,
        config=cfg,
        device=dev,
        prepare=quantizer,
    )
    ok = []
    for v in (1, 2):
        if live is not None:
            for t, b in plain_src.local_tensors(srank):
                live[t.name].copy_(reference_tensor(t.name, t.shape, t.dtype, seed=v)[box_slices(b)])
        torch.cuda.synchronize(dev)
        torch.distributed.barrier()
        peer.run(v)
        if dst is not None:
            boxes = {t.name: b for t, b in dst_l.local_tensors(drank)}
            good = True
            for name in quantized_names(dst_l):
                p = plain_src[name]
                q, s = quantize_fp8_block(reference_tensor(p.name, p.shape, p.dtype, seed=v).to(dev))
                good &= torch.equal(dst[name].view(torch.uint8), q[box_slices(boxes[name])].view(torch.uint8))
                good &= torch.equal(dst[scale_name(name)], s[box_slices(boxes[scale_name(name)])])
            ok.append(bool(good))
    stages = len(peer.executor.stage_names)
    ipc = peer.executor.ipc
    on_pull = len(ipc.skipped) + sum(
        1 for pl in ipc.pullers if pl is not None for _, _, copies in pl.lanes for c in copies if c[0] == "quantize"
    )
    peer.close()  # every process (collective: all-IPC plan)
    return ok, stages, on_pull


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stages", [1, 3])
def test_fp8_quantized_by_the_trainer_over_ipc_in_stages(stages):
    devices = _two_gpus_or_one()
    out = run_local(_fp8_staged_worker, 2, 2, stages, devices=devices, timeout_s=240)
    assert all(o[:2] == ([True, True], stages) for o in out[2:]), out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("on_pull", ["1", "0"])
def test_fp8_colocated_engine_quantizes_on_its_pull(on_pull, monkeypatch):
    """S2 with an FP8 engine: the engine quantizes the trainer's bf16 weights into its own FP8 weights and
    scales in its pull (every quantized weight: none left to the trainer), bytes equal to quantizing the
    whole tensor; with REFIT_FP8_ON_PULL=0 the trainer quantizes and the engine copies, the same bytes."""
    from refit.quant import fp8_layout, quantized_names

    monkeypatch.setenv("REFIT_FP8_ON_PULL", on_pull)
    out = run_local(_fp8_staged_worker, 1, 1, 1, "tp=1", "tp=1", 1, devices=["cuda:0"] * 2, timeout_s=240)
    src_l, _ = _layouts("qwen3-30b-a3b", "tp=1", "tp=1", torch.bfloat16)
    keep = tuple(t for t in src_l if ".layers." not in t.name or ".layers.0." in t.name)
    n = len(quantized_names(fp8_layout(type(src_l)(keep, src_l.world_size))))
    want = n if on_pull == "1" else 0
    assert out[1][:2] == ([True, True], 1), out
    assert (out[0][2], out[1][2]) == (want, want), out  # the trainer skipped them, the engine quantizes them


def _fanout_worker(world, devices):
    from refit.fanout import Fanout

    src_l, replica = _layouts("tiny-llama", "tp=1", "tp=1", torch.bfloat16)
    dev = world.device
    n = world.world_size - 1
    if world.rank == 0:
        tensors = {t.name: reference_tensor(t.name, t.shape, t.dtype, seed=1).to(dev) for t in src_l}
    else:
        tensors = {t.name: torch.full(t.shape, float("nan"), dtype=t.dtype, device=dev) for t in replica}
    cfg = TransferConfig(name="gpufan", transport="auto", deadline_s=60.0)
    f = Fanout(
        src_l, replica, world.rank, [0], [[1 + j] for j in range(n)], tensors, config=cfg, devices=devices, device=dev
    )
    ok, kinds = [], set()
    for v in (1, 2):
        if world.rank == 0 and v > 1:
            for t in src_l:
                tensors[t.name].copy_(reference_tensor(t.name, t.shape, t.dtype, seed=v))
            torch.cuda.synchronize(dev)
        stats = f.run(v)
        torch.cuda.synchronize(dev)
        if world.rank > 0:
            ok.append(
                all(
                    torch.equal(
                        tensors[t.name].cpu().view(torch.uint8),
                        reference_tensor(t.name, t.shape, t.dtype, seed=v).view(torch.uint8),
                    )
                    for t in replica
                )
            )
        kinds |= {m.transport for _, peer in f.peers.values() for m in peer.plan.messages}
    pulled_from = sorted(
        {
            peer.plan.procs.src[m.src]
            for _, peer in f.peers.values()
            for m in peer.plan.messages
            if peer.plan.procs.dst[m.dst] == world.rank
        }
    )
    f.close()  # every process: each wave's Peers (collective per wave)
    return ok, sorted(kinds), stats.waves, pulled_from


@pytest.mark.timeout(300)
def test_fanout_over_ipc_one_trainer_to_three_replicas():
    # trainer on GPU0, replicas on GPU1, GPU0, GPU1 (or all on one GPU): wave 0 -> replica 0, wave 1 ->
    # replicas 1 and 2 (replica 2 pulls from replica 0, which committed the version in wave 0)
    devices = _two_gpus_or_one()
    out = run_local(_fanout_worker, 1, 3, devices, devices=devices, timeout_s=240)
    for ok, kinds, _, _ in out[1:]:
        assert ok == [True, True]
        assert kinds == ["ipc"]
    assert out[0][2] == 2
    if len(set(devices)) == 2:
        # each receiver pulls from the holder on its own GPU: replica 1 from the trainer, replica 2 from replica 0
        assert out[1][3] == [0] and out[2][3] == [0] and out[3][3] == [1]


def _megatron_parts_worker(world, src_l, dst_l, procs, checksums, dims):
    """The source holds each layer's q/k/v as views into one interleaved ``linear_qkv`` (Megatron's
    storage: parts); the engines pull their TP shards over IPC. Two versions, changed in place."""
    from refit.layout.megatron import qkv_rows

    heads, groups, hd = dims
    dev = world.device
    if world.rank in procs.src:
        tensors, qkv = {}, {}
        for t, b in src_l.local_tensors(0):
            stem, _, what = t.name.rpartition(".self_attn.")
            if t.row_block is None:
                tensors[t.name] = reference_tensor(t.name, t.shape, t.dtype, seed=1)[box_slices(b)].clone().to(dev)
                continue
            w = what.split("_")[0]  # q, k or v
            rows = heads * hd + 2 * groups * hd
            buf = qkv.setdefault(stem, torch.zeros(rows, t.shape[1], dtype=t.dtype, device=dev))
            runs = qkv_rows(0, rows, heads, groups, hd)[w]
            tensors[t.name] = [buf[o : o + y - x] for x, y, o in runs]
            full = reference_tensor(t.name, t.shape, t.dtype, seed=1).to(dev)
            for (x, y, _), part in zip(runs, tensors[t.name]):
                part.copy_(full[x:y])
        kw = {"src_tensors": tensors}
    else:
        drank = procs.dst.index(world.rank)
        tensors = {
            t.name: torch.full(tuple(y - x for x, y in b), float("nan"), dtype=t.dtype, device=dev)
            for t, b in dst_l.local_tensors(drank)
        }
        kw = {"dst_tensors": tensors}
    cfg = TransferConfig(transport="ipc", checksums=checksums, deadline_s=60.0)
    peer = Peer(src_l, dst_l, world.rank, procs=procs, config=cfg, device=dev, **kw)
    ok = []
    for v in (1, 2):
        if v == 2 and world.rank in procs.src:  # an optimizer step in place: every bound part sees it
            for buf in qkv.values():
                buf.mul_(2)
            for t in tensors.values():
                if isinstance(t, torch.Tensor):
                    t.mul_(2)
        torch.cuda.synchronize(dev)
        peer.run(v)
        if world.rank in procs.dst:
            ok.append(
                all(
                    torch.equal(
                        tensors[t.name].cpu(),
                        reference_tensor(t.name, t.shape, t.dtype, seed=1)[box_slices(b)] * (2 if v == 2 else 1),
                    )
                    for t, b in dst_l.local_tensors(procs.dst.index(world.rank))
                )
            )
    parts = sum(1 for t in src_l if t.row_block is not None)
    peer.close()
    return ok, parts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checksums", [False, True])
def test_ipc_pulls_from_a_source_held_in_parts_megatron_qkv(checksums):
    # Megatron tp=1 (q/k/v as parts of one interleaved tensor per layer) -> engine tp=2, all on cuda:0
    from refit.layout.megatron import megatron_layout
    from refit.layout.models import load_config

    cfg = load_config("tiny-llama")
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes("tiny-llama")]
    src_l = megatron_layout(shapes, parse_spec("tp=1", "src"), cfg)
    dst_l = layout_from_spec(shapes, parse_spec("tp=2", "dst"))
    heads = cfg.num_attention_heads
    dims = (heads, cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    devices = ["cuda:0"] * 3
    procs = ProcessMap.disjoint(1, 2).with_devices(devices)
    out = run_local(_megatron_parts_worker, 1, 2, src_l, dst_l, procs, checksums, dims, devices=devices, timeout_s=240)
    assert out[0][1] >= 3  # q, k and v of every layer are held in parts
    for ok, _ in out[1:]:
        assert ok == [True, True]
