"""``refit`` of every subcommand run against hostile and careless inputs: each must exit 2 with exactly
one line on stderr (``refit: error: ...``), no traceback, within 30 s, under a bounded address space.

Absurd model sizes (a billion layers, a 10^40 hidden size, a petabyte vocabulary), worlds of a million
ranks, JSON nested 100,000 deep, devices, FIFOs and sparse 100 GiB files where a file is expected,
secrets that are ``/dev/zero``, a FIFO, a symlink, readable by others, padded or holding control
characters, nonsense numbers. Each would once have hung, filled memory or ended in a traceback.

Speed: importing refit (torch, transformers) takes seconds, so a driver process imports the command
line and the modules its commands import lazily once (building a preset's shapes) and forks one child
per input, two at a time (``_DRIVER``); each child sets ``RLIMIT_AS``,
sends its stdout/stderr to files and runs ``refit.tools.cli.main``; the driver kills a child still
running after 30 s and reports its exit status, output and peak resident memory (``wait4``). A few
inputs also go through a fresh ``python -m refit.tools.cli`` process, so import-time output counts too.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from refit.layout.models import _TINY

LIMIT_S = 30
EXTRA_ADDRESS_SPACE = 4 << 30  # a child may map this much beyond what the driver had mapped when it forked
MAX_RSS = 3 << 30  # and must stay below this resident

_DRIVER = r"""
import json, os, resource, select, signal, sys, time, traceback
import refit.tools.cli as cli
import refit.cost, refit.tools.bench.harness, refit.tools.resources  # what the commands import lazily
from refit.layout.models import build_model, load_config
# transformers' config and model modules, imported once here, not in every child (param_shapes may read its cache)
build_model(load_config("tiny-llama"), None, device="meta", seed=None)

def vm_size():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))

cases, (limit_s, extra) = json.loads(sys.stdin.read()), json.loads(sys.argv[1])
out_dir = sys.argv[2]
budget = vm_size() + extra

def child(i, case):
    for k, v in case["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out_dir, f"{i}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
    resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
    try:
        rc = cli.main(case["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(rc)

running, results, todo = {}, {}, list(enumerate(cases))
while todo or running:
    while todo and len(running) < 2:
        i, case = todo.pop(0)
        pid = os.fork()
        if pid == 0:
            child(i, case)
        running[pid] = (i, time.monotonic())
    pid, status, usage = os.wait4(-1, os.WNOHANG)
    if pid == 0:
        for p, (i, t0) in list(running.items()):
            if time.monotonic() - t0 > limit_s:
                os.kill(p, signal.SIGKILL)
                results[i] = {"killed": True}
        time.sleep(0.02)
        continue
    i, t0 = running.pop(pid)
    read = lambda name: open(os.path.join(out_dir, f"{i}.{name}"), errors="replace").read()
    results.setdefault(i, {}).update(
        rc=os.waitstatus_to_exitcode(status), out=read("out"), err=read("err"), maxrss=usage.ru_maxrss * 1024
    )
print(json.dumps([results[i] for i in range(len(cases))]))
"""


def _write_json(path: Path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def _model(tmp: Path, name: str, **changes) -> str:
    cfg = {**_TINY, "model_type": "llama", **changes}
    return _write_json(tmp / f"{name}.json", {k: v for k, v in cfg.items() if v is not None})


def _files(tmp: Path) -> dict[str, str]:
    """The hostile files the inputs name."""
    f = {
        "layers": _model(tmp, "layers", num_hidden_layers=10**9),
        "hidden12": _model(tmp, "hidden12", hidden_size=10**12),
        "inter62": _model(tmp, "inter62", intermediate_size=2**62),
        "hidden40": _model(tmp, "hidden40", hidden_size=10**40),
        "vocab15": _model(tmp, "vocab15", vocab_size=10**15),
        "heads": _model(tmp, "heads", num_attention_heads=3, head_dim=None),
        "tie": _model(tmp, "tie", tie_word_embeddings="yes"),
        "nan": str(tmp / "nan.json"),
        "unknown": _model(tmp, "unknown", model_type="no-such-model"),
        # each tensor within 2^40 elements, together terabytes: refused from the devices' memory
        "terabytes": _model(tmp, "terabytes", vocab_size=1 << 20, hidden_size=1 << 19, num_attention_heads=4),
    }
    (tmp / "nan.json").write_text(json.dumps({**_TINY, "model_type": "llama"}).replace("128", "NaN", 1))
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp / "deep_obj.json").write_text('{"a":' * 50_000 + "1" + "}" * 50_000)
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "garbage.json").write_bytes(os.urandom(4096))
    with open(tmp / "sparse.json", "wb") as h:  # 100 GiB on paper, no disk used
        h.truncate(100 << 30)
    os.mkfifo(tmp / "fifo", 0o600)
    (tmp / "folder").mkdir()
    (tmp / "secret-open").write_text("x" * 40)
    (tmp / "secret-open").chmod(0o644)
    (tmp / "secret-ok").write_text("y" * 40)
    (tmp / "secret-ok").chmod(0o600)
    (tmp / "secret-link").symlink_to(tmp / "secret-ok")
    for name in ("deep", "deep_obj", "list", "garbage", "sparse", "fifo", "folder"):
        f[name] = str(tmp / (name if name in ("fifo", "folder") else f"{name}.json"))
    return f


def _cases(tmp: Path) -> list[tuple[str, list[str], dict]]:
    """(what it tries, argv, environment changes): every subcommand, over 50 inputs."""
    f = _files(tmp)
    bad_secret = {
        "/dev/zero": {"REFIT_SECRET": None, "REFIT_SECRET_FILE": "/dev/zero"},
        "a FIFO": {"REFIT_SECRET": None, "REFIT_SECRET_FILE": f["fifo"]},
        "a symlink": {"REFIT_SECRET": None, "REFIT_SECRET_FILE": str(tmp / "secret-link")},
        "others may read": {"REFIT_SECRET": None, "REFIT_SECRET_FILE": str(tmp / "secret-open")},
        "padded": {"REFIT_SECRET": " a-padded-secret-0123456789", "REFIT_SECRET_FILE": None},
        "escape": {"REFIT_SECRET": "a-secret\x1b[2J-with-an-escape", "REFIT_SECRET_FILE": None},
        "short": {"REFIT_SECRET": "short", "REFIT_SECRET_FILE": None},
    }
    cases = [(f"plan --model {k}", ["plan", "--model", f[k]], {}) for k in f if k != "terabytes"]
    cases += [
        ("plan a million-rank engine", ["plan", "--dst", "tp=1,dp=1000000"], {}),
        ("plan a 10^10-rank trainer", ["plan", "--src", "dp=10000000000"], {}),
        ("plan a 10^26-rank engine", ["plan", "--dst", "tp=1,dp=99999999999999999999999999"], {}),
        ("plan --max-world 0", ["plan", "--max-world", "0"], {}),
        ("plan over --max-world", ["plan", "--max-world", "2", "--dst", "tp=1,dp=4"], {}),
        ("plan --cluster deep", ["plan", "--cluster", f["deep"]], {}),
        ("plan --cluster /dev/zero", ["plan", "--cluster", "/dev/zero"], {}),
        ("plan --cluster fifo", ["plan", "--cluster", f["fifo"]], {}),
        ("plan --bandwidth nan", ["plan", "--bandwidth", "nan"], {}),
        ("plan --src tp=-1", ["plan", "--src", "tp=-1"], {}),
    ]
    cases += [(f"verify, secret {k}", ["verify"], env) for k, env in bad_secret.items()]
    cases += [
        ("verify --model layers", ["verify", "--model", f["layers"]], {}),
        ("verify a million-rank engine", ["verify", "--dst", "tp=1,dp=1000000"], {}),
        ("verify --model deep", ["verify", "--model", f["deep_obj"]], {}),
        ("soak --model hidden40", ["soak", "--model", f["hidden40"]], {}),
        ("soak, secret /dev/zero", ["soak"], bad_secret["/dev/zero"]),
        ("soak --refits 0", ["soak", "--refits", "0"], {}),
        ("soak a 10^8-rank trainer", ["soak", "--src", "dp=100000000"], {}),
        ("demo --model inter62", ["demo", "--model", f["inter62"]], {}),
        ("demo a million-rank engine", ["demo", "--dst", "tp=1,dp=1000000"], {}),
        ("demo, secret padded", ["demo"], bad_secret["padded"]),
        ("demo --steps -1", ["demo", "--steps", "-1"], {}),
        ("bench a petabyte vocabulary", ["bench", "--device", "cpu", "--model", f["vocab15"]], {}),
        ("bench terabytes of weights", ["bench", "--device", "cpu", "--model", f["terabytes"]], {}),
        ("bench --model deep", ["bench", "--device", "cpu", "--model", f["deep"]], {}),
        ("bench --scenarios S99", ["bench", "--device", "cpu", "--scenarios", "S99"], {}),
        ("bench, secret FIFO", ["bench", "--device", "cpu"], bad_secret["a FIFO"]),
        ("cluster up --hosts 0", ["cluster", "up", "--hosts", "0"], {}),
        ("cluster up --rate banana", ["cluster", "up", "--rate", "banana"], {}),
        ("no subcommand", [], {}),
        ("an unknown subcommand", ["frobnicate"], {}),
    ]
    return cases


def _drive(cases: list[tuple[str, list[str], dict]], out_dir: Path) -> list[dict]:
    args = [sys.executable, "-c", _DRIVER, json.dumps([LIMIT_S, EXTRA_ADDRESS_SPACE]), str(out_dir)]
    docs = [{"argv": argv, "env": env} for _, argv, env in cases]
    env = {**os.environ, "REFIT_SECRET": "", "REFIT_SECRET_FILE": ""}  # only a case's own secret counts
    proc = subprocess.run(args, input=json.dumps(docs), capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _problems(what: str, r: dict) -> list[str]:
    if r.get("killed"):
        return [f"{what}: still running after {LIMIT_S} s"]
    lines = [line for line in r["err"].splitlines() if line.strip()]
    bad = []
    if r["rc"] != 2:
        bad.append(f"{what}: exit {r['rc']}")
    if len(lines) != 1 or not lines[0].startswith("refit: error: "):
        bad.append(f"{what}: stderr {lines[:4]}")
    if "Traceback" in r["err"] + r["out"]:
        bad.append(f"{what}: a traceback")
    if r["maxrss"] > MAX_RSS:
        bad.append(f"{what}: {r['maxrss'] >> 20} MiB resident")
    return bad


@pytest.mark.timeout(1500)
def test_every_subcommand_refuses_hostile_inputs_in_one_line(tmp_path):
    from refit.tools.cli import _parser

    cases = _cases(tmp_path)
    assert len(cases) >= 40
    subcommands = set(_parser()._subparsers._group_actions[0].choices)
    assert subcommands <= {argv[0] for _, argv, _ in cases if argv}  # every subcommand is tried
    (tmp_path / "out").mkdir()
    results = _drive(cases, tmp_path / "out")
    problems = [p for (what, _, _), r in zip(cases, results) for p in _problems(what, r)]
    assert not problems, "\n".join(problems)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # torch and transformers imported, then a refusal


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "argv, env",
    [
        (["plan", "--dst", "tp=1,dp=1000000"], {}),
        (["verify"], {"REFIT_SECRET_FILE": "/dev/zero", "REFIT_SECRET": ""}),
    ],
)
def test_a_fresh_refit_process_refuses_in_one_line(argv, env):
    """The same through a fresh interpreter (what a user runs): import-time output counts here too."""
    proc = subprocess.run(
        [sys.executable, "-m", "refit.tools.cli", *argv],
        capture_output=True,
        text=True,
        timeout=240,  # imports on a loaded machine; the refusal itself is immediate
        env={**os.environ, **env},
        preexec_fn=_limited,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("refit: error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
