"""LoRA without an engine: the spec, the names, the merge (bit for bit PEFT's), the sources, and the checks
that refuse an adapter an engine cannot serve (``refit.engines.vllm.lora.check_engine``: no vLLM needed)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate

from refit.errors import ConfigError, LayoutError
from refit.layout.lora import (
    LoraSpec,
    adapter_names,
    check_adapter_tensors,
    engine_layer_params,
    merge_weight,
)
from refit.layout.models import build_model, load_config

peft = pytest.importorskip("peft", reason="peft is not installed")

from peft import LoraConfig, get_peft_model  # noqa: E402

from refit.engines.vllm.lora import adapter_id, check_engine, engine_modules, lora_path  # noqa: E402
from refit.trainers.peft import LoraAdapterSource, MergedLoraSource, hf_name, read_lora  # noqa: E402

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def _peft(model_name="tiny-llama", **kw):
    cfg = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(0)
    return get_peft_model(build_model(load_config(model_name), torch.float32, seed=0), LoraConfig(**{**cfg, **kw}))


def _sgd_step(model):
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
                p.grad = None


def test_hf_names_of_peft_parameters():
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == (
        "model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    assert hf_name("base_model.model.model.norm.weight") == "model.norm.weight"
    assert hf_name("model.layers.1.mlp.down_proj.lora_B.policy.weight", adapter="policy") == (
        "model.layers.1.mlp.down_proj.lora_B.weight"
    )
    with pytest.raises(LayoutError, match="adapter 'other'"):
        hf_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight")


def test_read_lora_spec_names_and_shapes():
    model = _peft()
    parts = read_lora(model, name="policy")
    spec = parts.spec
    assert (spec.name, spec.rank, spec.alpha, spec.scale) == ("policy", 4, 8, 2.0)
    assert len(spec.modules) == 4 * len(TARGETS) and list(spec.modules) == sorted(spec.modules)
    assert "model.layers.0.self_attn.q_proj" in spec.modules
    a, b = adapter_names("model.layers.0.self_attn.q_proj")
    assert parts.adapter[a].shape == (4, 128) and parts.adapter[b].shape == (128, 4)
    assert parts.adapter[a] is model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    # every base parameter under its HF name, the model's order
    hf = build_model(load_config("tiny-llama"), torch.float32, seed=0)
    assert list(parts.base) == [n for n, _ in hf.named_parameters()]
    assert read_lora(_peft(use_rslora=True)).spec.scale == 8 / math.sqrt(4)


def test_merge_is_peft_merge_bit_for_bit():
    model = _peft()
    _sgd_step(model)  # A and B both trained
    source = MergedLoraSource(model, 1, engine_layers=False)
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert set(source.local()) == {f"{m}.weight" for m in source.parts.spec.modules}
    for name, t in source.local().items():
        assert torch.equal(t, merged[name]), name
    _sgd_step(model)  # the adapter moves; prepare() follows it
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert not all(torch.equal(t, merged[n]) for n, t in source.local().items())
    source.prepare(None)
    assert all(torch.equal(t, merged[n]) for n, t in source.local().items())
    q = "model.layers.0.self_attn.q_proj.weight"
    before = source.local()["model.layers.1.self_attn.q_proj.weight"].clone()
    _sgd_step(model)
    source.prepare({q})  # only the names asked for
    assert torch.equal(source.local()["model.layers.1.self_attn.q_proj.weight"], before)


def test_merge_weight_shapes_chain():
    w, a, b = torch.zeros(6, 5), torch.ones(2, 5), torch.ones(6, 2)
    assert torch.equal(merge_weight(w, a, b, 0.5), torch.full((6, 5), 1.0))
    with pytest.raises(LayoutError, match=r"base \[6, 5\] != B \[6, 3\] @ A \[2, 5\]"):
        merge_weight(w, a, torch.ones(6, 3), 1.0)


def test_merged_source_sends_whole_engine_layers():
    model = _peft()
    names = set(MergedLoraSource(model, 2).layout().names)
    layer0 = {n for n in names if ".layers.0." in n}
    p = "model.layers.0."
    want = {f"{p}self_attn.{m}_proj.weight" for m in "qkvo"} | {
        f"{p}mlp.{m}_proj.weight" for m in ("gate", "up", "down")
    }
    assert layer0 == want  # k beside q and v (qkv_proj), up beside gate (gate_up_proj); no norm, no embedding
    src = MergedLoraSource(model, 2)
    k = f"{p}self_attn.k_proj.weight"
    assert src.local()[k].data_ptr() == src.parts.base[k].data_ptr()  # an untouched sibling: the base itself


def test_engine_layer_params_with_biases():
    params = [f"m.layers.0.self_attn.{x}_proj.{p}" for x in "qkvo" for p in ("weight", "bias")] + ["m.norm.weight"]
    assert engine_layer_params(["m.layers.0.self_attn.v_proj"], params) == params[:6]
    assert engine_layer_params(["m.layers.0.self_attn.o_proj"], params) == params[6:8]


def test_adapter_source_layout_and_live_tensors():
    model = _peft()
    src = LoraAdapterSource(model, 2)
    layout = src.layout()
    assert layout.world_size == 2 and len(layout) == 2 * 4 * len(TARGETS)
    a = "model.layers.2.mlp.down_proj.lora_A.weight"
    assert layout[a].shape == (4, 256) and layout[a].placements == (Replicate(),)  # every rank holds it whole
    assert layout[a].mesh.ranks == (0, 1)
    live = model.base_model.model.model.layers[2].mlp.down_proj.lora_A["default"].weight
    assert src.local()[a].data_ptr() == live.data_ptr()  # no copy: a refit reads the trained parameter
    assert src.lora_spec().peft_config() == {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": False,
        "target_modules": sorted(TARGETS),
    }


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(use_dora=True), "use_dora=True"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=["embed_tokens", "q_proj"]), "embed_tokens' is a Embedding"),
        (dict(bias="lora_only"), "bias='lora_only'"),
    ],
)
def test_unsupported_adapters_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        read_lora(_peft(**kw))


def test_unknown_adapter_name_is_refused():
    with pytest.raises(ConfigError, match=r"no PEFT adapter 'policy' \(adapters: \['default'\]\)"):
        read_lora(_peft(), adapter="policy")


def test_wrong_rank_is_refused():
    spec = LoraSpec("p", 4, 8, ("m.q_proj",))
    check_adapter_tensors(
        spec, {"m.q_proj.lora_A.weight": (4, 16), "m.q_proj.lora_B.weight": (32, 4)}, {"m.q_proj": (32, 16)}
    )
    with pytest.raises(LayoutError, match=r"'m.q_proj.lora_A.weight' has shape \[8, 16\], expected \[4, 16\]"):
        check_adapter_tensors(
            spec, {"m.q_proj.lora_A.weight": (8, 16), "m.q_proj.lora_B.weight": (32, 8)}, {"m.q_proj": (32, 16)}
        )
    with pytest.raises(LayoutError, match="'m.k_proj.lora_A.weight' is not one of"):
        check_adapter_tensors(spec, {"m.k_proj.lora_A.weight": (4, 16)}, {"m.q_proj": (32, 16)})
    with pytest.raises(LayoutError, match="'m.q_proj.lora_B.weight' is missing"):
        check_adapter_tensors(spec, {"m.q_proj.lora_A.weight": (4, 16)}, {"m.q_proj": (32, 16)})
    with pytest.raises(LayoutError, match="'m.q_proj' .* is not a linear module"):
        check_adapter_tensors(spec, {}, {})


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(rank=0), "rank must be an integer >= 1, got 0"),
        (dict(alpha=float("nan")), "alpha must be a finite non-zero number, got nan"),
        (dict(modules=("b", "a")), r"sorted and unique, got \['b', 'a'\]"),
        (dict(modules=()), "non-empty tuple"),
        (dict(modules=("base_model.model.x",)), "base model's module paths"),
        (dict(name="a/b"), "without '/'"),
    ],
)
def test_spec_validation_names_field_and_value(kw, match):
    with pytest.raises(ConfigError, match=match):
        LoraSpec(**{**dict(name="p", rank=4, alpha=8.0, modules=("m.q_proj",)), **kw})


def test_spec_json_round_trip_and_refusals():
    spec = LoraSpec("p", 4, 8.0, ("a.q_proj", "a.v_proj"), use_rslora=True)
    assert LoraSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError, match="exactly the keys"):
        LoraSpec.from_json({**spec.to_json(), "code": "x"})
    with pytest.raises(ConfigError, match="rank must be an integer"):
        LoraSpec.from_json({**spec.to_json(), "rank": "4"})


def _fake_manager():
    """vLLM's LoRA manager as far as ``engine_modules`` reads it: a packed qkv and gate_up, an o and a down."""
    lin = lambda i, o: SimpleNamespace(base_layer=SimpleNamespace(input_size=i, output_size=o))  # noqa: E731
    modules = {
        "model.layers.0.self_attn.qkv_proj": lin(128, 256),
        "model.layers.0.self_attn.o_proj": lin(128, 128),
        "model.layers.0.mlp.gate_up_proj": lin(128, 512),
        "model.layers.0.mlp.down_proj": lin(256, 128),
        "lm_head": SimpleNamespace(base_layer=SimpleNamespace()),  # no input_size: not a linear layer here
    }
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    return SimpleNamespace(modules=modules, packed_modules_mapping=packed)


def test_engine_modules_unpack_fused_layers():
    mods = engine_modules(_fake_manager())
    assert mods["model.layers.0.self_attn.k_proj"] == (128, None)
    assert mods["model.layers.0.mlp.up_proj"] == (128, None)
    assert mods["model.layers.0.mlp.down_proj"] == (256, 128)
    assert "lm_head" not in mods and "model.layers.0.self_attn.qkv_proj" not in mods


def _src(model, world_size=1):
    return LoraAdapterSource(model, world_size)


def test_check_engine_refusals():
    model = _peft(target_modules=["q_proj", "down_proj"])
    src = _src(model)
    full = {
        f"model.layers.{i}.{m}": s
        for i in range(4)
        for m, s in [("self_attn.q_proj", (128, None)), ("mlp.down_proj", (256, 128))]
    }
    ok = SimpleNamespace(max_lora_rank=8)
    check_engine(src.lora_spec(), ok, full, src.layout())  # fits
    with pytest.raises(ValueError, match="runs without LoRA: start it with enable_lora=True and max_lora_rank >= 4"):
        check_engine(src.lora_spec(), None, full, src.layout())
    with pytest.raises(ValueError, match="has rank 4 > this engine's max_lora_rank=2"):
        check_engine(src.lora_spec(), SimpleNamespace(max_lora_rank=2), full, src.layout())
    fewer = {k: v for k, v in full.items() if ".layers.3." not in k}  # an engine model with 3 layers
    with pytest.raises(ValueError, match="'model.layers.3.mlp.down_proj' .* is not one this vLLM engine can adapt"):
        check_engine(src.lora_spec(), ok, fewer, src.layout())
    wrong = {**full, "model.layers.0.mlp.down_proj": (512, 128)}
    with pytest.raises(ValueError, match=r"A \[4, 256\], B \[128, 4\] do not fit the engine's layer \(input 512"):
        check_engine(src.lora_spec(), ok, wrong, src.layout())


def test_adapter_ids_per_version():
    assert [adapter_id(v) for v in (0, 1, 7)] == [1, 2, 8]
    assert lora_path("policy", 3) == "refit://policy/v3"
    with pytest.raises(ValueError, match="version must be an integer >= 0, got -1"):
        adapter_id(-1)


class _Store:
    """What ``publish_src_layout`` / ``read_lora_spec`` use of a SignedStore: put, and get (here, no wait)."""

    def __init__(self):
        self.values = {}

    def put(self, key, value):
        self.values[key] = value

    def get(self, key, timeout_s):
        return self.values[key]


def test_the_spec_travels_beside_the_source_layout():
    from refit.engines.vllm.common import publish_src_layout, read_lora_spec
    from refit.engines.vllm.trainer import lora_spec

    model = _peft()
    adapter, merged = LoraAdapterSource(model, 1), MergedLoraSource(model, 1)
    store = _Store()
    publish_src_layout(store, adapter.layout(), lora_spec(adapter))
    assert read_lora_spec(store, 1.0) == adapter.lora_spec()
    publish_src_layout(store, merged.layout(), lora_spec(merged))  # model weights: no adapter
    assert read_lora_spec(store, 1.0) is None
    store.put("lora", {"rank": 4})
    with pytest.raises(ConfigError, match="exactly the keys"):
        read_lora_spec(store, 1.0)


def test_sglang_refuses_an_adapter_source_before_anything_starts():
    from refit.engines.sglang.trainer import RefitSGLangTrainer, SGLangTrainerInitInfo

    with pytest.raises(ConfigError, match="does not serve LoRA adapters: .*MergedLoraSource"):
        RefitSGLangTrainer.trainer_init(SGLangTrainerInitInfo(), source=LoraAdapterSource(_peft(), 1))


def _merged_lora_worker(world, steps: int):
    """2 data-parallel trainer ranks (identical PEFT models, identical steps) -> 2 engine ranks (tp=2) of the
    touched layers through refit's own Sender / Receiver; each engine rank trains the same model itself
    as the reference and checks its shards of every version bit for bit against PEFT's merge."""
    from refit.layout import box_slices
    from refit.layout.rules import layout_from_spec
    from refit.layout.spec import parse_spec
    from refit.plan import ProcessMap
    from refit.transfer import Receiver, Sender

    torch.set_num_threads(1)
    model = _peft()
    source = MergedLoraSource(model, 2)
    src = source.layout()
    dst = layout_from_spec([(t.name, t.shape, t.dtype) for t in src], parse_spec("tp=2", "dst"))
    procs = ProcessMap.disjoint(2, 2)
    if world.src_rank is not None:
        sender = Sender(src, dst, world.rank, source.local(), procs=procs, prepare=source.prepare)
        for v in range(1, steps + 1):
            _sgd_step(model)
            sender.push(v)
        return None
    boxes = dict((t.name, b) for t, b in dst.local_tensors(world.dst_rank))
    local = {n: torch.zeros(tuple(y - x for x, y in b)) for n, b in boxes.items()}
    receiver = Receiver(src, dst, world.rank, local, procs=procs)
    exact, received = [], 0
    for v in range(1, steps + 1):
        _sgd_step(model)
        received = receiver.pull(v).bytes_received
        merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
        exact.append(all(torch.equal(local[n], merged[n][box_slices(b)]) for n, b in boxes.items()))
    return exact, received, sum(t.numel() * 4 for t in local.values())


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_merged_lora_through_refits_own_sender_and_receiver():
    from refit.tools.launch import run_local

    out = run_local(_merged_lora_worker, 2, 2, 3, backend="gloo", timeout_s=150)
    for exact, received, held in out[2:]:
        assert exact == [True, True, True]  # every version, every shard: PEFT's merge bit for bit
        assert received == held  # each engine rank receives exactly its shard of the touched layers
