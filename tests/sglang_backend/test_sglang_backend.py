"""refit into real SGLang on CPU (float32, offline ``sgl.Engine``, TP=2), from a 2-rank trainer.

One engine for the whole module over ``tiny-llama-odd``, a Llama with every oddity SGLang pads on CPU: its
intermediate size of 136 padded to 192 (a multiple of 32 x tp; rank 0 holds rows 0-95, rank 1 rows 96-135 then
56 rows of zeros) and its vocabulary of 1003 to 1024 (512 + 491 real rows). Several trainer sessions join it in
turn. After every refit: SGLang's greedy tokens equal HF transformers holding the trainer's weights, SGLang
reports that version (and generated with it), each SGLang TP rank received exactly the real bytes of its share
(counted from the config, independently of refit's regions: less than the model; padding never travels), and
the bytes moved equal the bytes needed (1.00). refit fills the real rows only (rank 1's ``down_proj`` columns
are a strided part of each row: received densely, copied in after the commit). A trainer rank killed half way
through a refit leaves SGLang on its last version, generating its tokens.
"""

import math
import tempfile

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here (scripts/test.sh runs these in .venv-sglang)")

from refit.layout import box_numel  # noqa: E402
from refit.layout.engines import engine_layout  # noqa: E402
from refit.layout.models import load_config, param_shapes  # noqa: E402
from refit.layout.spec import parse_spec  # noqa: E402

from .harness import ENGINE_TP, Checker, greedy, make_engine, refit_session, shard_bytes  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc, pytest.mark.timeout(900)]


def _model_bytes(model: str) -> int:
    return sum(math.prod(s) * 4 for _, s, _ in param_shapes(model))


MODEL = "tiny-llama-odd"


@pytest.fixture(scope="module")
def llama():
    """One SGLang engine (TP=2) over ``MODEL`` for the module's trainer sessions."""
    with tempfile.TemporaryDirectory() as d:
        engine = make_engine(MODEL, d)
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
    rows, rank1 = refit_session(Checker.for_engine(llama, MODEL), "fsdp=2", steps=3, first=1)
    assert rank1 == 0
    check_refits(rows, MODEL, first=1)
    # every trainer rank sends (no funnel through rank 0): FSDP2 rank 0 holds about half of every tensor
    total = _model_bytes(MODEL)
    assert 0.3 * total < rows[0]["bytes_sent_rank0"] < 0.7 * total


def test_tp_trainer_refits_sglang_tp2(llama):
    rows, rank1 = refit_session(Checker.for_engine(llama, MODEL), "tp=2", steps=3, first=4)
    assert rank1 == 0
    check_refits(rows, MODEL, first=4)
    total = _model_bytes(MODEL)
    assert rows[0]["bytes_sent_rank0"] < 0.7 * total
    # the padding: rank 1 holds 40 of 96 intermediate rows (gate, up, down) and 491 of 512 vocabulary rows
    # (embedding, head), and the library's SGLang-CPU layout says the same as the oracle
    cfg = load_config(MODEL)
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    need = [shard_bytes(MODEL, ENGINE_TP, w) for w in range(ENGINE_TP)]
    assert need[0] - need[1] == 4 * hidden * (3 * layers * (96 - 40) + 2 * (512 - 491))
    lay = engine_layout(param_shapes(MODEL), parse_spec(f"tp={ENGINE_TP}", "dst"), cfg, "sglang-cpu")
    assert need == [sum(box_numel(b) * 4 for _, b in lay.local_tensors(r)) for r in range(ENGINE_TP)]
    down = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(layers)]
    assert [s["strided"] for s in rows[-1]["engine_stats"]] == [[], down]  # copied in after the commit


def test_trainer_rank_killed_mid_refit_leaves_sglang_on_its_last_version(llama):
    rows, rank1 = refit_session(Checker.for_engine(llama, MODEL), "fsdp=2", steps=3, first=10, kill_at=11)
    assert rank1 == -9  # SIGKILL, half way through version 11
    assert rows[0]["version"] == 10 and rows[0]["tokens"] == rows[0]["ref_tokens"]
    assert rows[1]["version"] == 11 and "RefitAborted" in rows[1]["error"], rows[1]
    tokens, logprobs, version = greedy(llama)
    assert version == "10" and llama.get_model_info()["weight_version"] == "10"
    assert tokens == rows[0]["tokens"]  # staged commit: SGLang still holds version 10
    assert logprobs == rows[0]["logprobs"]  # bit for bit
    # and a new trainer can refit it again
    rows, rank1 = refit_session(Checker.for_engine(llama, MODEL), "tp=2", steps=1, first=20)
    assert rank1 == 0
    check_refits(rows, MODEL, first=20, steps=1)
