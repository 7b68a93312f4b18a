"""MXFP8 and NVFP4 engines: trainer ranks quantize their own shards; every engine rank receives the bytes of
quantizing the whole tensor, in ModelOpt's names and shapes (``weight``, ``weight_scale``, ``weight_scale_2``).

The reference quantizers below are written from the formats' definitions (OCP MX v1.0: E4M3 elements, E8M0
scales; NVIDIA NVFP4: E2M1 elements, E4M3 block scales, FP32 global scale), decoding every code by its bit
fields and rounding to the nearest code in float64, not from refit's code."""

import json
import math

import pytest
import torch

from refit.layout import LayoutError
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.quant.mx import _E2M1_UP, AMAX_FLOOR, quantize_mxfp8, quantize_nvfp4
from refit.quant.mx_layout import MXFP8, NVFP4, block_scale_name, global_scale_name, mx_layout, mx_names
from refit.quant.mx_quantizer import MxQuantizer, shared_scale_2
from refit.tools.cli import main
from refit.tools.verify import reference_shards, verify

F64 = torch.float64


def _f32(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to float32 (and back, exactly)."""
    return x.to(torch.float32).to(F64)


def _e4m3_table() -> torch.Tensor:
    """The finite non-negative E4M3 values by code 0..126: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m/8 * 2**-6); code 127 (S.1111.111) is NaN."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=F64)


E4M3 = _e4m3_table()
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)  # codes 0..7: 2 exponent bits, 1 mantissa


def _nearest_code(a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The code of ``table`` (ascending, code = index) nearest to each ``a >= 0``: ties to the even code,
    values past the largest saturate to it."""
    a = a.clamp(max=table[-1].item())
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - table[lo], table[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return torch.where(pick_hi, hi, lo)


def ref_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 E4M3 codes [.., K] and E8M0 biased exponents [.., ceil(K/32)]: X = 2**ceil(log2(amax / 448))
    (the block's largest element fits E4M3's 448), then each element x / X to the nearest E4M3 value."""
    x = x.to(F64)
    k = x.shape[-1]
    g = -(-k // 32)
    xb = torch.nn.functional.pad(x, (0, g * 32 - k)).reshape(*x.shape[:-1], g, 32)
    amax = xb.abs().amax(-1).clamp(min=2.0**-126)
    exps = []
    for r in _f32(amax / 448).reshape(-1).tolist():
        mant, ex = math.frexp(r)  # r = mant * 2**ex, mant in [0.5, 1)
        exps.append(min(254, max(0, (ex - 1 if mant == 0.5 else ex) + 127)))
    e = torch.tensor(exps, dtype=torch.int64).reshape(amax.shape)
    y = xb / torch.pow(2.0, (e - 127).to(F64)).unsqueeze(-1)
    codes = _nearest_code(y.abs(), E4M3) | (torch.signbit(y).long() << 7)  # -0 keeps its sign
    return codes.reshape(*x.shape[:-1], g * 32)[..., :k].to(torch.uint8), e.to(torch.uint8)


def ref_nvfp4(x: torch.Tensor, amax_tensor: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(packed E2M1 bytes [.., ceil(K/2)], E4M3 block-scale codes [.., ceil(K/16)], global scale) of a matrix
    ``x``: global g = A / (6 * 448); block scale s = E4M3(amax_block / (6 g)); element x / (s g) to the nearest
    E2M1 value; element 2j in the low nibble of byte j. Each step rounded to float32 as the format stores it."""
    x = x.to(F64)
    k = x.shape[-1]
    nb = -(-k // 16)
    xb = torch.nn.functional.pad(x, (0, nb * 16 - k)).reshape(*x.shape[:-1], nb, 16)
    g = _f32(torch.tensor(amax_tensor, dtype=F64) / 2688)
    six_g = _f32(g * 6)
    sc = _nearest_code(_f32(xb.abs().amax(-1) / six_g), E4M3)
    denom = _f32(E4M3[sc] * g).unsqueeze(-1)
    y = torch.where(denom > 0, _f32(xb / denom), torch.zeros_like(xb))
    codes = _nearest_code(y.abs(), E2M1) | ((xb < 0).long() << 3)  # -0 is +0, as ModelOpt packs it
    codes = codes.reshape(*x.shape[:-1], nb * 16)[..., :k]
    if k % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), sc.to(torch.uint8), g.item()


def awkward(shape, seed) -> torch.Tensor:
    """Random values with what a quantizer trips on: a zero block, a tiny block (subnormal scale ratio),
    a block whose amax is 448 * 2**k exactly, E2M1 ties, negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 3)
    x[..., 0, :32] = 0.0
    x[..., 1, :16] = 1e-39 * torch.randn(16, generator=g)
    x[..., 2, :32] = torch.tensor([448.0 * 4, -3.0] * 16)
    x[..., 3, 16:20] = torch.tensor([-0.0, 0.25, 2.5, 5.0])
    return x


@pytest.mark.parametrize("shape", [(37, 96), (5, 50), (3, 2, 7, 48), (4, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refit_quantizers_equal_the_reference_byte_for_byte(shape, dtype):
    x = awkward(shape, sum(shape)).to(dtype)
    q, s = quantize_mxfp8(x)
    rq, rs = ref_mxfp8(x)
    assert torch.equal(q.view(torch.uint8), rq) and torch.equal(s, rs)
    x2 = x.reshape(-1, *shape[-2:])  # NVFP4: one global scale per matrix
    amax = x2.float().abs().amax(dim=(-2, -1))
    packed, bs = quantize_nvfp4(x2, shared_scale_2({"w": amax})["w"])
    for i in range(x2.shape[0]):
        rp, rb, _ = ref_nvfp4(x2[i], amax[i].item())
        assert torch.equal(packed[i], rp) and torch.equal(bs[i].view(torch.uint8), rb), i
    assert packed.shape[-1] == -(-shape[-1] // 2) and bs.shape[-1] == -(-shape[-1] // 16)


def _layout(model, spec, side="src", shapes=None):
    return layout_from_spec(shapes or param_shapes(model), parse_spec(spec, side))


# odd shapes: rows 37 / 5 / 33 / 7, K 80 (MXFP8: 2.5 blocks), stacked experts [3, 2, 7, 48] and [3, 48, 64]
ODD = [
    ("model.layers.0.self_attn.q_proj.weight", (37, 80), torch.float32),
    ("model.layers.0.self_attn.k_proj.weight", (5, 80), torch.float32),
    ("model.layers.0.self_attn.v_proj.weight", (5, 80), torch.float32),
    ("model.layers.0.self_attn.o_proj.weight", (80, 64), torch.float32),
    ("model.layers.0.mlp.gate_proj.weight", (33, 80), torch.float32),
    ("model.layers.0.mlp.up_proj.weight", (33, 80), torch.float32),
    ("model.layers.0.mlp.down_proj.weight", (80, 64), torch.float32),
    ("model.layers.1.mlp.experts.gate_up_proj", (3, 2, 7, 48), torch.float32),
    ("model.layers.1.mlp.experts.down_proj", (3, 48, 64), torch.float32),
    ("model.norm.weight", (80,), torch.float32),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "fmt,model,src,dst",
    [
        ("nvfp4", None, "fsdp=2", "tp=2"),  # odd shapes: FSDP rows into TP rows and 32-column halves
        ("mxfp8", None, "ep=2,tp=2", "ep=2"),  # odd experts split over EP into EP
        ("nvfp4", "tiny-qwen3-moe", "pp=2,ep=2", "ep=2,tp=2"),
        ("mxfp8", "tiny-qwen2", "tp=2", "tp=2,dp=2"),
    ],
)
def test_engine_ranks_receive_the_bytes_of_quantizing_the_whole_tensor(fmt, model, src, dst):
    shapes = None if model else ODD
    res = verify(_layout(model, src, shapes=shapes), _layout(model, dst, "dst", shapes=shapes), quant=fmt)
    assert res.ok, res.mismatches[:3]
    assert res.plan.ratio == 1.0  # each replica's bytes counted once, nothing sent twice
    names = mx_names(res.plan.dst_layout, NVFP4 if fmt == "nvfp4" else MXFP8)
    assert any("experts" in n for n in names) or model == "tiny-qwen2"
    assert not any("norm" in n or "embed" in n for n in names)


def test_layouts_follow_modelopt_names_and_shapes():
    lay = mx_layout(_layout("qwen3-30b-a3b", "tp=2", "dst"), "nvfp4", side="destination")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert lay[q].dtype == torch.uint8 and lay[q].shape == (4096, 1024)  # [N, K/2]: two values a byte
    assert lay[block_scale_name(q)].shape == (4096, 128) and lay[block_scale_name(q)].dtype == torch.float8_e4m3fn
    assert lay[global_scale_name(q)].shape == () and {lay[global_scale_name(q)].box(r) for r in (0, 1)} == {()}
    o = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: rank 1 holds input columns 2048..4095
    assert lay[o].box(1) == ((0, 2048), (1024, 2048)) and lay[block_scale_name(o)].box(1) == ((0, 2048), (128, 256))
    e = "model.layers.0.mlp.experts.gate_up_proj"
    assert lay[global_scale_name(e)].shape == (128, 2)  # vLLM's w13_weight_scale_2 [E, 2]
    mx = mx_layout(_layout("qwen3-30b-a3b", "tp=2", "dst"), "mxfp8", side="destination")
    assert mx[q].dtype == torch.float8_e4m3fn and mx[block_scale_name(q)].dtype == torch.uint8
    assert mx[block_scale_name(q)].shape == (4096, 64) and global_scale_name(q) not in mx.names


def test_a_shard_boundary_inside_a_block_is_refused_naming_the_tensor(capsys):
    # tiny-qwen3-moe's experts.down_proj [8, 128, 64] at tp=4: 16 input columns a rank, half an MXFP8 block
    with pytest.raises(LayoutError, match=r"MXFP8 destination: tensor 'model.layers.0.mlp.experts.down_proj'.*"):
        mx_layout(_layout("tiny-qwen3-moe", "tp=4", "dst"), "mxfp8", side="destination")
    mx_layout(_layout("tiny-qwen3-moe", "tp=4", "dst"), "nvfp4", side="destination")  # 16 columns: whole blocks
    assert main(["plan", "--model", "tiny-qwen2", "--src", "tp=1", "--dst", "tp=4", "--quant", "mxfp8"]) == 2
    err = capsys.readouterr().err
    assert "down_proj" in err and "columns [0, 80)" in err and "32-column block" in err


def test_plan_moves_the_quantized_bytes(capsys):
    args = ["plan", "--model", "qwen3-30b-a3b", "--src", "pp=2,ep=4,tp=2", "--dst", "tp=2,dp=4", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    ratios = {}
    for fmt in ("mxfp8", "nvfp4"):
        assert main(args + ["--quant", fmt]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["ratio"] == 1.0 and out["quant"] == fmt
        ratios[fmt] = out["bytes_needed"] / plain["bytes_needed"]
    # MXFP8: 1 + 1/32 bytes a weight instead of 2; NVFP4: 1/2 + 1/16 (embeddings and lm_head stay bf16)
    assert 0.5 < ratios["mxfp8"] < 0.54 and 0.27 < ratios["nvfp4"] < 0.31


def test_nvfp4_global_scale_is_shared_where_vllm_fuses_and_staged_refits_need_agreement():
    plain = _layout(None, "tp=1", shapes=ODD)
    qlay = mx_layout(plain, NVFP4)
    live = reference_shards(plain, 0)
    quantizer = MxQuantizer(qlay, 0, live, NVFP4)
    quantizer()  # all names: agrees first
    t = quantizer.tensors
    qkv = [t[global_scale_name(f"model.layers.0.self_attn.{p}_proj.weight")] for p in "qkv"]
    amax = max(live[f"model.layers.0.self_attn.{p}_proj.weight"].abs().max().item() for p in "qkv")
    assert all(torch.equal(s, qkv[0]) for s in qkv) and qkv[0].item() == torch.tensor(amax / 2688).item()
    gu = t[global_scale_name("model.layers.1.mlp.experts.gate_up_proj")]
    assert gu.shape == (3, 2) and torch.equal(gu[:, 0], gu[:, 1])  # vLLM refuses w1/w3 scales that differ
    name = "model.layers.0.mlp.down_proj.weight"
    quantizer.agree()
    quantizer({name})
    with pytest.raises(LayoutError, match=r"NVFP4 source rank 0: weight 'model.layers.0.mlp.down_proj.weight'"):
        quantizer({name})  # a second staged quantization without a new agreement
    with pytest.raises(LayoutError, match=r"pass group="):
        MxQuantizer(mx_layout(_layout(None, "fsdp=2", shapes=ODD), NVFP4), 0, live, NVFP4)
    pulled = MxQuantizer(qlay, 0, live, NVFP4)  # a receiver quantizes q_proj on its pull (ipc_quant)
    q = "model.layers.0.self_attn.q_proj.weight"
    pulled.on_pull({q})
    pulled({t.name for t in qlay} - {q})  # every other tensor: a whole refit, which agrees first
    assert torch.equal(pulled.scale_2[q], quantizer.scale_2[q]) and torch.equal(pulled.tensors[name], t[name])


def _boundary(t: float, inclusive: bool) -> float:
    """The real ``b`` with ``RN32(q) > t <=> q > b`` (``inclusive``: ``RN32(q) >= t <=> q >= b``) for every real
    ``q >= 0``: the midpoint between ``t`` and its float32 neighbour above (below); ``t``'s last mantissa bit is
    even, so a ``q`` at the midpoint rounds to ``t``. Quotients near these bounds are where a rounding slip in a
    kernel's division shows."""
    f = torch.tensor(t, dtype=torch.float32)
    assert not f.view(torch.int32).item() & 1, f"E2M1 threshold {t}: odd mantissa"
    return (t + torch.nextafter(f, torch.tensor(0.0 if inclusive else math.inf)).item()) / 2


E2M1_BOUNDS = tuple((_boundary(t, inclusive), inclusive) for t, inclusive in _E2M1_UP)


def _ulps(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 ``x`` moved ``k`` float32 steps (up for k > 0, infinity at most), through its bits."""
    return (x.view(torch.int32) + k.to(torch.int32)).clamp(0, 0x7F800000).view(torch.float32)


def _near_bounds(d: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """float32 values around d * (each E2M1 threshold and each exact bound of ``E2M1_BOUNDS``), 0-3 steps off
    either way, random signs: one per element of ``d``."""
    ts = torch.tensor([t for t, _ in _E2M1_UP] + [b for b, _ in E2M1_BOUNDS], dtype=F64)
    pick = ts[torch.randint(len(ts), d.shape, generator=g)]
    x = (d.double().abs() * pick).float()
    x = _ulps(x, torch.randint(-3, 4, d.shape, generator=g))
    return torch.where(torch.rand(d.shape, generator=g) < 0.5, -x, x)


def _near_miss_divisors(b: float, n: int, g: torch.Generator) -> torch.Tensor:
    """n float32 divisors ``d`` (normal, random exponents) with ``b * d`` within 1..512 units of its 49th
    significant bit of a float32 ``x`` (``RN32(b * d)``): ``x / d`` is then within 2**-40 of ``b`` relatively,
    closer than random values ever land. ``b``'s odd significand ``m_b`` (25 bits) is invertible modulo 2**25:
    ``m_d = c / m_b mod 2**25`` gives ``m_b * m_d = k * 2**25 + c``."""
    m_b, den = b.as_integer_ratio()
    inv = pow(m_b, -1, 1 << 25)
    ms = [m for c in range(-512, 513) if c and (1 << 23) <= (m := c * inv % (1 << 25)) < (1 << 24)]
    pick = torch.tensor(ms, dtype=F64)[torch.randint(len(ms), (n,), generator=g)]
    return (pick * torch.pow(2.0, torch.randint(-100, 60, (n,), generator=g).double())).float()


def _some_floats(n: int, g: torch.Generator, lo: int = -149, hi: int = 127) -> torch.Tensor:
    """n positive float32 values with random mantissas and exponents 2**lo .. 2**hi (subnormals below -126)."""
    return (torch.rand(n, generator=g, dtype=F64) + 1) * torch.pow(
        2.0, torch.randint(lo, hi, (n,), generator=g).double()
    )


def nvfp4_adversarial(rows: int, blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x float32 [rows, 16 * blocks], weight_scale_2 float32 [rows]) for NVFP4's element arithmetic: weight
    scales 1e-12 / 2688 (the floor) to float32's largest / 448 (block divisors near float32's largest, elements
    that overflow to infinity; no NaN: the kernels' block maxima skip NaN where torch's keep it), each block's largest
    element at 2**-12 .. 2**10 times 6 * scale (E4M3 block scales subnormal, normal, clamped at 448), the others
    within 3 float32 steps of the block's divisor times a rounding threshold or exact bound, and blocks of zeros
    (signed), float32 subnormals and infinities."""
    from refit.quant.mx import _blocks, nvfp4_block_scales

    g = torch.Generator().manual_seed(seed)
    s2 = _some_floats(rows, g, -60, 60).float()
    s2[::7] = AMAX_FLOOR / 2688
    s2[1::11] = torch.finfo(torch.float32).max / 448 * _some_floats(len(s2[1::11]), g, -12, -1).float()
    m = (s2.double()[:, None] * 6 * _some_floats(rows * blocks, g, -12, 10).reshape(rows, blocks)).float()
    near = torch.arange(rows) % 5 == 4  # rows whose weight scale is a near-miss divisor, block scales 1.0
    j = torch.randint(len(E2M1_BOUNDS), (rows,), generator=g)
    for i in near.nonzero().flatten().tolist():
        s2[i] = _near_miss_divisors(E2M1_BOUNDS[j[i]][0], 1, g)[0]
        m[i] = s2[i] * 6  # amax / (6 * scale) is 1 exactly: the divisor is the scale itself
    x = torch.zeros(rows, blocks, 16)
    x[..., 0] = m
    _, d = nvfp4_block_scales(x.unsqueeze(1), s2)
    d = d.reshape(rows, blocks, 1).expand(rows, blocks, 15)
    x[..., 1:] = _near_bounds(d, g)
    b = torch.tensor([b for b, _ in E2M1_BOUNDS], dtype=F64)[j][:, None, None]
    at = _ulps((d.double() * b).float(), torch.randint(-1, 2, d.shape, generator=g))
    x[..., 1:] = torch.where(near[:, None, None] & (torch.rand(d.shape, generator=g) < 0.5), at, x[..., 1:])
    x = x.reshape(rows, blocks * 16)
    x[2::13, :16] = torch.tensor([0.0, -0.0] * 8)
    x[3::13, :16] = _some_floats(16, g, -149, -126).float() * torch.tensor([1.0, -1.0] * 8)
    x[4::13, 16:32] = torch.tensor([math.inf, -math.inf, 1.0, -0.0] * 4)
    assert _blocks(x, 16).shape == (rows, blocks, 16)
    return x, s2


def test_nvfp4_amax_from_the_trainer_replaces_the_read_once_and_is_checked():
    """``set_amax``: the trainer's ``max |x|`` gives the bytes of reading the weights, is used by one agreement
    only (the next reads again; with one rank its scales are written by ``set_amax`` itself), is refused after a
    weight changed in place, and bad input is refused naming the tensor."""
    plain = _layout(None, "tp=1", shapes=ODD)
    qlay = mx_layout(plain, NVFP4)
    live = reference_shards(plain, 0)
    names = mx_names(qlay, NVFP4)
    amax = {n: live[n].abs().amax(dim=(-2, -1)).float() for n in names}
    read, given = MxQuantizer(qlay, 0, live, NVFP4), MxQuantizer(qlay, 0, live, NVFP4)
    read()
    given.set_amax(amax)
    given()
    for name, t in read.tensors.items():
        assert torch.equal(given.tensors[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    g = global_scale_name(names[0])
    given.set_amax({n: a * 4 for n, a in amax.items()})  # used: four times the scale
    four = torch.tensor(4 * amax[names[0]].item() / 2688).item()
    assert given.tensors[g].item() == four != read.tensors[g].item()  # one rank: set_amax computed it
    given()
    assert given.tensors[g].item() == four
    given()  # consumed: the next refit reads the weights
    assert torch.equal(given.tensors[g], read.tensors[g])
    given.set_amax(amax)
    live[names[1]].mul_(1.0)  # an in-place step after the amax was taken
    with pytest.raises(LayoutError, match=rf"weight {names[1]!r} changed after set_amax"):
        given()
    e = "model.layers.1.mlp.experts.gate_up_proj"
    bad = [
        ({k: v for k, v in amax.items() if k != e}, rf"the amax of {e!r} is missing"),
        (amax | {e: amax[e][0]}, rf"the amax of {e!r} must be float32 of shape \[3, 2\], got torch.float32 \[2\]"),
        (amax | {e: amax[e].double()}, rf"the amax of {e!r} must be float32"),
        (amax | {e: amax[e] * math.nan}, rf"the amax of {e!r} holds nan, not a finite value >= 0"),
        (amax | {names[0]: -amax[names[0]]}, rf"the amax of {names[0]!r} holds -"),
        (amax | {"model.norm.weight": amax[e]}, r"'model.norm.weight' is not an NVFP4 weight this rank holds"),
    ]
    for arg, msg in bad:
        with pytest.raises(ValueError, match=r"NVFP4 source rank 0: set_amax: " + msg):
            given.set_amax(arg)
    with pytest.raises(ValueError, match=r"MXFP8 source rank 0: set_amax is for NVFP4"):
        MxQuantizer(mx_layout(plain, MXFP8), 0, live, MXFP8).set_amax(amax)
