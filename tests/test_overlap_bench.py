"""``python -m bench.overlap_gpu`` (issue 21's GPU scenario) on the CPU with a tiny model: the same code the
GPU run takes, so that run cannot die on a typo; its bad input is refused with exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "bench.overlap_gpu", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_overlap_bench_runs_on_cpu_and_reports_the_three_modes(tmp_path):
    out = tmp_path / "r.json"
    r = _bench("--device", "cpu", "--model", "tiny-llama", "--iters", "2", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    s = res["summary"]
    for mode, n in (("overlap", 2), ("stop_the_world", 2), ("swap", 4)):
        assert s[mode]["exact"] and s[mode]["n"] == n, s  # every refit: the forward reads exactly its version
        assert s[mode]["stall_s"] > 0 and s[mode]["forward_s"] > 0
    assert s["overlap"]["copy_s"] > 0 and s["stall_over_copy"] > 0 and s["swap_stall_over_copy"] > 0
    assert "copy_s" not in s["swap"] and s["swap"]["commit_s"] >= 0
    assert len(res["rows"]) == 4 * 3  # one warm-up and two timed iterations of overlap, stop-the-world, swap x 2
    assert [r["set"] for r in res["rows"] if r["mode"] == "swap"] == [1, 0] * 3  # B, then back to A
    for mode in ("overlap", "stop_the_world", "swap"):
        assert f" {mode}: stall " in r.stdout
    assert "stop-the-world stall / swap stall" in r.stdout and res["forward"] == "eager"


@pytest.mark.parametrize(
    "args,says",
    [
        (["--iters", "0"], "--iters must be >= 1, got 0"),
        (["--device", "cpu", "--scenario", "S1"], "needs two GPUs"),
        (["--model", "no-such-model"], "invalid choice: 'no-such-model'"),
    ],
)
def test_overlap_bench_refuses_bad_input(args, says, capsys):
    from bench.overlap_gpu import parse_args  # in this process: argparse's refusal, before anything starts

    with pytest.raises(SystemExit) as e:
        parse_args(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err[-1000:]
