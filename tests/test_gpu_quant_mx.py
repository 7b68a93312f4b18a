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
from test_quant_mx import awkward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("shape", [(37, 96), (5, 50), (3, 2, 7, 48), (4096, 4096), (8, 2, 768, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_write_the_bytes_of_the_cpu_path(shape, dtype):
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


@pytest.mark.parametrize("fmt", [MXFP8, NVFP4])
def test_a_quantizer_on_the_gpu_sends_what_the_cpu_one_does(fmt):
    plain = layout_from_spec(param_shapes("tiny-qwen3-moe"), parse_spec("tp=1", "src"))
    qlay = mx_layout(plain, fmt)
    live = reference_shards(plain, 0)
    cpu = MxQuantizer(qlay, 0, live, fmt)
    gpu = MxQuantizer(qlay, 0, {k: v.cuda() for k, v in live.items()}, fmt)
    cpu()
    gpu()
    for name, t in cpu.tensors.items():
        got = gpu.tensors[name].cpu()
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
