import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from refit.layout import ModelLayout, box_slices
from refit.tools.cli import main


def _run(*args, timeout=300, cwd=None):
    """The installed command in a fresh interpreter (``bench``: the harness it imports ships in the package)."""
    return subprocess.run(
        [sys.executable, "-m", "refit.tools.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def _main(capsys, *args) -> tuple[int, str, str]:
    """``refit ARGS`` in this process (its ranks fork from the launcher's warm forkserver): exit code, stdout,
    stderr. The installed command's own start is checked by ``test_inputs`` and ``_run``."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "src,dst",
    [
        ("tp=2", "tp=1,dp=2"),
        ("fsdp=2", "tp=2"),
        ("tp=2,pp=2", "tp=4"),
        ("dp=2,tp=2", "tp=1,dp=4"),
        ("fsdp=4", "tp=2,dp=2"),
        ("tp=2", "tp=2"),
    ],
)
def test_plan_json(capsys, src, dst):
    assert main(["plan", "--model", "llama-3.1-8b", "--src", src, "--dst", dst, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"tensors", "bytes_needed", "bytes_moved", "ratio", "digest", "links"} <= set(out)
    assert out["tensors"] == 291
    assert out["ratio"] == 1.0
    assert sum(b for row in out["links"].values() for b in row.values()) == out["bytes_moved"]


def test_plan_table(capsys):
    assert main(["plan", "--model", "tiny-llama", "--src", "tp=2", "--dst", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "moved/needed" in out and "1.00" in out and "digest" in out


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--src", "tp=2,xx=2"], "unknown key 'xx'"),
        (["--dst", "tp=2,pp=2"], "unknown key 'pp'"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--src", "tp=2", "--src-ranks", "3"], "needs tp=2 = 2 ranks, but 3 are given"),
        (["--dst", "tp=3", "--dst-ranks", "4"], "needs tp=3 = 3 ranks, but 4 are given"),
        (["--src", "pp=5"], "pp=5 exceeds the model's 4 decoder layers"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, msg):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("refit: error:") and msg in err


def test_demo_bad_tp_degree_exit_2(capsys):
    assert main(["demo", "--src", "tp=3"]) == 2
    assert "tp=3 must divide num_attention_heads=4" in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_verify_dump_can_be_rechecked_independently(tmp_path, capsys):
    code, out, err = _main(
        capsys, "verify", "--model", "tiny-qwen3", "--src", "tp=2,pp=2", "--dst", "tp=2,dp=2", "--dump", str(tmp_path)
    )
    assert code == 0, out + err
    last = out.strip().splitlines()[-1]
    assert last.startswith("verified 47 tensors on 4 ranks,") and last.endswith("moved/needed=1.00")
    full = load_file(tmp_path / "full.safetensors")
    layouts = json.loads((tmp_path / "layout.json").read_text())  # refit.layout/1, docs/layout-json.md
    src, dst = ModelLayout.from_json(layouts["src"]), ModelLayout.from_json(layouts["dst"])
    assert (src.world_size, dst.world_size, len(src), len(dst)) == (4, 4, 47, 47)
    shards = {d: load_file(tmp_path / f"dst_rank{d}.safetensors") for d in range(4)}
    checked = 0
    for t in dst:
        assert (full[t.name] != 0).all()
        for d in t.mesh.ranks:
            assert torch.equal(shards[d][t.name], full[t.name][box_slices(t.box(d))])
            checked += 1
    assert checked == 47 * 4


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_demo_passes_with_zero_delta(capsys):
    code, out, err = _main(capsys, "demo")
    assert code == 0, out + err
    lines = out.strip().splitlines()
    assert lines[-1].startswith("PASS")
    rows = [ln for ln in lines if ln.startswith("│")]
    assert len(rows) == 3
    assert all(ln.split("│")[5].strip() == "0" for ln in rows)  # max |delta logit|


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,src,dst", [("tiny-qwen3", "tp=2", "tp=2"), ("tiny-llama", "pp=2", "tp=2,dp=2")])
def test_demo_other_layouts(model, src, dst, capsys):
    code, out, err = _main(capsys, "demo", "--model", model, "--src", src, "--dst", dst, "--steps", "2")
    assert code == 0, out + err
    assert out.strip().splitlines()[-1].startswith("PASS")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_bench_cpu_writes_records(tmp_path):
    # run outside the repository: the harness ships in the package (refit.tools.bench), no checkout needed
    out = tmp_path / "cpu.json"
    r = _run(
        "bench",
        "--device",
        "cpu",
        "--iters",
        "3",
        "--growth-iters",
        "3",
        "--warmup",
        "1",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    keys = {
        "scenario",
        "method",
        "model",
        "bytes",
        "median_s",
        "min_s",
        "max_s",
        "floor_s",
        "ratio_to_floor",
        "peak_extra_bytes",
        "correct",
        "command",
        "date",
    }
    assert all(keys <= set(row) for row in rows)
    methods = {(row["scenario"], row["method"]) for row in rows}
    assert {
        ("S1", "refit"),
        ("S1", "per_tensor_broadcast"),
        ("S1", "floor"),
        ("S3", "refit"),
        ("S6", "refit_fanout"),
    } <= methods
    assert all(row["correct"] for row in rows if row["method"] != "floor")
    assert all(row["min_s"] <= row["median_s"] <= row["max_s"] for row in rows)


def test_bench_rejects_unknown_scenario(capsys):
    assert main(["bench", "--device", "cpu", "--scenarios", "S9"]) == 2
    assert "unknown scenario(s) ['S9']" in capsys.readouterr().err


def test_bench_methods_are_checked_and_keep_the_floor(capsys):
    assert main(["bench", "--device", "cpu", "--scenarios", "S1", "--methods", "refit,gather"]) == 2
    err = capsys.readouterr().err
    assert "--methods: unknown method(s) ['gather'] for scenarios ['S1']" in err and "'refit_checksums'" in err
    from refit.tools.bench.scenarios import only_methods, scenarios

    s1 = scenarios("cpu")["S1"]
    assert only_methods(s1, ("refit",)).methods == ("refit", "floor")
    assert only_methods(s1, ()).methods == s1.methods


@pytest.mark.timeout(180)
def test_verify_inject_exits_0_when_the_fault_is_handled_and_says_so_last(capsys):
    assert main(["verify", "--inject", "corrupt", "--deadline", "5"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("DETECTED corrupt: ") and "checksum mismatch" in last
    assert last.endswith("engines: process 2: v1 (bit-exact), process 3: v1 (bit-exact)")


def test_verify_inject_unknown_mode_and_soak_bad_warmup_are_usage_errors(capsys):
    assert main(["verify", "--inject", "unplug"]) == 2
    assert "--inject must be one of kill-receiver, kill-sender, corrupt" in capsys.readouterr().err
    assert main(["soak", "--refits", "10", "--warmup", "10"]) == 2
    assert "--warmup" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,flag,value",
    [
        (["plan", "--buffer-mb", "nan"], "--buffer-mb", "nan"),
        (["plan", "--buffer-mb", "inf"], "--buffer-mb", "inf"),
        (["plan", "--buffer-mb", "-1"], "--buffer-mb", "-1"),
        (["plan", "--buffer-mb", "0.00001"], "--buffer-mb", "1e-05"),
        (["plan", "--num-buffers", "0"], "--num-buffers", "0"),
        (["plan", "--bandwidth", "0"], "--bandwidth", "0"),
        (["plan", "--bandwidth", "-10"], "--bandwidth", "-10"),
        (["plan", "--bandwidth", "nan"], "--bandwidth", "nan"),
        (["plan", "--model", "no-such-model"], "--model", "no-such-model"),
        (["plan", "--src", "tp=2,xx=2"], "--src", "tp=2,xx=2"),
        (["plan", "--dst", "tp=two"], "--dst", "tp=two"),
        (["plan", "--fp8", "0"], "--fp8", "0"),
        (["plan", "--changed-fraction", "1.5"], "--changed-fraction", "1.5"),
        (["plan", "--changed-fraction", "-0.1"], "--changed-fraction", "-0.1"),
        (["plan", "--changed-fraction", "0.01"], "--changed-fraction", "0.01"),
        (["demo", "--steps", "0"], "--steps", "0"),
        (["demo", "--src", "tp=3"], "--src", "tp=3"),
        (["verify", "--inject", "corrupt", "--deadline", "0"], "--deadline", "0"),
        (["verify", "--inject", "corrupt", "--deadline", "inf"], "--deadline", "inf"),
        (["verify", "--inject", "unplug"], "--inject", "unplug"),
        (["soak", "--refits", "10", "--warmup", "10"], "--warmup", "10"),
        (["bench", "--device", "cpu", "--buffer-mb", "nan"], "--buffer-mb", "nan"),
        (["bench", "--device", "cpu", "--num-buffers", "0"], "--num-buffers", "0"),
        (["bench", "--device", "cpu", "--copy-streams", "0"], "--copy-streams", "0"),
        (["bench", "--device", "cpu", "--stages", "0"], "--stages", "0"),
        (["bench", "--device", "cpu", "--iters", "0"], "--iters", "0"),
        (["bench", "--device", "cpu", "--model", "no-such-model"], "--model", "no-such-model"),
        (["bench", "--device", "cpu", "--scenarios", "S9"], "--scenarios", "S9"),
    ],
)
def test_user_error_is_one_line_naming_the_flag_and_value_exit_2(capsys, argv, flag, value):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("refit: error: ") and flag in lines[0] and value in lines[0], lines[0]
    assert "Traceback" not in err


def test_bench_without_a_gpu_is_a_user_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "refit: error: --device cuda: no CUDA device is available"


@pytest.mark.parametrize(
    "content,flag,says",
    [
        ("[1, 2]", "--model", "must hold a JSON object, got a list"),
        ("{}", "--model", "has no 'model_type' field"),
        ('{"model_type": "nonesuch"}', "--model", "unknown model_type 'nonesuch'"),
        (
            '{"model_type": "llama", "hidden_size": -8, "num_hidden_layers": 2, "num_attention_heads": 4}',
            "--model",
            "hidden_size must be an integer >= 1, got -8",
        ),
        ('{"model_type": "llama", "num_hidden_layers": -2}', "--model", "num_hidden_layers must be an integer >= 1"),
        ("[1]", "--cluster", "must hold a JSON object of fields, got a list"),
    ],
)
def test_bad_config_files_are_one_short_line_and_exit_2(tmp_path, capsys, content, flag, says):
    path = tmp_path / "bad.json"
    path.write_text(content)
    argv = ["plan", "--model", str(path)] if flag == "--model" else ["plan", "--cluster", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"refit: error: {flag}: ") and says in err, err
    assert len(err.splitlines()) == 1 and len(err) < 400 and "Traceback" not in err


def test_a_local_run_of_too_many_ranks_is_refused_before_any_process_starts(capsys, monkeypatch):
    from refit.tools import resources

    monkeypatch.setattr(resources, "available_memory", lambda: None)  # the memory guard would refuse it first
    assert main(["verify", "--src", "dp=100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "100002 processes on this machine, more than the limit of 256" in err, err
