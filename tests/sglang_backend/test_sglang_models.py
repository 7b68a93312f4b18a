"""refit into real SGLang on CPU beyond the Llama engine: a Qwen3-MoE engine, and SGLang as an HTTP server
(``python -m sglang.launch_server``) over a dense Qwen3 (qk-norm). One engine at a time (each test starts and
stops its own; an engine start is most of a test's time): the same checks as
``test_sglang_backend.check_refits`` after every refit.
"""

import tempfile

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here (scripts/test.sh runs these in .venv-sglang)")

from .harness import ENGINE_TP, Checker, http_greedy, make_engine, refit_session, server  # noqa: E402
from .test_sglang_backend import check_refits  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc, pytest.mark.timeout(900)]


def test_fsdp2_trainer_refits_qwen3_moe():
    # qk-norm (q_norm/k_norm whole on every rank); FusedMoE w13/w2 hold this rank's rows of every expert
    model = "tiny-qwen3-moe"
    with tempfile.TemporaryDirectory() as d:
        engine = make_engine(model, d)
        try:
            rows, rank1 = refit_session(Checker.for_engine(engine, model), "fsdp=2", steps=3, first=1)
        finally:
            engine.shutdown()
    assert rank1 == 0
    check_refits(rows, model, first=1)
    rules = rows[-1]["engine_stats"][0]["rules"]
    assert rules["moe:w13"] == rules["moe:w2"] == 4  # one stacked gate/up and down per layer


def test_server_mode_refits_qwen3_through_http():
    # python -m sglang.launch_server (TP=2) over a dense Qwen3 (qk-norm), in its own process group; trainer
    # rank 0 drives it over HTTP; a tensor-parallel trainer this time
    from refit.engines.sglang.client import HTTPClient

    model = "tiny-qwen3"
    with tempfile.TemporaryDirectory() as d, server(model, d) as url:
        check = Checker(HTTPClient(url, ENGINE_TP), lambda: http_greedy(url), model)
        rows, rank1 = refit_session(check, "tp=2", steps=3, first=1)
    assert rank1 == 0
    check_refits(rows, model, first=1)
    rules = rows[-1]["engine_stats"][0]["rules"]
    assert rules["merged:0"] == rules["merged:1"] == 4 and rules["full"] == 4 * 4 + 1  # norms, q/k-norms
