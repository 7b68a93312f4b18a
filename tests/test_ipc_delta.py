"""Deltas over CUDA IPC links, what runs without a GPU: the staging's header (packed, read back, every check), the
pairs and messages the rule lets go as words per link kind, which configs carry deltas over IPC, and a source's
find, staging and base update on CPU tensors with the word kernels in Triton's interpreter, read back as a receiver
reads them. The refits on GPUs run in tests/test_gpu_ipc_delta.py."""

from pathlib import Path

import numpy as np
import pytest
import torch

from interpreter import assert_all_ok_in_interpreter, needs_triton
from refit.config import TransferConfig
from refit.delta.rule import IPC_PAIR_S, LINKS, choose_words, ipc_link
from refit.delta.staging import DENSE, MAGIC, header_bytes, offsets, pack_header, read_header, used_bytes
from refit.delta.wire import DeltaError, wire_sizes
from refit.errors import ConfigError
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.transport.ipc_delta import _batches, pair_facts, wanted

NWORDS = np.array([100, 7, -1, 50], dtype=np.int64)  # the third message has no words: it can only go dense


def test_header_round_trip_and_payload_offsets():
    counts = np.array([3, DENSE, DENSE, 0], dtype=np.int64)
    raw = pack_header(5, 6, counts)
    assert raw[0] == MAGIC and raw.tolist()[1:4] == [5, 6, 4]
    base, got = read_header(raw, 6, NWORDS, cap=1 << 20, who="process 0")
    assert base == 5 and got.tolist() == counts.tolist()
    # after the header: 3 words (indices padded to 16 bytes, then 24 bytes), then nothing for the dense ones
    assert (offsets(counts) - header_bytes(4)).tolist() == [0, 40, 40, 40]
    assert used_bytes(counts) == header_bytes(4) + int(wire_sizes(3))
    # a source without a base sends every message dense
    assert read_header(pack_header(None, 6, np.full(4, DENSE)), 6, NWORDS, 1 << 20, "process 0")[0] is None


@pytest.mark.parametrize(
    "raw,cap,match",
    [
        (np.zeros(8, dtype=np.int64), 1 << 20, "holds no header of 4 messages"),  # a staging never written
        (pack_header(5, 6, [0, 0, DENSE, 0])[:-1], 1 << 20, "holds no header of 4 messages"),
        (pack_header(5, 7, [0, 0, DENSE, 0]), 1 << 20, "holds version 7, this refit is version 6"),
        (pack_header(5, 6, [101, 0, DENSE, 0]), 1 << 20, "claims 101 changed words in message 0 of 100 words"),
        (pack_header(5, 6, [0, 0, 0, 0]), 1 << 20, "claims 0 changed words in message 2 of 0 words"),
        (pack_header(5, 6, [0, -2, DENSE, 0]), 1 << 20, "claims -2 changed words in message 1"),
        (pack_header(None, 6, [1, DENSE, DENSE, DENSE]), 1 << 20, "sends deltas on base version -1"),
        (pack_header(5, 6, [100, 7, DENSE, 50]), header_bytes(4) + 100, "claims 1952 bytes of payload and header"),
    ],
)
def test_header_checks_name_the_source_and_what_is_wrong(raw, cap, match):
    with pytest.raises(DeltaError, match=match):
        read_header(raw, 6, NWORDS, cap, "process 3")
    with pytest.raises(DeltaError, match="process 3"):
        read_header(raw, 6, NWORDS, cap, "process 3")


def test_header_fits_its_cap_exactly():
    counts = np.array([100, 7, DENSE, 50], dtype=np.int64)
    cap = used_bytes(counts)
    assert read_header(pack_header(1, 2, counts), 2, NWORDS, cap, "p")[1].tolist() == counts.tolist()
    with pytest.raises(DeltaError, match="in a staging of"):
        read_header(pack_header(1, 2, counts), 2, NWORDS, cap - 8, "p")


SHAPES = [(n, s, torch.bfloat16) for n, s, _ in param_shapes("tiny-llama")]
# large enough for the rule's best case to pay over NVLink (tiny-llama's pieces, 128 KiB at most, never do)
LARGE = [(f"model.layers.{i}.mlp.up_proj.weight", (4096, 4096), torch.bfloat16) for i in range(8)]
LARGE += [("model.layers.0.input_layernorm.weight", (4096,), torch.bfloat16)]


def _plan(devices, delta="auto", transport="ipc", buffer_bytes=64 << 20, shapes=SHAPES):
    lay = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    cfg = TransferConfig(transport=transport, delta=delta, buffer_bytes=buffer_bytes)
    return build_plan(lay, lay, ProcessMap((0,), (1,), devices), cfg), cfg


def test_same_gpu_links_have_no_delta_pair_and_the_rule_says_dense_there():
    plan, cfg = _plan(("cuda:0", "cuda:0"), delta="words")
    assert {m.transport for m in plan.messages} == {"ipc"}
    assert pair_facts(plan, cfg) == {}  # forced words too: a same-GPU IPC link stays dense
    assert wanted(plan, cfg)  # the link runs in delta mode all the same: its statistics say why it is dense
    assert choose_words([(1 << 20, 0, 2)], ipc_link(LINKS["same_device"])) == "dense"


def test_nvlink_pair_under_auto_takes_the_large_pieces_and_leaves_the_small_ones_dense():
    small = pair_facts(*_plan(("cuda:0", "cuda:1")))[(0, 1)]
    assert not small.words.any() and small.cap == 0  # no piece pays: no staging, every message dense
    plan, cfg = _plan(("cuda:0", "cuda:1"), shapes=LARGE)
    facts = pair_facts(plan, cfg)
    assert list(facts) == [(0, 1)]
    f = facts[(0, 1)]
    assert f.ids == [k for k, m in enumerate(plan.messages) if m.transport == "ipc"]
    assert f.link.chunk_s == IPC_PAIR_S and f.link.link_gbps == LINKS["nvlink"].link_gbps
    sizes = np.array([plan.messages[k].nbytes for k in f.ids])
    assert f.words.tolist() == [True] * 8 + [False]  # the norm's 8 KiB: dense (the per-piece cost outweighs it)
    assert np.isclose(f.share.sum(), 1.0)
    assert f.cap == header_bytes(len(f.ids)) + (128 << 20)  # 256 MiB of candidates, the 2 x 64 MiB budget
    assert sizes[f.words].sum() == 8 * 4096 * 4096 * 2
    forced = pair_facts(*_plan(("cuda:0", "cuda:1"), delta="words"))[(0, 1)]
    assert forced.words.all()  # forced: every piece with whole words, tiny ones too


def test_staging_holds_at_most_the_budget_of_payload():
    plan, cfg = _plan(("cuda:0", "cuda:1"), delta="words", buffer_bytes=4096)
    f = pair_facts(plan, cfg)[(0, 1)]
    assert f.cap == header_bytes(len(f.ids)) + 2 * 4096


def test_config_carries_deltas_over_ipc_in_one_unpaced_stage_with_the_base_on_the_device():
    for delta in ("auto", "words", "sparse", "bitmask"):
        assert TransferConfig(transport="ipc", delta=delta).ipc_delta_refusal is None
    refused = [
        ({"stages": 2}, "TransferConfig.stages=2"),
        ({"pull_gbps": 5.0}, "TransferConfig.pull_gbps=5.0 must be None"),
        ({"delta_base": "host"}, "delta_base='host'"),
    ]
    plan, _ = _plan(("cuda:0", "cuda:1"), transport="auto")
    for extra, match in refused:
        with pytest.raises(ConfigError, match=match):
            TransferConfig(transport="ipc", delta="auto", **extra)
        # under "auto": whether the IPC links run deltas follows the fields every process agrees on (the stages);
        # a process's own pace or host base makes its side dense (``IpcDelta``)
        assert wanted(plan, TransferConfig(transport="auto", delta="auto", **extra)) == ("stages" not in extra)
    assert not wanted(_plan(("cuda:0", "cuda:1"), delta="off")[0], TransferConfig(transport="ipc"))


def test_find_batches_follow_the_order_and_the_byte_bound(monkeypatch):
    import refit.transport.ipc_delta as ipc_delta

    monkeypatch.setattr(ipc_delta, "WORD_BATCH_BYTES", 100)
    assert _batches([0, 2, 3, 5], [60, 0, 40, 10, 0, 90]) == [[0, 2], [3, 5]]
    assert _batches([0, 2, 3, 5], [60, 0, 40, 10, 0, 91]) == [[0, 2], [3], [5]]
    assert _batches([], [1]) == []
    assert _batches([1], [1, 500]) == [[1]]  # one piece over the bound is a batch alone


@needs_triton
@pytest.mark.timeout(300)
def test_source_stages_what_a_receiver_scatters_exactly_in_interpreter():
    """``ipc_delta_interpret.py``: forced words and ``auto`` over 0% to 100% changed, a receiver on another base,
    a staging too small for every delta; a receiver's ``IpcDelta`` pulls (its header check, dense copies, checked
    scatter, ``verify``), reading the source's staging in place and through its landing copy."""
    assert_all_ok_in_interpreter(Path(__file__).with_name("ipc_delta_interpret.py"), 280)
