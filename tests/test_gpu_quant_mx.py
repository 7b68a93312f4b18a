"""MXFP8 / NVFP4 on CUDA: the Triton kernels (``refit.quant.mx_triton``) write the bytes of the torch path on
the CPU, on odd shapes and awkward values, and a quantizer on the GPU sends what the CPU one does (skipped on
CPU). One command on a GPU machine: ``python -m pytest -q -m gpu tests/test_gpu_quant_mx.py``."""

import pytest
import torch

from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.quant.mx import quantize_mxfp8, quantize_nvfp4
from refit.quant.mx_layout import MXFP8, NVFP4, mx_layout
from refit.quant.mx_quantizer import MxQuantizer, shared_scale_2
from refit.tools.verify import reference_shards
from test_quant_mx import awkward, nvfp4_adversarial

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(params=["blocks", "pairs", "pairs-1row", "pairs-quotient"])
def nvfp4_kernel(request, monkeypatch):
    """Each NVFP4 kernel the quantizer can launch (``mx_triton.NVFP4_KERNEL``; "pairs" takes the bf16 weights):
    the pairs kernel as ``PAIRS`` has it (the code from bounds on sm_90), with one row a program (where every
    tile's rows share a weight scale, so the per-row weight scales take the bounds too) and with the quotient."""
    from refit.quant import mx_triton, nvfp4_triton

    kernel, _, shape = request.param.partition("-")
    monkeypatch.setattr(mx_triton, "NVFP4_KERNEL", kernel)
    if shape == "1row":
        monkeypatch.setitem(nvfp4_triton.PAIRS, "br", 1)
    if shape == "quotient":
        monkeypatch.setitem(nvfp4_triton.PAIRS, "bounds", False)
    return request.param


@pytest.mark.parametrize("shape", [(37, 96), (5, 50), (3, 2, 7, 48), (4096, 4096), (8, 2, 768, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_write_the_bytes_of_the_cpu_path(shape, dtype, nvfp4_kernel):
    from refit.quant import mx_triton
    from refit.quant.mx_quantizer import quantize_into, use_triton

    assert mx_triton.AVAILABLE
    x = awkward(shape, sum(shape)).to(dtype)
    xc = x.cuda()
    assert use_triton(xc)
    q, s = quantize_mxfp8(x)
    gq, gs = torch.empty_like(q, device="cuda"), torch.empty_like(s, device="cuda")
    quantize_into(xc, gq, gs, MXFP8)
    assert torch.equal(gq.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(gs.cpu(), s)
    s2 = shared_scale_2({"w": x.float().abs().amax(dim=(-2, -1))})["w"]
    p, b = quantize_nvfp4(x, s2)
    gp, gb = torch.empty_like(p, device="cuda"), torch.empty_like(b, device="cuda")
    quantize_into(xc, gp, gb, NVFP4, s2.cuda())
    assert torch.equal(gp.cpu(), p) and torch.equal(gb.cpu().view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_kernel_writes_the_cpu_bytes_at_every_rounding_boundary(dtype, nvfp4_kernel):
    """Each NVFP4 kernel's codes (``div_rn`` or a block's reciprocal; comparisons or one addition) on 4.2 million
    adversarial values (``nvfp4_adversarial``: elements within 3 float32 steps of every threshold and exact bound times
    their block's divisor, divisors whose bounds fall within 2**-40 of a float32, weight scales from 1e-12 / 2688
    to float32's largest, zeros, subnormals, infinities) equal the CPU path's divided ones byte for byte."""
    from refit.quant.mx_quantizer import quantize_into

    x, s2 = nvfp4_adversarial(8192, 32, 11)
    w = x.to(dtype).unsqueeze(1)  # [rows, 1, K]: one weight scale a row
    p, b = quantize_nvfp4(w, s2)
    gp, gb = torch.empty_like(p, device="cuda"), torch.empty_like(b, device="cuda")
    quantize_into(w.cuda(), gp, gb, NVFP4, s2.cuda())
    bad = (gp.cpu() != p).nonzero()
    assert not len(bad), [(w[i, 0, 2 * j : 2 * j + 2].tolist(), s2[i].item()) for i, _, j in bad[:4].tolist()]
    assert torch.equal(gb.cpu().view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"br": 1},
        {"br": 1, "halves": False},
        {"br": 4},
        {"br": 16},
        {"nb": 64},
        {"num_warps": 8},
        {"bounds": False},
        {"bounds": False, "br": 1, "nb": 128},
        {"bounds": False, "br": 16},
        {"bounds": False, "halves": False},
        {"bounds": False, "add_code": 0},
        {"bounds": False, "br": 1},
        {"exact_div": True},
    ],
    ids=str,
)
def test_every_pairs_kernel_shape_writes_the_cpu_bytes(shape):
    """Each shape ``bench.nvfp4_kernels`` times, on its checks (bf16: exact ties at every threshold, one bf16
    step either side, zeros, subnormal, huge and infinite elements, weight scales from the floor to near
    float32's largest, so both quotient paths, per-row and per-tile weight scales, K 4100 / 4104 / 50, strided
    and offset views, a misaligned view through the fallback, the tests' ``nvfp4_adversarial``): the CPU path's
    bytes, elements and block scales."""
    from bench.nvfp4_kernels import _pairs, cases, check

    bad = {case[0]: check(_pairs(shape), case) for case in cases(torch.Generator().manual_seed(5))}
    assert not any(bad.values()), bad


@pytest.mark.parametrize("fmt", [MXFP8, NVFP4])
def test_a_quantizer_on_the_gpu_sends_what_the_cpu_one_does(fmt, nvfp4_kernel):
    """Four refits with the weights changed in place between them: eager, captured into CUDA graphs and replayed
    (``StepGraphs``), NVFP4's last with the trainer's amax (``set_amax``); each the CPU quantizer's bytes (with each
    NVFP4 kernel)."""
    plain = layout_from_spec(param_shapes("tiny-qwen3-moe"), parse_spec("tp=1", "src"))
    qlay = mx_layout(plain, fmt)
    live = reference_shards(plain, 0)
    dev = {k: v.cuda() for k, v in live.items()}
    cpu, gpu = MxQuantizer(qlay, 0, live, fmt), MxQuantizer(qlay, 0, dev, fmt)
    for step in range(4):
        for k in live:
            live[k].mul_(1.5 if step % 2 else -0.75)
            dev[k].copy_(live[k])
        if step == 3 and fmt.global_scale:
            gpu.set_amax(gpu.read_amax())
        cpu()
        gpu()
        for name, t in cpu.tensors.items():
            got = gpu.tensors[name].cpu()
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (step, name)
    assert gpu.graphs.graphs or not gpu.graphs.on  # replayed from CUDA graphs


def _mx_s2_worker(world, fmt_name: str) -> tuple[list[bool], int, int]:
    """S2 (trainer and engine on GPU 0) into an MXFP8 / NVFP4 engine of tiny-qwen3-moe, two versions: whether the
    engine held the whole tensors' quantization after each, the weights the trainer left to its engine's pull
    and the quantize kernels the engine's pull graph holds."""
    from refit.config import TransferConfig
    from refit.layout.tensors import box_slices
    from refit.plan import ProcessMap
    from refit.quant.mx_layout import FORMATS
    from refit.quant.mx_quantizer import expected_mx_shards
    from refit.tools.verify import reference_tensor
    from refit.transfer import Peer

    fmt, dev = FORMATS[fmt_name], world.device
    plain = layout_from_spec(param_shapes("tiny-qwen3-moe"), parse_spec("tp=1", "src"))
    src_l, dst_l = mx_layout(plain, fmt), mx_layout(plain, fmt, side="destination")
    live = dst = quantizer = None
    if world.rank == 0:
        live = {t.name: reference_tensor(t.name, t.shape, t.dtype, seed=1).to(dev) for t in plain}
        quantizer = MxQuantizer(src_l, 0, live, fmt)
    else:
        dst = {t.name: torch.zeros(t.shape, dtype=t.dtype, device=dev) for t in dst_l}
    peer = Peer(
        src_l,
        dst_l,
        world.rank,
        src_tensors=quantizer.tensors if quantizer else None,
        dst_tensors=dst,
        procs=ProcessMap((0,), (1,), ("cuda:0", "cuda:0")),
        config=TransferConfig(transport="ipc", name=f"mxpull-{fmt_name}"),
        device=dev,
        prepare=quantizer,
    )
    ok = []
    for v in (1, 2):
        if live is not None:
            for t in plain:
                live[t.name].copy_(reference_tensor(t.name, t.shape, t.dtype, seed=v))
        torch.cuda.synchronize(dev)
        torch.distributed.barrier()
        peer.run(v)
        if dst is not None:
            full = {t.name: reference_tensor(t.name, t.shape, t.dtype, seed=v) for t in plain}
            want = expected_mx_shards(full, dst_l, 0, fmt)
            ok.append(all(torch.equal(dst[n].cpu().reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
                          for n, w in want.items()))  # fmt: skip
            ok[-1] &= all(torch.equal(dst[t.name].cpu(), full[t.name][box_slices(b)]) for t, b in plain.local_tensors(0)
                          if t.name not in want and t.name in dst)  # fmt: skip
    ipc = peer.executor.ipc
    kernels = sum(
        1 for pl in ipc.pullers if pl is not None for _, _, copies in pl.lanes for c in copies if c[0] == "quantize"
    )
    skipped = len(ipc.skipped)
    peer.close()
    return ok, skipped, kernels


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_colocated_engine_quantizes_on_its_pull(fmt):
    """S2: an MXFP8 / NVFP4 engine quantizes the trainer's bf16 weights into its own weights and scales in its pull
    (the trainer leaves every one of them to it; NVFP4's kernels read the global scales the trainer agreed on
    before the pull), the bytes of the whole tensors quantized on the CPU, two versions."""
    from refit.quant.mx_layout import FORMATS, mx_names
    from refit.tools.launch import run_local

    out = run_local(_mx_s2_worker, 1, 1, fmt, devices=["cuda:0"] * 2, timeout_s=240)
    n = len(
        mx_names(
            mx_layout(layout_from_spec(param_shapes("tiny-qwen3-moe"), parse_spec("tp=1", "src")), FORMATS[fmt]),
            FORMATS[fmt],
        )
    )
    assert out[1][0] == [True, True], out
    assert (out[0][1], out[1][2]) == (n, n), out
