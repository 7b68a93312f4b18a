"""Engine padding in real SGLang on CPU (float32, TP=2): one tiny model with every oddity.

``tiny-llama-odd``: SGLang on CPU pads its intermediate size of 136 to 192 (a multiple of 32 x tp; rank 0 holds
rows 0-95, rank 1 rows 96-135 then 56 rows of zeros) and its vocabulary of 1003 to 1024 (512 + 491 real rows).
A 2-rank tensor-parallel trainer refits the engine; refit fills the real rows only (rank 1's ``down_proj``
columns are a strided part of each row: received densely, copied in after the commit). After each refit SGLang's
greedy tokens equal HF's on the trainer's weights, and each rank received exactly the real bytes of its share in
``refit.layout.engines``' SGLang-CPU layout.
"""

import tempfile

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here (scripts/test.sh runs these in .venv-sglang)")

from refit.layout import box_numel  # noqa: E402
from refit.layout.engines import engine_layout  # noqa: E402
from refit.layout.models import load_config, param_shapes  # noqa: E402
from refit.layout.spec import parse_spec  # noqa: E402

from .harness import ENGINE_TP, Checker, make_engine, refit_session  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc, pytest.mark.timeout(900)]

ODD = "tiny-llama-odd"


@pytest.fixture(scope="module")
def odd():
    with tempfile.TemporaryDirectory() as d:
        engine = make_engine(ODD, d)
        try:
            yield engine
        finally:
            engine.shutdown()


def test_padded_intermediate_and_vocabulary_refit_sglang_tp2(odd):
    steps = 2
    rows, rank1 = refit_session(Checker.for_engine(odd, ODD), "tp=2", steps=steps, first=1)
    assert rank1 == 0
    lay = engine_layout(param_shapes(ODD), parse_spec(f"tp={ENGINE_TP}", "dst"), load_config(ODD), "sglang-cpu")
    need = [sum(box_numel(b) * 4 for _, b in lay.local_tensors(r)) for r in range(ENGINE_TP)]
    hidden, layers = load_config(ODD).hidden_size, load_config(ODD).num_hidden_layers
    # rank 1 holds 40 of 96 intermediate rows (gate, up, down) and 491 of 512 vocabulary rows (embedding, head)
    assert need[0] - need[1] == 4 * hidden * (3 * layers * (96 - 40) + 2 * (512 - 491))
    assert [r["version"] for r in rows] == list(range(1, 1 + steps))
    for r in rows:
        assert r["tokens"] == r["ref_tokens"], r
        assert r["max_dlogprob"] <= 1e-4, r
        assert r["produced_by"] == r["reported"] == str(r["version"])
        stats = r["engine_stats"]
        assert all(s["version"] == r["version"] and s["error"] is None for s in stats), stats
        assert [s["last_bytes"] for s in stats] == need  # real bytes only: padding never travels
    down = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(layers)]
    assert [s["strided"] for s in rows[-1]["engine_stats"]] == [[], down]
    assert len({r["loss"] for r in rows}) == steps
