"""EPLB engines: physical expert slots placed by a map that changes between refits (``refit.layout.eplb``,
``refit.eplb``, ``refit plan|verify --expert-map``)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from refit.config import TransferConfig
from refit.errors import LayoutError
from refit.layout.engines import engine_layout
from refit.layout.eplb import ExpertMap, eplb_layouts, slot_name
from refit.layout.megatron import megatron_layout
from refit.layout.models import load_config, param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.tools.cli import main

MODEL = "tiny-qwen3-moe"  # Qwen3-MoE-shaped: 8 experts of [2, 64, 128] and [128, 64], 4 MoE layers
EXPERTS, LAYERS = 8, 4
EXPERT_BYTES = (2 * 64 * 128 + 128 * 64) * 4  # one logical expert of one layer: gate_up + down, fp32

# 2 redundant slots per EP rank; the first row of each puts expert 3 twice on EP rank 0 (a replica on one rank)
ROW_EP4 = [3, 3, 0, 1, 2, 4, 5, 3, 6, 7, 3, 0, 1, 2, 5, 6]
ROW_EP2 = [3, 3, 0, 1, 2, 4, 5, 6, 7, 3, 0, 1]


@functools.cache
def _shapes():
    return param_shapes(MODEL)


def _src(spec: str):
    return layout_from_spec(_shapes(), parse_spec(spec, "src"))


def _dst(spec: str):
    return engine_layout(_shapes(), parse_spec(spec, "dst"), load_config(MODEL))


def _map(first: list[int], seed: int) -> ExpertMap:
    """``first`` for MoE layer 0, then random rows with every expert and ``len(first) - 8`` hot replicas."""
    g = torch.Generator().manual_seed(seed)
    rows = [first]
    for _ in range(LAYERS - 1):
        hot = torch.randint(0, EXPERTS, (len(first) - EXPERTS,), generator=g)
        row = torch.cat([torch.arange(EXPERTS), hot])
        rows.append(row[torch.randperm(len(row), generator=g)].tolist())
    return ExpertMap(rows, num_redundant=len(first) - EXPERTS)


def _needed(src, dst, redundant: int) -> int:
    """What the engine holds: the logical model once, plus each redundant slot's expert once more."""
    return build_plan(src, dst).bytes_needed + LAYERS * redundant * EXPERT_BYTES


def test_slots_are_tensors_held_where_the_map_puts_them_and_counted_once_per_slot():
    src, dst = _src("ep=2"), _dst("ep=4")
    m = _map(ROW_EP4, 1)
    lay = eplb_layouts(src, dst, m)
    base = "model.layers.0.mlp.experts.gate_up_proj"
    assert base not in lay.dst.names and base not in lay.src.names
    s0, s1 = lay.dst[slot_name(base, 0, 3)], lay.dst[slot_name(base, 1, 3)]
    assert s0.shape == (1, 2, 64, 128) and s0.ranks == s1.ranks == (0,)  # expert 3 twice on engine rank 0
    assert lay.dst[slot_name(base, 15, 6)].ranks == (3,)
    assert lay.src[slot_name(base, 15, 6)].ranks == (1,)  # experts 4-7 are on trainer rank 1
    assert lay.dst_shapes(2)[base] == (4, 2, 64, 128)  # 16 slots over ep=4
    plan = build_plan(lay.src, lay.dst)
    assert plan.bytes_needed == plan.bytes_moved == _needed(src, dst, 8)
    # the map is in the plan: another map, another digest; the same map, the same one
    assert plan.digest != build_plan(*_pair(src, dst, _map(ROW_EP4, 2))).digest
    assert plan.digest == build_plan(*_pair(src, dst, _map(ROW_EP4, 1))).digest
    assert m.logical_to_physical(0)[3] == [0, 1, 7, 10]
    assert ExpertMap(torch.tensor(m.physical_to_logical)).digest == m.digest  # vLLM's physical_to_logical_map


@pytest.mark.parametrize("dst_spec,copies", [("ep=2,tp=2", 1), ("dp=2,ep=2", 2)])
def test_expert_tp_shares_a_slot_and_dp_replicas_each_receive_it(dst_spec, copies):
    from refit.plan.planner import check_coverage

    src, dst = _src("tp=2"), _dst(dst_spec)
    lay = eplb_layouts(src, dst, _map(ROW_EP2, 7))
    slot = lay.dst[slot_name("model.layers.0.mlp.experts.down_proj", 11, 1)]  # EP rank 1's last slot
    if copies == 1:  # expert TP: ranks 2 and 3 hold half of I each
        assert {r: slot.box(r) for r in slot.ranks} == {2: ((0, 1), (0, 128), (0, 32)), 3: ((0, 1), (0, 128), (32, 64))}
    else:  # two engine replicas: each holds the whole slot
        assert len(slot.ranks) == 2 and all(slot.box(r) == ((0, 1), (0, 128), (0, 64)) for r in slot.ranks)
    plan = build_plan(lay.src, lay.dst)
    check_coverage(lay.dst, [p for m in plan.messages for p in m.pieces] + list(plan.local))
    assert plan.bytes_needed == plan.bytes_moved == _needed(src, dst, 4 * copies)


def _pair(src, dst, m):
    lay = eplb_layouts(src, dst, m)
    return lay.src, lay.dst


def test_views_of_megatron_parts_and_physical_tensors_are_the_slots_rows():
    from refit.layout import box_shape
    from refit.layout.eplb import moe_layers

    src = megatron_layout(_shapes(), parse_spec("ep=2", "src"), load_config(MODEL))
    dst = _dst("ep=2")
    lay = eplb_layouts(src, dst, _map(ROW_EP2, 3))
    stacked = [t for layer in moe_layers(src) for t in layer]
    # Megatron: one tensor per local expert (its ``parts``), each holding its expert's id
    held = {t.name: [torch.full(box_shape(p), float(p[0][0])) for p in t.parts(1)] for t in stacked}
    base = "model.layers.0.mlp.experts.down_proj"
    views = lay.src_tensors(1, held)
    assert views[slot_name(base, 7, 6)].data_ptr() == held[base][2].data_ptr()  # slot 7 holds expert 6: no copy
    assert all(torch.all(x == lay.slots[n].expert) for n, x in views.items())
    phys = {t.name: torch.zeros(lay.physical_shape(t.name, 1)) for t in stacked}
    dviews = lay.dst_tensors(1, phys)
    assert dviews[slot_name(base, 9, 3)].data_ptr() == phys[base][3].data_ptr()  # slot 9 is rank 1's 4th
    assert len(dviews) == len(stacked) * 6
    with pytest.raises(LayoutError, match=r"physical expert tensor .* has shape \[4, 128, 64\], expected \[6"):
        lay.dst_tensors(1, {**phys, base: torch.zeros(4, 128, 64)})


@pytest.mark.parametrize(
    "doc,match",
    [
        ({"physical_to_logical": [ROW_EP4] * 3}, "expert map has 3 rows; the model has 4 MoE layers"),
        ({"physical_to_logical": [ROW_EP4] * 3 + [ROW_EP4[:-1]]}, "row 3 has 15 physical slots, row 0 has 16"),
        ({"physical_to_logical": [[*ROW_EP4[:-1], 8]] * 4}, "row 0 slot 15 holds expert 8; the model has experts 0-7"),
        ({"physical_to_logical": [[0] * 16] * 4}, "row 0 holds no slot of expert 1"),
        ({"physical_to_logical": [ROW_EP4] * 4, "num_redundant_experts": 2}, "num_redundant_experts says 2"),
        ({"physical_to_logical": [ROW_EP4[:-2] + [0]] * 4}, "ep=4 must divide its 15 physical slots"),
        ({"physical_to_logical": [[*ROW_EP4[:-1], -1]] * 4}, "row 0 slot 15 must be an integer >= 0, got -1"),
        ({"physical_to_logical": [[*ROW_EP4[:-1], True]] * 4}, "must be an integer >= 0, got True"),
        ({"physical_to_logical": [ROW_EP4] * 4, "num_redundant": 8}, "unknown field 'num_redundant'"),
        ({"physical_to_logical": "0,1"}, "must be a non-empty list of rows"),
    ],
)
def test_a_bad_expert_map_is_one_line_and_exit_2(tmp_path, capsys, doc, match):
    path = tmp_path / "map.json"
    path.write_text(json.dumps(doc))
    assert main(["plan", "--model", MODEL, "--src", "ep=2", "--dst", "ep=4", "--expert-map", str(path)]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err


def test_plan_takes_the_map_as_json(tmp_path, capsys):
    path = tmp_path / "map.json"
    m = _map(ROW_EP4, 1)
    path.write_text(json.dumps(m.to_json()))
    argv = ["plan", "--model", MODEL, "--src", "ep=2", "--dst", "ep=4", "--expert-map", str(path)]
    assert main([*argv, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["expert_map"] == m.digest
    assert info["bytes_needed"] == info["bytes_moved"] == _needed(_src("ep=2"), _dst("ep=4"), 8)
    assert main([*argv, "--fp8"]) == 2
    assert "--expert-map and --fp8 together are not supported" in capsys.readouterr().err


def _sessions():
    from refit.tools.eplb_cli import Session

    m1, m2, m3 = _map(ROW_EP4, 1), _map(ROW_EP4, 2), _map(ROW_EP4, 3)
    n1, n2 = _map(ROW_EP2, 4), _map(ROW_EP2, 5)
    all6, first4 = ProcessMap.disjoint(2, 4), ProcessMap((0, 1), (2, 3))
    return [
        Session(_src("ep=2"), _dst("ep=4"), all6, (m1, m2, m1)),  # back to m1: its plan is re-used
        Session(_src("tp=2"), _dst("ep=2"), first4, (n1, n2, n1), commit="staged"),
        Session(_src("fsdp=2"), _dst("ep=4"), all6, (m2, m3, m2), delta="sparse"),  # m2's slots rewritten by m3
        Session(_src("ep=2"), _dst("ep=2"), first4, (n2,), src_maps=(n1,)),  # the trainer's map is another
    ]


@pytest.mark.timeout(300)
def test_every_physical_slot_is_exact_after_each_refit_as_the_map_changes():
    """One job of 2 trainer and 4 engine processes (CPU, gloo): trainer ep=2, tp=2 and fsdp=2 into engine ep=2 and
    ep=4 with 2 redundant slots per EP rank, the map changing between versions; a plan per distinct map; in place,
    staged and sparse-delta commits (the delta one back on a map whose slots another map rewrote meanwhile)."""
    from refit.tools.eplb_cli import eplb_worker
    from refit.tools.launch import run_local

    sessions = _sessions()
    out = run_local(eplb_worker, 2, 4, sessions, 0, TransferConfig(), backend="gloo", timeout_s=280)
    for i, (s, want_plans) in enumerate(zip(sessions[:3], (2, 2, 2))):
        needed = _needed(s.src, s.dst, s.maps[0].num_physical - EXPERTS)
        members = (*s.procs.src, *s.procs.dst)
        for p in members:
            rec = out[p][i]
            assert rec["error"] is None and rec["plans_built"] == want_plans, (i, p, rec["error"])
            assert [r["map"] for r in rec["rows"]] == [m.digest for m in s.maps]
            for r in rec["rows"]:
                assert r["bytes_moved"] == r["bytes_needed"] == needed, (i, p, r["version"])
                if p in s.procs.dst:
                    assert r["mismatches"] == [] and r["bytes_checked"] > 0, (i, p, r["mismatches"][:2])
        assert all(out[p][i] is None for p in range(6) if p not in members)
        checked = sum(out[p][i]["rows"][0]["bytes_checked"] for p in s.procs.dst)
        assert checked == needed  # every byte the engine holds, each physical slot included, was compared
    mine, theirs = sessions[3].maps[0].digest, sessions[3].src_maps[0].digest
    for p in (0, 1, 2, 3):
        err = out[p][3]["error"]
        assert err is not None and "PlanError" in err and mine in err and theirs in err, err
        assert out[p][3]["rows"] == []


@pytest.mark.timeout(300)
def test_verify_takes_the_map(tmp_path, capsys):
    path = tmp_path / "map.json"
    path.write_text(json.dumps(_map(ROW_EP2, 6).to_json()))
    argv = ["verify", "--model", MODEL, "--src", "tp=2", "--dst", "ep=2", "--expert-map", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "EPLB map" in out and "verified 135 tensors on 2 ranks" in out and "moved/needed=1.00" in out, out
