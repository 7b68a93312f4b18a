"""refit into real SGLang on CPU (float32, offline ``sgl.Engine``, TP=2), from a 2-rank trainer.

One engine per model for the whole module (starting one costs ~30 s here); several trainer sessions join
it in turn, each refitting it 3 times. After every refit: SGLang's greedy tokens equal HF transformers
holding the trainer's weights, SGLang reports that version (and generated with it), each SGLang TP rank
received exactly the bytes of its shard (counted from the config, independently of refit's regions: less
than the model), and the bytes moved equal the bytes needed (1.00). A trainer rank killed half way through
a refit leaves SGLang on its last version, generating its tokens.
"""

import math
import tempfile

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here (scripts/test.sh runs these in .venv-sglang)")

from refit.layout.models import param_shapes  # noqa: E402

from .harness import ENGINE_TP, Checker, greedy, make_engine, refit_session, shard_bytes  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc, pytest.mark.timeout(900)]


def _model_bytes(model: str) -> int:
    return sum(math.prod(s) * 4 for _, s, _ in param_shapes(model))


@pytest.fixture(scope="module")
def llama():
    """One SGLang engine (TP=2) over tiny-llama for the module's trainer sessions."""
    with tempfile.TemporaryDirectory() as d:
        engine = make_engine("tiny-llama", d)
        try:
            yield engine
        finally:
            engine.shutdown()


def check_refits(rows: list[dict], model: str, first: int, steps: int = 3) -> None:
    """Every refit of a session: tokens == HF, version reported, per-rank bytes == shard bytes, moved/needed 1.00."""
    assert [r["version"] for r in rows] == list(range(first, first + steps))
    need = [shard_bytes(model, ENGINE_TP, w) for w in range(ENGINE_TP)]
    assert sum(need) < ENGINE_TP * _model_bytes(model) and max(need) < _model_bytes(model)
    for r in rows:
        assert r["tokens"] == r["ref_tokens"], r
        assert r["max_dlogprob"] <= 1e-4, r  # and their logprobs: the weights, not just the argmax, match
        assert r["produced_by"] == r["reported"] == str(r["version"])
        stats = r["engine_stats"]
        assert [s["rank"] for s in stats] == list(range(ENGINE_TP))
        assert all(s["version"] == r["version"] and s["error"] is None for s in stats), stats
        got = [s["last_bytes"] for s in stats]
        assert got == need, (got, need)  # each SGLang rank received exactly its shard
        assert sum(got) / sum(need) == 1.0  # moved / needed
    # the trainer really changed the weights between refits
    assert len({r["loss"] for r in rows}) == steps


def test_fsdp2_trainer_refits_sglang_tp2(llama):
    rows, rank1 = refit_session(Checker.for_engine(llama, "tiny-llama"), "fsdp=2", steps=3, first=1)
    assert rank1 == 0
    check_refits(rows, "tiny-llama", first=1)
    # every trainer rank sends (no funnel through rank 0): FSDP2 rank 0 holds about half of every tensor
    total = _model_bytes("tiny-llama")
    assert 0.3 * total < rows[0]["bytes_sent_rank0"] < 0.7 * total


def test_tp_trainer_refits_sglang_tp2(llama):
    rows, rank1 = refit_session(Checker.for_engine(llama, "tiny-llama"), "tp=2", steps=3, first=4)
    assert rank1 == 0
    check_refits(rows, "tiny-llama", first=4)
    total = _model_bytes("tiny-llama")
    assert rows[0]["bytes_sent_rank0"] < 0.7 * total


def test_trainer_rank_killed_mid_refit_leaves_sglang_on_its_last_version(llama):
    rows, rank1 = refit_session(Checker.for_engine(llama, "tiny-llama"), "fsdp=2", steps=3, first=10, kill_at=11)
    assert rank1 == -9  # SIGKILL, half way through version 11
    assert rows[0]["version"] == 10 and rows[0]["tokens"] == rows[0]["ref_tokens"]
    assert rows[1]["version"] == 11 and "RefitAborted" in rows[1]["error"], rows[1]
    tokens, logprobs, version = greedy(llama)
    assert version == "10" and llama.get_model_info()["weight_version"] == "10"
    assert tokens == rows[0]["tokens"]  # staged commit: SGLang still holds version 10
    assert logprobs == rows[0]["logprobs"]  # bit for bit
    # and a new trainer can refit it again
    rows, rank1 = refit_session(Checker.for_engine(llama, "tiny-llama"), "tp=2", steps=1, first=20)
    assert rank1 == 0
    check_refits(rows, "tiny-llama", first=20, steps=1)
