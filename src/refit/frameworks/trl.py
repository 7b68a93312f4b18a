"""refit as TRL's weight sync: a GRPO ``rollout_func`` that generates with vLLM and refits vLLM with refit.

TRL's GRPO syncs vLLM one parameter at a time (``VLLMClient.update_named_params`` over vLLM's NCCL engine in
server mode, ``model.load_weights`` per parameter in colocate mode), gathering every FSDP parameter on the way.
``RefitRollout`` replaces that through GRPO's public ``rollout_func`` argument: before it generates for a new
optimizer step, every trainer rank sends the boxes it holds of the policy (plain, FSDP2 or TP) through refit's
vLLM backend, and each vLLM worker receives only its tensor-parallel share::

    rollout = RefitRollout.colocate(llm)  # vllm.LLM(..., weight_transfer_config={"backend": "refit"})
    rollout = RefitRollout.server("http://host:8000")  # vllm serve ... --weight-transfer-config (refit)
    GRPOTrainer(model, reward_funcs, args=GRPOConfig(use_vllm=False, ...), rollout_func=rollout, ...)

``use_vllm`` stays False: that switch makes TRL start its own vLLM client and sync (NCCL, CUDA only), which
refit replaces. The two modes differ only in who holds the engine. *Colocate*: the one trainer process owns a
``vllm.LLM`` (several trainer processes use a server: each would otherwise hold an engine of its own).
*Server*: TRL's own ``trl vllm-serve`` (which runs ``vllm serve`` and forwards the flags it does not know to it)
with refit's backend and worker extension (``serve_command``); generation goes through TRL's own ``VLLMClient``
(its OpenAI route, no NCCL), the sync through vLLM's ``HTTPVLLMWeightSyncClient``.

Lifecycle: the first call joins refit's job (``RefitTrainerEngine.trainer_init``, collective over the trainer
ranks and the engine's workers) with the trainer's model; every call whose ``trainer.state.global_step``
differs from the last sync sends version ``global_step + 1`` first; ``close()`` releases refit's side.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from refit.engines.vllm.client import LLMClient
from refit.engines.vllm.trainer import RefitTrainerEngine, RefitTrainerInitInfo, ShardedModuleSource
from refit.errors import ConfigError
from refit.transport.control import free_port

EXTENSION = "refit.engines.vllm.extension.RefitWorkerExtension"  # refit_stats, read through collective_rpc
AfterSync = Callable[["RefitRollout", Any], None]


@dataclass
class Sampling:
    """How completions are sampled (TRL's ``GRPOConfig`` fields of the same meaning): ``max_tokens``
    (``max_completion_length``), ``temperature``, ``top_p``, ``top_k`` (0: off), ``seed`` (None: vLLM's)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    extra: dict = field(default_factory=dict)


class RefitRollout:
    """GRPO's ``rollout_func``: sync the policy into vLLM with refit when the step changed, then generate one
    completion per prompt it is given (GRPO already repeats each prompt ``num_generations`` times).

    Build it with ``colocate(llm)`` or ``server(base_url)``. ``n_workers``: the engine's workers (TP x DP; the
    colocated ``LLM``'s are read from it). ``master_address`` / ``master_port``: where trainer rank 0 hosts
    refit's store (a server's workers must reach it: trainer rank 0's address on their network; port 0 picks
    a free one on a single trainer process). ``after_sync(rollout, trainer)``: called on every trainer rank
    after each sync (checks, logging). ``stats``: the last sync's ``RunStats`` on this rank; ``syncs``: how
    many ran."""

    def __init__(
        self,
        client: Any,
        generate: Callable[[list[list[int]], Sampling], tuple[list[list[int]], list[list[float]]]],
        n_workers: int,
        *,
        sampling: Sampling | None = None,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        after_sync: AfterSync | None = None,
        **init_info: Any,
    ) -> None:
        self.client = client
        self._generate = generate
        self.n_workers = n_workers
        self.sampling = sampling or Sampling()
        self.master_address = master_address
        self.master_port = master_port
        self.after_sync = after_sync
        self.init_info = init_info
        self.engine: RefitTrainerEngine | None = None
        self.last_step: int | None = None
        self.syncs = 0
        self.stats: Any = None
        self.colocated = False
        self.trl_client: Any = None  # server mode: TRL's VLLMClient on the server (probes, its other routes)

    @classmethod
    def colocate(cls, llm: Any, **kw: Any) -> RefitRollout:
        """A rollout over ``llm`` (a ``vllm.LLM`` in this process, started with
        ``weight_transfer_config={"backend": "refit"}``): prompts go in as token ids."""
        n_workers = llm.llm_engine.vllm_config.parallel_config.world_size

        def generate(prompt_ids: list[list[int]], s: Sampling) -> tuple[list[list[int]], list[list[float]]]:
            from vllm import SamplingParams

            params = SamplingParams(
                n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, seed=s.seed,
                logprobs=0, **s.extra,
            )  # fmt: skip
            outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
            completions = [list(o.outputs[0].token_ids) for o in outs]
            logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
            return completions, logprobs

        rollout = cls(LLMClient(llm), generate, n_workers, **kw)
        rollout.colocated = True
        return rollout

    @classmethod
    def server(cls, base_url: str, n_workers: int | None = None, **kw: Any) -> RefitRollout:
        """A rollout over a ``vllm serve`` at ``base_url`` (``--weight-transfer-config '{"backend":"refit"}'``,
        ``VLLM_SERVER_DEV_MODE=1``): TRL's ``VLLMClient`` generates, vLLM's ``HTTPVLLMWeightSyncClient`` drives
        the sync. ``n_workers``: the server's TP x PP x DP (default: what it reports at ``/get_world_size``)."""
        from trl.generation.vllm_client import VLLMClient
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        trl_client = VLLMClient(base_url=base_url, connection_timeout=kw.pop("connection_timeout", 60.0))
        workers = n_workers if n_workers is not None else trl_client.get_world_size()

        def generate(prompt_ids: list[list[int]], s: Sampling) -> tuple[list[list[int]], list[list[float]]]:
            extra = {**s.extra, **({"seed": s.seed} if s.seed is not None else {})}
            out = trl_client.generate(
                prompt_ids, n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                logprobs=0, generation_kwargs=extra,
            )  # fmt: skip
            return out["completion_ids"], [[lp[0] for lp in seq] for seq in out["logprobs"]]

        rollout = cls(HTTPVLLMWeightSyncClient(base_url), generate, workers, **kw)
        rollout.trl_client = trl_client
        return rollout

    # -- GRPO's rollout_func -------------------------------------------------------------------------------------

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, Any]:
        """``rollout_func(prompts, trainer)``: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (the sampled
        token's, per completion token), one completion per prompt."""
        step = int(trainer.state.global_step)
        if step != self.last_step:
            self.sync(trainer, step + 1)
            self.last_step = step
        prompt_ids = tokenize(trainer, prompts)
        completion_ids, logprobs = self._generate(prompt_ids, self.sampling)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def sync(self, trainer: Any, version: int) -> Any:
        """Send the trainer's current weights as ``version`` (every trainer rank; the first call joins)."""
        if self.engine is None:
            self.engine = self._join(trainer)
        self.stats = self.engine.send_weights(version)
        self.syncs += 1
        if self.after_sync is not None:
            self.after_sync(self, trainer)
        return self.stats

    def close(self) -> None:
        """Release refit's trainer side on this rank (the engine's side: ``llm.shutdown_weight_transfer_engine``
        or the server's exit). Idempotent."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None

    def _join(self, trainer: Any) -> RefitTrainerEngine:
        acc = trainer.accelerator
        rank, world = acc.process_index, acc.num_processes
        if self.colocated and world > 1:
            raise ConfigError(
                f"RefitRollout.colocate: {world} trainer processes would each hold an engine of their own; with "
                "several trainer processes serve one engine (RefitRollout.server) that every rank syncs and uses"
            )
        port = self.master_port
        if port == 0:
            if world > 1:
                raise ConfigError(
                    f"RefitRollout: {world} trainer processes need master_port set to the same free port on every "
                    "rank (trainer rank 0 hosts refit's store there)"
                )
            port = free_port(self.master_address)
        info = RefitTrainerInitInfo(
            rank=rank,
            master_address=self.master_address,
            master_port=port,
            n_trainer=world,
            n_workers=self.n_workers,
            **self.init_info,
        )
        model = acc.unwrap_model(trainer.model) if world == 1 else trainer.model
        source = ShardedModuleSource(model, world)
        return RefitTrainerEngine.trainer_init(info, client=self.client if rank == 0 else None, source=source)


def tokenize(trainer: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """Token ids of GRPO's prompts with the trainer's tokenizer: plain text as it is, conversations through the
    tokenizer's chat template (as GRPO tokenizes them for its own generation)."""
    tok = trainer.processing_class
    tok = getattr(tok, "tokenizer", tok)  # a processor: its tokenizer
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(list(tok(p, add_special_tokens=False)["input_ids"]))
        else:
            out.append(list(tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True)))
    return out


def cpu_llm(model_dir: str, tp: int = 1, **overrides: Any) -> Any:
    """A ``vllm.LLM`` for a tiny model on a CPU machine, with refit's backend, for demos and tests of the colocated
    rollout: float32 (bfloat16 kills CPU workers with SIGILL), token ids in (``skip_tokenizer_init``), eager, a
    64 MiB KV cache per worker, ``RefitWorkerExtension`` (``refit_stats``). With
    ``tp`` > 1 it sets ``VLLM_CPU_OMP_THREADS_BIND`` (``cpu_threads_bind``). ``overrides``: any other ``LLM``
    argument. On a GPU host build the ``LLM`` with your own arguments and
    ``weight_transfer_config={"backend": "refit"}``."""
    from vllm import LLM

    cpu_threads_bind(tp, "cpu_llm")
    args = {
        "model": model_dir,
        "dtype": "float32",
        "tensor_parallel_size": tp,
        "skip_tokenizer_init": True,
        "kv_cache_memory_bytes": 64 << 20,  # a tiny model's cache (vLLM's CPU default: a share of the host's RAM)
        "max_model_len": 128,
        "enforce_eager": True,
        "seed": 0,
        "weight_transfer_config": {"backend": "refit"},
        "worker_extension_cls": EXTENSION,
    }
    return LLM(**{**args, **overrides})


def cpu_threads_bind(tp: int, who: str = "cpu_threads_bind") -> None:
    """With ``tp`` > 1 set ``VLLM_CPU_OMP_THREADS_BIND`` to one core per worker unless it already names ``tp`` of
    them (vLLM's CPU backend refuses TP without it); engines and servers started from here inherit it."""
    _check_tp(tp, who)
    if tp > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").count("|") != tp - 1:
        cores = sorted(os.sched_getaffinity(0))  # more workers than cores share them ("0|1|0|1": tp=4 on 2 cores)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(tp))


def serve_command(
    model: str, tp: int = 1, *, host: str = "127.0.0.1", port: int = 8000, cpu: bool = False, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of TRL's ``trl vllm-serve`` serving ``model`` (tensor parallel ``tp``) for
    ``RefitRollout.server``: TRL's own server command, which runs ``vllm serve`` with the flags TRL's trainers
    need (``VLLM_SERVER_DEV_MODE=1``, processed log-probabilities) and forwards the flags it does not know to it:
    refit's weight-transfer backend (vLLM keeps the last ``--weight-transfer-config``, so refit's replaces TRL's
    NCCL one) and refit's worker extension (``refit_stats`` through ``/collective_rpc``). ``cpu``: the CPU engine
    arguments of ``cpu_llm`` (float32, eager, token ids in, a 64 MiB KV cache); on CPU with ``tp`` > 1 call
    ``cpu_threads_bind(tp)`` first (the server inherits the environment). ``host``: the address the server listens
    on, loopback unless the caller names one (the trainer's host reaches it there). ``extra``: more ``vllm serve``
    flags.
    The server's environment needs the job's secret (``REFIT_SECRET`` or ``REFIT_SECRET_FILE``), as the trainer's."""
    _check_tp(tp, "serve_command")
    cmd = [sys.executable, "-m", "trl.cli.main", "vllm-serve", "--model", model, "--tensor_parallel_size", str(tp)]
    cmd += ["--host", host, "--port", str(port)]
    if cpu:  # TRL's own arguments, then vLLM's (forwarded)
        cmd += ["--dtype", "float32", "--max_model_len", "128", "--enforce_eager", "true"]
        cmd += ["--gpu_memory_utilization", "0.1", "--skip-tokenizer-init", "--kv-cache-memory-bytes", str(64 << 20)]
    cmd += ["--weight-transfer-config", json.dumps({"backend": "refit"}), "--worker-extension-cls", EXTENSION]
    return cmd + list(extra)


def _check_tp(tp: Any, who: str) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"{who}: tp must be an integer >= 1, got {tp!r}")


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer for a tiny random model, made in place (nothing downloaded): ``"w<i>"`` is token
    ``i`` for ``2 <= i < vocab_size``, ``<pad>`` is 0 and ``<eos>`` is 1. For CPU demos and tests of GRPO, which
    needs a tokenizer to decode completions; a real model brings its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
