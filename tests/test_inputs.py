"""Every user input is checked where it enters (issue 18): a bad one is exit status 2 and one line naming the
field, the value and what is allowed, before any process starts or any file is written."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch.multiprocessing

from refit.errors import ConfigError, SpecError
from refit.layout.models import load_config, param_shapes
from refit.layout.rules import check_spec_fits, layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools import resources
from refit.tools.cli import main, natural_int, positive_float, positive_int
from refit.tools.faults import InjectResult, plain_error

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}

CONFIGS = {  # config.json contents (model_type llama unless given), by the name the table uses
    "fp8-dtype": {**TINY, "torch_dtype": "float8_e4m3fn"},
    "int8-dtype": {**TINY, "torch_dtype": "int8"},
    "banana-dtype": {**TINY, "dtype": "banana"},
    "float-size": {**TINY, "hidden_size": 3.5},
    "string-size": {**TINY, "num_attention_heads": "abc"},
    "bool-size": {**TINY, "num_hidden_layers": True},
    "negative-heads": {**TINY, "num_attention_heads": -4},
    "zero-hidden": {**TINY, "hidden_size": 0},
    "negative-layers": {**TINY, "num_hidden_layers": -2},
    "odd-intermediate": {**TINY, "intermediate_size": 129},
    "empty": None,  # {}
}

# (argv, what the one line must contain); "CONFIG:<name>" is the path of that config.json
BAD = [
    (["plan", "--model", "CONFIG:fp8-dtype"], ["torch_dtype", "'float8_e4m3fn'", "float32, bfloat16, float16"]),
    (["plan", "--model", "CONFIG:int8-dtype"], ["torch_dtype", "'int8'", "bfloat16"]),
    (["verify", "--model", "CONFIG:banana-dtype"], ["dtype must be one of", "'banana'"]),
    (["plan", "--model", "CONFIG:float-size"], ["hidden_size must be an integer >= 1", "3.5"]),
    (["plan", "--model", "CONFIG:string-size"], ["num_attention_heads must be an integer >= 1", "'abc'"]),
    (["plan", "--model", "CONFIG:bool-size"], ["num_hidden_layers must be an integer >= 1", "True"]),
    (["plan", "--model", "CONFIG:negative-heads"], ["num_attention_heads must be an integer >= 1", "-4"]),
    (["plan", "--model", "CONFIG:zero-hidden"], ["hidden_size must be an integer >= 1", "got 0"]),
    (["plan", "--model", "CONFIG:negative-layers"], ["num_hidden_layers must be an integer >= 1", "-2"]),
    (["plan", "--model", "CONFIG:empty"], ["--model", "no 'model_type' field"]),
    (["plan", "--buffer-mb", "nan"], ["--buffer-mb", "'nan'", "finite number > 0"]),
    (["verify", "--buffer-mb", "inf"], ["--buffer-mb", "'inf'", "finite number > 0"]),
    (["soak", "--buffer-mb", "-1"], ["--buffer-mb", "'-1'", "> 0"]),
    (["demo", "--buffer-mb", "0"], ["--buffer-mb", "'0'", "> 0"]),
    (["bench", "--buffer-mb", "nan"], ["--buffer-mb", "'nan'"]),
    (["plan", "--bandwidth", "0"], ["--bandwidth", "'0'", "> 0"]),
    (["plan", "--bandwidth", "-10"], ["--bandwidth", "'-10'"]),
    (["verify", "--deadline", "nan"], ["--deadline", "'nan'"]),
    (["verify", "--seed", "-1"], ["--seed", "'-1'", ">= 0"]),
    (["soak", "--refits", "0"], ["--refits", "'0'", "integer >= 1"]),
    (["soak", "--warmup", "2.5"], ["--warmup", "'2.5'", "integer >= 1"]),
    (["demo", "--steps", "-1"], ["--steps", "'-1'"]),
    (["plan", "--num-buffers", "0"], ["--num-buffers", "'0'"]),
    (["plan", "--src-ranks", "0"], ["--src-ranks", "'0'"]),
    (["bench", "--iters", "inf"], ["--iters", "'inf'"]),
    (["bench", "--warmup", "-1"], ["--warmup", "'-1'", ">= 0"]),
    (["bench", "--copy-streams", "0"], ["--copy-streams", "'0'"]),
    (["plan", "--fp8", "0"], ["--fp8", "'0'"]),
    (["plan", "--model", "llama-3.1-8b", "--dst", "tp=3"], ["--dst tp=3:", "num_attention_heads=32", "tp=3"]),
    (["verify", "--model", "llama-3.1-8b", "--dst", "tp=64"], ["--dst tp=64:", "num_attention_heads=32"]),
    (["demo", "--src", "tp=3"], ["--src tp=3:", "num_attention_heads=4"]),
    (["soak", "--model", "tiny-qwen3-moe", "--src", "ep=3"], ["--src ep=3:", "num_experts=8"]),
    (["plan", "--model", "qwen3-30b-a3b", "--src", "etp=5"], ["--src etp=5:", "etp=5 must divide", "768"]),
    (
        ["demo", "--model", "CONFIG:odd-intermediate", "--src", "tp=2"],
        ["--src tp=2:", "tp=2 must divide dim 0 of model.layers.0.mlp.gate_proj.weight [129, 64]", "129"],
    ),
    (["verify", "--src", "tp=100000"], ["--src tp=100000:", "num_attention_heads=4"]),
]
# rows of BAD also run as a real `python -m refit.tools.cli` (exit status; no other line, e.g. a warning): one a
# subcommand and way in (a model config file for plan and demo, a spec for soak, a layout for verify); every row runs
# in-process above, and a fresh interpreter costs seconds
SUBPROCESS = (0, 31, 33, 34)


@pytest.fixture
def configs(tmp_path):
    paths = {}
    for name, fields in CONFIGS.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({} if fields is None else {"model_type": "llama", **fields}))
    return paths


@pytest.fixture
def nothing_starts(monkeypatch):
    """Starting a local run's processes fails the test."""

    def refuse(*a, **k):
        raise AssertionError("a process was to be started")

    monkeypatch.setattr(torch.multiprocessing, "get_context", refuse)


def _argv(argv, configs):
    return [str(configs[a.removeprefix("CONFIG:")]) if a.startswith("CONFIG:") else a for a in argv]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("refit: error: ")
    return lines[0]


@pytest.mark.parametrize("argv,says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_before_anything_starts(argv, says, configs, capsys, nothing_starts):
    assert main(_argv(argv, configs)) == 2
    line = _one_line(capsys.readouterr().err)
    assert all(s in line for s in says), line


@pytest.mark.parametrize("row", SUBPROCESS, ids=[" ".join(BAD[i][0]) for i in SUBPROCESS])
def test_the_installed_command_exits_2_with_one_line(row, configs):
    argv, says = BAD[row]
    r = subprocess.run(
        [sys.executable, "-m", "refit.tools.cli", *_argv(argv, configs)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    line = _one_line(r.stderr)
    assert all(s in line for s in says), line


@pytest.mark.parametrize("parse,text", [(positive_int, "1"), (natural_int, "0"), (positive_float, "1e-3")])
def test_number_types_take_the_least_allowed_value(parse, text):
    assert parse(text) == float(text)


@pytest.mark.parametrize("parse,text", [(positive_int, "0"), (natural_int, "-1"), (positive_float, "-inf")])
def test_number_types_refuse_naming_the_value(parse, text):
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        parse(text)


@pytest.mark.parametrize(
    "model,side,spec",
    [
        ("llama-3.1-8b", "dst", "tp=8,dp=2"),
        ("qwen3-30b-a3b", "src", "pp=2,ep=4,tp=2"),
        ("qwen3-30b-a3b", "dst", "ep=8,tp=4"),
        ("tiny-mixtral", "src", "ep=2,etp=2"),
        ("deepseek-v3", "src", "ep=8,tp=8"),
        ("tiny-qwen2-moe", "dst", "tp=2"),
    ],
)
def test_specs_real_engines_and_trainers_run_fit(model, side, spec):
    check_spec_fits(param_shapes(model), parse_spec(spec, side), load_config(model))


def test_an_uneven_vocab_fits_and_uneven_layouts_still_build(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **TINY, "vocab_size": 1001}))
    spec = parse_spec("tp=2", "dst")
    check_spec_fits(param_shapes(str(path)), spec, load_config(str(path)))  # 1001 rows: chunks of 501 and 500
    with pytest.raises(SpecError, match="tp=3 must divide num_attention_heads=4"):
        check_spec_fits(param_shapes("tiny-llama"), parse_spec("tp=3", "src"), load_config("tiny-llama"))
    assert len(layout_from_spec(param_shapes("tiny-llama"), parse_spec("tp=3", "src"))) > 0  # the planner's tests


@pytest.mark.parametrize(
    "argv,what",
    [
        (
            ["verify", "--model", "llama-3.1-8b", "--src", "tp=1", "--dst", "tp=1"],
            "verify on 2 processes needs at least 44.9 GiB",
        ),
        (
            ["soak", "--model", "llama-3.1-8b", "--src", "tp=1", "--dst", "tp=1"],
            "soak on 2 processes needs at least 29.9 GiB",
        ),
        (
            ["demo", "--model", "llama-3.1-8b", "--src", "tp=1", "--dst", "tp=1"],
            "demo on 2 processes needs at least 89.7 GiB",
        ),
        (
            ["verify", "--model", "llama-3.1-8b", "--src", "tp=1", "--dst", "tp=1", "--inject", "corrupt"],
            "verify --inject on 2 processes needs at least 44.9 GiB",
        ),
    ],
)
def test_a_run_larger_than_memory_is_refused_with_both_numbers(argv, what, capsys, monkeypatch, nothing_starts):
    monkeypatch.setattr(resources, "available_memory", lambda: 8 << 30)
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert what in line and "this machine has 8.0 GiB available" in line, line


def test_too_many_processes_are_refused_before_any_starts(capsys, monkeypatch, nothing_starts):
    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 50)
    assert main(["verify", "--src", "dp=300", "--dst", "tp=1"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "300 trainer + 1 engine ranks need 301 processes on this machine, more than the limit of 256" in line


def test_held_bytes_counts_each_replica():
    shapes = param_shapes("tiny-llama")
    whole = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    assert resources.held_bytes(layout_from_spec(shapes, parse_spec("dp=3", "dst"))) == 3 * whole.nbytes
    assert resources.held_bytes(layout_from_spec(shapes, parse_spec("tp=2", "dst"))) > whole.nbytes  # norms twice


def test_memory_check_names_both_numbers(monkeypatch):
    have = resources.available_memory()
    assert have is None or have > 0  # read from this machine
    monkeypatch.setattr(resources, "available_memory", lambda: 2 << 30)
    resources.check_memory(2 << 30, "a run")
    with pytest.raises(ConfigError, match=r"a run needs at least 3\.0 GiB of memory, but this machine has 2\.0 GiB"):
        resources.check_memory(3 << 30, "a run")


def test_dump_onto_a_file_or_over_its_files_is_refused_and_nothing_is_written(tmp_path, capsys, nothing_starts):
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"keep")
    assert main(["verify", "--dump", str(a_file)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("refit: error: --dump: ") and str(a_file) in line and "is a file" in line
    assert a_file.read_bytes() == b"keep"

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "dst_rank1.safetensors").write_bytes(b"old")
    assert main(["verify", "--dump", str(folder)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--dump" in line and "already holds dst_rank1.safetensors" in line, line
    assert (
        sorted(os.listdir(folder)) == ["dst_rank1.safetensors"]
        and (folder / "dst_rank1.safetensors").read_bytes() == b"old"
    )


GLOO = (
    "refit of version 2 aborted: process 3: RuntimeError: transfer with process 1 (step 0, tensors "
    "model.embed_tokens.weight) failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:26498. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)


def test_injected_faults_are_told_in_refits_words():
    assert plain_error(GLOO) == (
        "refit of version 2 aborted: process 3: RuntimeError: transfer with process 1 (step 0, tensors "
        "model.embed_tokens.weight) failed: Connection closed by peer [127.0.0.1]:26498."
    )
    engine = {"role": "engine", "error": GLOO, "elapsed_s": 0.1, "version": 1, "v1_exact": True}
    rows = [{**engine, "role": "trainer", "v1_exact": None}, None, engine, engine]
    rows = [
        None if r is None else {**r, "rank": p % 2, "retried_version": None, "v2_exact_after_retry": None}
        for p, r in enumerate(rows)
    ]
    line = InjectResult("kill-sender", 1, rows, 3.0).last_line()
    assert line.startswith("DETECTED kill-sender: trainer process 1 was killed half way through version 2; ")
    assert "GLHF" not in line and "pair.cc" not in line
    assert line.endswith("| trainer process 1: dead | engines: process 2: v1 (bit-exact), process 3: v1 (bit-exact)")


def test_cuda_tensors_over_a_gloo_p2p_group_are_refused_at_setup():
    # gloo's send/recv reads host memory: handed CUDA tensors, the process aborts inside gloo (seen on 2
    # H100s as "writev ... Bad address" and SIGABRT). The executor refuses that pairing before any op.
    import torch.distributed as dist

    from refit.layout.models import param_shapes
    from refit.layout.rules import layout_from_spec
    from refit.layout.spec import parse_spec
    from refit.plan import build_plan
    from refit.transport.p2p import check_backend

    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes("tiny-llama")]
    plan = build_plan(
        layout_from_spec(shapes, parse_spec("tp=1", "src")), layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    )
    assert any(m.transport == "p2p" for m in plan.messages)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    with pytest.raises(ConfigError, match=r"process 0: the plan sends CUDA tensors .* over P2P, but .*gloo"):
        check_backend(plan, 0, torch.device("cuda", 0), group, True)
    check_backend(plan, 0, torch.device("cpu"), group, True)  # CPU: gloo is right
