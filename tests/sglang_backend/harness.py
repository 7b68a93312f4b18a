"""Real SGLang (CPU, float32) refit by a 2-rank trainer; used by the SGLang tests.

The driver process is trainer rank 0 and owns the ``sgl.Engine`` (TP=2); trainer rank 1 is a process forked
from refit's launcher. The trainer is the HF model sharded by FSDP2 or tensor parallel over gloo, built and
trained by the vLLM harness's helpers (``vllm_backend.harness``: the same tiny models, steps and HF reference).
SGLang runs with two test-only shims (``shims/``: a stand-in ``sgl_kernel`` and the torchvision op
schemas), on ``PYTHONPATH`` of the engine's processes only. The job secret reaches SGLang's processes
through their environment (``REFIT_SECRET``, set by ``tests/conftest.py``), never through SGLang.

By hand: ``cd tests && python -m sglang_backend.harness tiny-llama fsdp=2``.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from refit.layout.models import build_model, load_config
from refit.tools.launch import start_process
from refit.transport.control import free_port
from vllm_backend.harness import PROMPT, _train_step, _trainer_model, hf_reference
from vllm_backend.leaks import leftovers, snapshot

SHIMS = str(Path(__file__).resolve().parent / "shims")
ENGINE_TP = 2


def engine_env(tp: int) -> None:
    """What SGLang's CPU engine needs in this process's environment (its schedulers inherit it)."""
    assert os.environ.get("REFIT_SECRET"), "the SGLang tests hand the job secret through REFIT_SECRET"
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if tp > 1:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    path = os.environ.get("PYTHONPATH", "")
    if SHIMS not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([SHIMS, *([path] if path else [])])
    if SHIMS not in sys.path:  # this process imports SGLang too
        sys.path.insert(0, SHIMS)
        import torchvision_ops  # noqa: F401


def make_engine(model: str, workdir: str, tp: int = ENGINE_TP):
    """An ``sgl.Engine`` over the tiny ``model`` saved with other weights (seed 1000) than the trainer's (seed 0),
    refit's loader allowed."""
    from refit.engines.sglang import LOADER

    engine_env(tp)
    import sglang as sgl

    build_model(load_config(model), torch.float32, seed=1000).save_pretrained(workdir)
    return sgl.Engine(
        model_path=workdir,
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        attention_backend="torch_native",
        tp_size=tp,
        mem_fraction_static=0.9,  # of RAM here, checked against what is free (other jobs run); max_total_tokens caps it
        max_total_tokens=2048,
        disable_cuda_graph=True,
        disable_custom_all_reduce=True,
        custom_weight_loader=[LOADER],
        log_level="error",
    )


def greedy(engine, n: int = 8) -> tuple[list[int], list[float], str]:
    """SGLang's greedy tokens after ``PROMPT``, their logprobs and the weight version it says produced them."""
    out = engine.generate(
        input_ids=list(PROMPT), sampling_params={"max_new_tokens": n, "temperature": 0.0}, return_logprob=True
    )
    logprobs = [float(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    return list(out["output_ids"]), logprobs, out["meta_info"]["weight_version"]


def shard_bytes(model: str, tp: int, rank: int) -> int:
    """Bytes of SGLang TP rank ``rank``'s share of the HF model, counted from the config alone (an oracle
    independent of refit's regions): q/k/v and o split by heads ``tp`` ways (KV heads replicated where fewer than
    ``tp``); gate/up rows and down columns split on the intermediate size padded to a multiple of 32 x tp (SGLang
    on CPU), vocabulary rows on the vocabulary padded to a multiple of 64: a rank holds the real rows of its share
    of the padded size only; everything else whole."""
    from refit.layout.models import param_shapes

    cfg = load_config(model)
    kv_heads = cfg.num_key_value_heads
    total = 0
    for name, shape, _ in param_shapes(model):
        n = math.prod(shape)
        leaf = name.rsplit(".", 2)[-2]
        if leaf in ("k_proj", "v_proj") and kv_heads < tp:
            n = n // kv_heads
        elif leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            n //= tp
        elif leaf in ("gate_proj", "up_proj", "down_proj"):
            n = n // cfg.intermediate_size * _real_rows(cfg.intermediate_size, 32 * tp, tp, rank)
        elif leaf in ("embed_tokens", "lm_head"):
            n = n // cfg.vocab_size * _real_rows(cfg.vocab_size, 64, tp, rank)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj", "gate_up_proj")):
            n //= tp
        total += n * 4
    return total


def _real_rows(size: int, multiple: int, tp: int, rank: int) -> int:
    """Real rows of rank ``rank``'s share when ``size`` is padded to a multiple of ``multiple`` and split evenly."""
    share = -(-size // multiple) * multiple // tp
    return max(0, min(share, size - rank * share))


def kill_midway(trainer) -> Callable:
    """A fault hook that SIGKILLs this process half way through its steps of the refit."""
    import signal

    steps = trainer.peer.executor.steps
    middle = steps[len(steps) // 2]

    def fault(where: str, info: dict) -> None:
        if where == "step" and info["step"] is middle:
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


def trainer_loop(
    rank: int, port: int, xfer_port: int, model: str, spec: str, steps: int, first: int, check=None, kill_at=None
):
    """Both trainer ranks: build the sharded trainer, refit SGLang after each of ``steps`` optimizer steps
    (versions ``first``, ``first + 1``, ...); rank 0 calls ``check(version, weights, trainer, stats)`` after each
    refit with the full weights (gathered for the check only). Rank 1 kills itself half way through version
    ``kill_at`` (rank 0 then records the error and stops). Returns rank 0's results."""
    from refit.engines.sglang.trainer import ModuleSource, RefitSGLangTrainer, SGLangTrainerInitInfo
    from refit.trainers.dtensor import full_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))  # fmt: skip
    try:
        net = _trainer_model(model, spec, rank)
        info = SGLangTrainerInitInfo(rank=rank, master_port=xfer_port, n_trainer=2, n_workers=ENGINE_TP, timeout_s=300)
        before = snapshot()
        trainer = RefitSGLangTrainer.trainer_init(info, source=ModuleSource(net, 2), client=check and check.client)
        results = []
        for version in range(first, first + steps):
            loss = _train_step(net, spec, version, load_config(model).vocab_size)
            if version == kill_at:
                if rank == 1:
                    trainer.send_weights(version, fault_hook=kill_midway(trainer))
                try:
                    trainer.send_weights(version)
                except Exception as e:  # noqa: BLE001 - the test looks at it
                    results.append({"version": version, "error": f"{type(e).__name__}: {e}"})
                    break
            stats = trainer.send_weights(version)
            weights = full_state(net)
            if check is not None:
                results.append(check(version, weights, trainer, stats) | {"loss": loss})
        trainer.shutdown()
        left = leftovers(before, snapshot())
        if kill_at is None and rank == 1:  # a pure trainer process: nothing of refit's may be left
            assert left == {"threads": [], "sockets": []}, f"trainer rank 1 after shutdown: {left}"
        # rank 0 also runs SGLang's engine (its own threads come and go): no refit thread may outlive shutdown
        assert not [t for t in left["threads"] if t[1].startswith("refit")], left
        return results
    finally:
        dist.destroy_process_group()


def _rank1(port: int, xfer_port: int, model: str, spec: str, steps: int, first: int, kill_at) -> None:
    trainer_loop(1, port, xfer_port, model, spec, steps, first, kill_at=kill_at)


class Checker:
    """Rank 0's check after each refit: SGLang's greedy tokens and logprobs (``greedy()`` -> tokens, logprobs,
    the version that produced them), HF's on the trainer's weights, the version SGLang reports, every SGLang
    rank's stats and rank 0's bytes sent. ``client`` is the one rank 0 drives SGLang with."""

    def __init__(self, client, greedy: Callable, model: str) -> None:
        self.client, self.greedy, self.model = client, greedy, model

    @classmethod
    def for_engine(cls, engine, model: str) -> Checker:
        from refit.engines.sglang.client import EngineClient

        return cls(EngineClient(engine), lambda: greedy(engine), model)

    def __call__(self, version: int, weights: dict, trainer, stats) -> dict:
        tokens, logprobs, produced_by = self.greedy()
        ref_tokens, ref_logprobs = hf_reference(self.model, weights, tokens)
        return {
            "version": version,
            "tokens": tokens,
            "ref_tokens": ref_tokens,
            "max_dlogprob": max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)),
            "produced_by": produced_by,
            "logprobs": logprobs,
            "reported": self.client.weight_version(),
            "engine_stats": trainer.last_stats,
            "bytes_sent_rank0": stats.bytes_sent,
        }


def refit_session(check: Checker, spec: str, steps: int = 3, first: int = 1, kill_at: int | None = None):
    """One trainer (2 ranks, ``spec``) joining the running engine ``check`` looks at and refitting it ``steps``
    times (rank 1 killed half way through version ``kill_at``, if given). Returns rank 0's check results and
    rank 1's exit code."""
    port, xfer_port, model = free_port(), free_port(), check.model
    p = start_process(_rank1, (port, xfer_port, model, spec, steps, first, kill_at))  # forked with torch imported
    try:
        out = trainer_loop(0, port, xfer_port, model, spec, steps, first, check, kill_at)
    finally:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    return out, p.exitcode


SERVER_ARGS = (
    "--device cpu --dtype float32 --skip-tokenizer-init --attention-backend torch_native --mem-fraction-static 0.9 "
    "--max-total-tokens 2048 --disable-cuda-graph --disable-custom-all-reduce --log-level error --host 127.0.0.1"
)


@contextmanager
def server(model: str, workdir: str, tp: int = ENGINE_TP, timeout_s: float = 400.0) -> Iterator[str]:
    """``python -m sglang.launch_server`` over ``model`` (seed 1000 weights) on loopback, refit's loader allowed;
    yields its URL once it answers; stops its whole process group afterwards."""
    from refit.engines.sglang import LOADER

    engine_env(tp)
    build_model(load_config(model), torch.float32, seed=1000).save_pretrained(workdir)
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", workdir, "--tp-size", str(tp)]
    cmd += [*SERVER_ARGS.split(), "--port", str(port), "--custom-weight-loader", LOADER]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout_s)
        yield url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (its schedulers too), SIGKILL it if still there after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sglang.launch_server exited with {proc.returncode}"
        try:
            if requests.get(f"{url}/model_info", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"sglang.launch_server at {url} did not answer within {timeout_s:.0f}s")


def http_greedy(url: str, n: int = 8) -> tuple[list[int], list[float], str]:
    """``greedy`` through the server's ``/generate`` (JSON)."""
    import requests

    body = {
        "input_ids": list(PROMPT),
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0},
        "return_logprob": True,
    }
    out = requests.post(f"{url}/generate", json=body, timeout=300).json()
    logprobs = [float(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    return list(out["output_ids"]), logprobs, out["meta_info"]["weight_version"]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        eng = make_engine(sys.argv[1], d)
        try:
            for row in refit_session(Checker.for_engine(eng, sys.argv[1]), sys.argv[2])[0]:
                print({k: v for k, v in row.items() if k != "engine_stats"}, row["engine_stats"])
        finally:
            eng.shutdown()
