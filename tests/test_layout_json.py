"""The one JSON format of a layout (``refit.layout/1``, docs/layout-json.md): exact round trips."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from refit.engines.vllm.common import boxes_layout
from refit.layout import LAYOUT_FORMAT, LayoutError, Mesh, ModelLayout, TensorLayout
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.quant import fp8_layout
from refit.tools.cli import main
from strategies import meshes, placements_for, tensor_shapes


def _round_trip(layout: ModelLayout) -> ModelLayout:
    doc = json.loads(json.dumps(layout.to_json()))  # through text: plain JSON data only
    back = ModelLayout.from_json(doc)
    assert back == layout
    for t, u in zip(layout, back):
        assert all(t.box(r) == u.box(r) for r in range(layout.world_size))
    return back


@pytest.mark.parametrize(
    "model,side,spec",
    [
        ("tiny-llama", "src", "tp=2"),
        ("tiny-llama", "src", "pp=2,tp=2"),
        ("tiny-qwen2", "src", "fsdp=2,tp=2"),
        ("tiny-qwen3", "src", "pp=2,dp=2,fsdp=2"),
        ("tiny-qwen3-moe", "src", "pp=2,ep=2,etp=2"),
        ("tiny-mixtral", "src", "ep=4,tp=2"),
        ("tiny-qwen2-moe", "dst", "dp=2,ep=2,tp=2"),
        ("tiny-llama", "dst", "tp=1,dp=4"),
    ],
)
def test_spec_layouts_round_trip(model, side, spec):
    _round_trip(layout_from_spec(param_shapes(model), parse_spec(spec, side)))


def test_meshes_are_shared_by_index():
    layout = layout_from_spec(param_shapes("tiny-llama"), parse_spec("pp=2,tp=2", "src"))
    doc = layout.to_json()
    assert doc["format"] == LAYOUT_FORMAT == "refit.layout/1"
    assert len(doc["meshes"]) == 2  # one per pipeline stage, however many tensors
    assert {t["mesh"] for t in doc["tensors"]} == {0, 1}
    assert not any("boxes" in t for t in doc["tensors"])
    first = doc["tensors"][0]
    assert first == {
        "name": "model.embed_tokens.weight",
        "shape": [512, 128],
        "dtype": "float32",
        "mesh": 0,
        "placements": ["S0"],
    }
    assert doc["meshes"][0] == {"shape": [2], "dim_names": ["tp"], "ranks": [0, 1]}


def test_box_layouts_round_trip():
    layout = boxes_layout(
        [
            ("a", (4, 6), torch.bfloat16, {0: ((0, 2), (0, 6)), 1: ((2, 4), (0, 6)), 2: ((0, 4), (0, 0))}),
            ("b", (3,), torch.int64, {1: ((0, 3),)}),
        ],
        3,
    )
    back = _round_trip(layout)
    assert back["a"].boxes == {0: ((0, 2), (0, 6)), 1: ((2, 4), (0, 6)), 2: ((0, 4), (0, 0))}
    assert back["b"].box(0) is None and back["b"].box(1) == ((0, 3),)
    doc = layout.to_json()
    assert len(doc["meshes"]) == 1 and all("boxes" in t for t in doc["tensors"])


def test_fp8_layouts_round_trip():
    layout = layout_from_spec(param_shapes("tiny-qwen3-moe"), parse_spec("ep=2,tp=2", "src"))
    q = fp8_layout(layout, block=(32, 32))
    back = _round_trip(q)
    assert back["model.layers.0.mlp.experts.down_proj"].dtype == torch.float8_e4m3fn
    assert back["model.layers.0.mlp.experts.down_proj_scale_inv"].boxes is not None


@given(st.data())
def test_random_layouts_round_trip(data):
    world = data.draw(st.integers(1, 8))
    tensors = []
    for i in range(data.draw(st.integers(1, 4))):
        shape = data.draw(tensor_shapes())
        mesh = data.draw(meshes(world))
        tensors.append(TensorLayout(f"t{i}", shape, torch.float32, mesh, data.draw(placements_for(mesh, len(shape)))))
    _round_trip(ModelLayout(tuple(tensors), world))


@pytest.mark.parametrize(
    "doc,match",
    [
        ({"format": "refit.layout/2"}, "not a refit.layout/1 layout document"),
        ({"format": "refit.layout/1", "world_size": 2, "meshes": []}, "missing or malformed field 'tensors'"),
        ({"tensors": []}, "format None"),
    ],
)
def test_not_a_layout_document(doc, match):
    with pytest.raises(LayoutError, match=match):
        ModelLayout.from_json(doc)


def _doc(**tensor):
    t = {"name": "w", "shape": [4], "dtype": "float32", "mesh": 0, "placements": ["S0"], **tensor}
    mesh = {"shape": [2], "dim_names": ["tp"], "ranks": [0, 1]}
    return {"format": LAYOUT_FORMAT, "world_size": 2, "meshes": [mesh], "tensors": [t]}


@pytest.mark.parametrize(
    "tensor,match",
    [
        ({"dtype": "Tensor"}, r"tensor 'w': unknown dtype 'Tensor'"),
        ({"mesh": 1}, r"tensor 'w': mesh index 1 is not one of the document's 1 meshes"),
        ({"shape": ["4"]}, r"tensor 'w': shape must be an integer, got '4'"),
        ({"placements": "S0"}, r"tensor 'w': cannot parse placement 'S'"),
        ({"boxes": {"x": [[0, 2]]}}, r"tensor 'w': missing or malformed field \(ValueError: invalid literal"),
        ({"placements": ["S1"]}, r"tensor 'w' of shape \[4\]: placement S\(1\) is out of range"),
        ({"boxes": {"0": [[0, 9]]}}, r"tensor 'w': box \(\(0, 9\),\) of rank 0 lies outside shape \[4\]"),
    ],
)
def test_bad_tensor_entries_name_the_tensor(tensor, match):
    with pytest.raises(LayoutError, match=match):
        ModelLayout.from_json(_doc(**tensor))


def test_bad_ranks_are_refused():
    doc = _doc()
    doc["world_size"] = 1
    with pytest.raises(LayoutError, match=r"tensor 'w' places data on ranks \[1\] outside 0..0"):
        ModelLayout.from_json(doc)
    doc = _doc()
    doc["meshes"][0]["ranks"] = [0, 0]
    with pytest.raises(LayoutError, match=r"refit.layout/1 layout document: mesh 0: mesh ranks repeat"):
        ModelLayout.from_json(doc)
    doc["world_size"] = "2"
    with pytest.raises(LayoutError, match=r"refit.layout/1 layout document: world_size must be an integer, got '2'"):
        ModelLayout.from_json(doc)


@pytest.mark.parametrize("fp8", [[], ["--fp8", "32"]])
def test_plan_json_holds_the_planners_layouts(capsys, fp8):
    from refit.plan import build_plan
    from refit.quant import fp8_layout as quantize

    args = ["plan", "--model", "tiny-qwen3-moe", "--src", "pp=2,ep=2", "--dst", "tp=2,dp=2", "--json", *fp8]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    src_l = layout_from_spec(param_shapes("tiny-qwen3-moe"), parse_spec("pp=2,ep=2", "src"))
    dst_l = layout_from_spec(param_shapes("tiny-qwen3-moe"), parse_spec("tp=2,dp=2", "dst"))
    if fp8:
        src_l, dst_l = quantize(src_l, block=(32, 32)), quantize(dst_l, block=(32, 32), side="destination")
    src, dst = ModelLayout.from_json(out["src_layout"]), ModelLayout.from_json(out["dst_layout"])
    assert (src, dst) == (src_l, dst_l)
    assert build_plan(src, dst).digest == out["digest"]


def test_mesh_from_json_keeps_rank_order():
    m = Mesh((2, 2), ("a", "b"), (3, 1, 2, 0))
    t = TensorLayout("x", (4, 4), torch.float16, m, (Shard(0), Replicate()))
    back = _round_trip(ModelLayout((t,), 4))
    assert back["x"].mesh.ranks == (3, 1, 2, 0) and back["x"].box(3) == ((0, 2), (0, 4))
