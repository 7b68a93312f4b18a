"""Real vLLM (CPU) receiving refits from a 2-rank trainer; used by the vLLM tests and the example.

The driver process is trainer rank 0 and owns the ``vllm.LLM``; trainer rank 1
is a process forked from refit's launcher. The trainer runs the HF model tensor-parallel
(``parallelize_module``) or FSDP2 (``fully_shard``) over gloo.

vLLM runs with its insecure serialization switch off (``secure_env``): the driver calls worker
methods by name (``worker_ext.WorkerTestExtension``), never ships a function. After the refits
both sides shut refit down and must hold no thread or socket refit opened (``leaks``).
By hand: ``cd tests && python -m vllm_backend.harness tiny-llama tp=2 1``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from refit.layout.models import build_model, load_config
from refit.tools.launch import start_process
from refit.transport.control import free_port

from . import engine_procs
from .leaks import leftovers, snapshot
from .worker_ext import WorkerTestExtension

PROMPT = [1, 17, 42, 99, 7, 250, 31, 5]
INSECURE = "INSECURE_SERIALIZATION"  # the suffix of vLLM's switch that lets collective_rpc pickle


def secure_env(env: MutableMapping[str, str]) -> None:
    """Remove from ``env`` every variable named ``*INSECURE_SERIALIZATION`` (vLLM's pickle switch)."""
    for name in [n for n in env if n.endswith(INSECURE)]:
        del env[name]


def check_vllm_secure() -> None:
    """Unset vLLM's pickle switch in this process (engines started from here inherit that) and check that
    vLLM itself reads it as off."""
    import vllm.envs as envs

    secure_env(os.environ)
    switches = [n for n in dir(envs) if n.endswith(INSECURE)]
    assert switches, f"vLLM has no *{INSECURE} setting any more: update the harness"
    assert not any(getattr(envs, n) for n in switches), switches


@contextmanager
def importable_by_workers(cls: type) -> Iterator[str]:
    """Yield ``cls``'s qualified name for ``worker_extension_cls`` while the directory its module is imported
    from leads ``PYTHONPATH``: processes started meanwhile (vLLM's engine, its workers) import it too.
    ``PYTHONPATH`` is restored afterwards."""
    base = Path(sys.modules[cls.__module__].__file__).resolve()
    for _ in cls.__module__.split("."):
        base = base.parent
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(base), *([old] if old else [])])
    try:
        yield f"{cls.__module__}.{cls.__qualname__}"
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _trainer_model(model_name: str, spec: str, rank: int):
    from torch.distributed.tensor import DeviceMesh

    model = build_model(load_config(model_name), torch.float32, seed=0)
    if spec == "tp=2":
        from refit.trainers.hf_tp import parallelize_tp

        parallelize_tp(model, dist.group.WORLD, "cpu")
    elif spec == "fsdp=2":
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
    else:
        raise ValueError(spec)
    return model


def _train_step(model, spec: str, step: int, vocab: int) -> float:
    from refit.trainers.hf_tp import sync_head_local_grads

    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    if spec == "tp=2":
        sync_head_local_grads(model, dist.group.WORLD)
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-2 * p.grad  # plain SGD: in place, as optimizers do
            p.grad = None
    return float(out.loss)


def trainer_loop(
    rank: int,
    port: int,
    xfer_port: int,
    model_name: str,
    spec: str,
    n_workers: int,
    steps: int,
    client=None,
    load_path: str = "auto",
    master_address: str = "127.0.0.1",
    transport: str = "p2p",
    delta: str = "off",
) -> tuple[list[dict], dict[str, list]]:
    """Both trainer ranks run this; rank 0 also passes the LLM client and gets full weights per step.
    Returns the history and what refit left behind after ``engine.shutdown()`` (``leaks.leftovers``)."""
    from refit.engines.vllm.trainer import RefitTrainerEngine, RefitTrainerInitInfo, ShardedModuleSource
    from refit.trainers.dtensor import full_state

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    try:
        model = _trainer_model(model_name, spec, rank)
        vocab = load_config(model_name).vocab_size
        info = RefitTrainerInitInfo(
            rank=rank,
            master_address=master_address,
            master_port=xfer_port,
            n_trainer=2,
            n_workers=n_workers,
            timeout_s=300,
            load_path=load_path,
            transport=transport,
            delta=delta,
        )
        before = snapshot()
        engine = RefitTrainerEngine.trainer_init(info, client=client, source=ShardedModuleSource(model, 2))
        history = []
        for step in range(1, steps + 1):
            loss = _train_step(model, spec, step, vocab)
            t0 = time.perf_counter()
            stats = engine.send_weights(step)
            dt = time.perf_counter() - t0
            full = full_state(model)  # for the check only (a collective on both ranks)
            history.append(
                {
                    "step": step,
                    "loss": loss,
                    "seconds": dt,
                    "bytes_sent": stats.bytes_sent,
                    "weights": full if rank == 0 else None,
                }
            )
        engine.shutdown()
        return history, leftovers(before, snapshot())
    finally:
        dist.destroy_process_group()


def _rank1(port, xfer_port, model_name, spec, n_workers, steps, load_path, master_address, transport, delta="off"):
    _, left = trainer_loop(
        1,
        port,
        xfer_port,
        model_name,
        spec,
        n_workers,
        steps,
        load_path=load_path,
        master_address=master_address,
        transport=transport,
        delta=delta,
    )
    assert left == {"threads": [], "sockets": []}, f"trainer rank 1 after shutdown: {left}"


def engine_args(workdir: str, engine_tp: int, extension: str) -> dict:
    """The test engines' ``LLM`` arguments (CPU, float32, token ids in, the refit backend, ``extension``)."""
    return {
        "model": workdir,
        "dtype": "float32",
        "tensor_parallel_size": engine_tp,
        "skip_tokenizer_init": True,
        "gpu_memory_utilization": 0.1,  # on CPU: the share of RAM each worker reserves (tiny models)
        "max_model_len": 128,
        "enforce_eager": True,
        "weight_transfer_config": {"backend": "refit"},
        "worker_extension_cls": extension,
    }


def make_llm(model_name: str, engine_tp: int, workdir: str, **kw):
    """An LLM over a tiny model saved with different (seed 1000) weights; vLLM's pickle switch off, the
    workers extended with ``WorkerTestExtension``."""
    hf = build_model(load_config(model_name), torch.float32, seed=1000)
    hf.save_pretrained(workdir)
    return start_llm(workdir, engine_tp, **kw)


def start_llm(workdir: str, engine_tp: int, **kw):
    """An ``LLM`` over the model saved in ``workdir`` (``engine_args``, vLLM's pickle switch off), its engine core
    and workers forked from ``engine_procs``' server rather than spawned."""
    from vllm import LLM

    check_vllm_secure()
    if engine_tp > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").count("|") != engine_tp - 1:
        # one entry per worker; more workers than cores share them ("0|1|0|1": tp=4 on 2 cores)
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(engine_tp))
    engine_procs.use()
    # with more than one worker the engine core runs in this process (its workers are still processes): one
    # process less to start per engine; with one, vLLM would run the worker here too, beside trainer rank 0
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if engine_tp > 1 else {}
    with importable_by_workers(WorkerTestExtension) as extension, mock.patch.dict(os.environ, in_process):
        return LLM(**engine_args(workdir, engine_tp, extension), **kw)


def greedy(llm, n: int = 8):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=n, temperature=0.0, logprobs=0))
    o = out[0].outputs[0]
    return list(o.token_ids), [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]


def hf_reference(model_name: str, weights: dict, tokens: list[int]):
    """Greedy tokens and their logprobs from HF transformers holding ``weights``."""
    hf = build_model(load_config(model_name), torch.float32, seed=None)
    hf.load_state_dict(weights, strict=True)
    ids = list(PROMPT)
    out_tokens, out_lp = [], []
    with torch.no_grad():
        for _ in range(len(tokens)):
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            t = int(torch.argmax(lp))
            out_tokens.append(t)
            out_lp.append(float(lp[t]))
            ids.append(t)
    return out_tokens, out_lp


def train_and_refit(
    client,
    model_name: str,
    spec: str,
    engine_tp: int,
    steps: int,
    load_path: str = "auto",
    master_address: str = "127.0.0.1",
    transport: str = "p2p",
    delta: str = "off",
):
    """Trainer rank 0 here (driving the engine through ``client``: ``LLMClient(llm)``, vLLM's HTTP client, ...),
    rank 1 forked (launch.start_process); both refit the engine after each step, then shut refit down. The store listens
    on ``master_address`` (the engine's workers connect there). Returns rank 0's history and leftovers (rank 1
    checks its own: a failure there is its exit code)."""
    port, xfer_port = free_port(), free_port(master_address)
    p = start_process(  # forked with torch and refit imported, this process's environment
        _rank1, (port, xfer_port, model_name, spec, engine_tp, steps, load_path, master_address, transport, delta)
    )
    try:
        out = trainer_loop(
            0, port, xfer_port, model_name, spec, engine_tp, steps, client, load_path, master_address, transport, delta
        )
    finally:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0, f"trainer rank 1 failed (exit code {p.exitcode}; its traceback is in the output)"
    return out


def run(
    model_name: str = "tiny-llama",
    spec: str = "tp=2",
    engine_tp: int = 1,
    steps: int = 2,
    load_path: str = "auto",
    transport: str = "p2p",
    delta: str = "off",
    llm=None,
) -> dict:
    """Refit an engine ``steps`` times: ``llm`` (a pooled engine of ``model_name``, which is then its model
    directory) or a fresh one. Returns the trainer history, the engine's greedy tokens/logprobs and HF's on the
    last weights, the workers' ``refit_stats`` before (``worker_stats_before``) and after, the version vLLM
    reports, and what refit left behind after shutdown on trainer rank 0 (``trainer_leftovers``) and in each
    worker (``worker_leftovers``, after ``llm.shutdown_weight_transfer_engine()``)."""
    if llm is not None:
        return _refit(llm, model_name, spec, engine_tp, steps, load_path, transport, delta)
    with tempfile.TemporaryDirectory() as workdir:
        llm = make_llm(model_name, engine_tp, workdir)
        result = _refit(llm, model_name, spec, engine_tp, steps, load_path, transport, delta)
        del llm
        return result


def _refit(llm, model_name, spec, engine_tp, steps, load_path, transport, delta) -> dict:
    from refit.engines.vllm.client import LLMClient

    stats_before = llm.collective_rpc("refit_stats")
    workers_before = llm.collective_rpc("refit_test_snapshot")
    try:
        history, trainer_left = train_and_refit(
            LLMClient(llm), model_name, spec, engine_tp, steps, load_path, transport=transport, delta=delta
        )
    finally:  # a refused init leaves the workers' side to release too: the engine may serve the next test
        llm.shutdown_weight_transfer_engine()
    stats = llm.collective_rpc("refit_stats")
    workers_after = llm.collective_rpc("refit_test_snapshot")
    # the last step's weights are what the engine holds now
    tokens, lps = greedy(llm)
    ref_tokens, ref_lps = hf_reference(model_name, history[-1]["weights"], tokens)
    return {
        "history": history,
        "tokens": tokens,
        "logprobs": lps,
        "ref_tokens": ref_tokens,
        "ref_logprobs": ref_lps,
        "worker_stats_before": stats_before,
        "worker_stats": stats,
        "version": llm.get_weight_version(),
        "trainer_leftovers": trainer_left,
        "worker_leftovers": [leftovers(b, a) for b, a in zip(workers_before, workers_after)],
    }


if __name__ == "__main__":
    r = run(*sys.argv[1:3], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    print("tokens", r["tokens"], "ref", r["ref_tokens"])
    print("max |dlogprob|", max(abs(a - b) for a, b in zip(r["logprobs"], r["ref_logprobs"])))
    print("version", r["version"], "stats", r["worker_stats"])
    print("trainer", [{k: v for k, v in h.items() if k != "weights"} for h in r["history"]])
    print("leftovers", r["trainer_leftovers"], r["worker_leftovers"])
