"""Delta refits: the encoding functions (exact over consecutive versions, the cost rule's choices), the
header checks, and multi-process refits on CPU gloo (exact, fewer bytes, base versions, heal)."""

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interpreter import assert_all_ok_in_interpreter, needs_triton
from refit.config import TransferConfig
from refit.delta.chunks import plan_may_pay
from refit.delta.elements import apply_changes, bits, check_indices, check_indices_many, find_changes
from refit.delta.header import QUIET_MAX, announced, check_header, exchange_held
from refit.delta.payload import word_parts
from refit.delta.rule import (
    LINKS,
    PAY_MARGIN,
    choose_encoding,
    choose_words,
    choose_words_many,
    may_pay,
    predicted_seconds,
    prefer_words,
    words_changed,
)
from refit.delta.wire import DeltaError, decode, encode, wire_bytes
from refit.delta.words import check_words_many, find_words, scatter_words_many, words_in
from refit.errors import ConfigError, RefitAborted
from refit.layout import box_slices
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.tools.launch import WorkerError, run_local
from refit.transfer import Receiver, Sender
from refit.transport.p2p import _Op

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def _step(cur: torch.Tensor, fraction: float, gen: torch.Generator) -> None:
    """Change about ``fraction`` of ``cur``'s elements in place, scattered (an optimizer-like step), with
    the bit patterns a value compare would miss: -0.0 where 0.0 was, NaN."""
    flat = cur.view(-1) if cur.is_contiguous() else None
    mask = torch.rand(cur.shape, generator=gen) < fraction
    noise = torch.randn(cur.shape, generator=gen).to(cur.dtype)
    new = torch.where(mask, noise, cur)
    cur.copy_(new)
    if flat is not None and flat.numel() > 2 and cur.dtype != torch.float8_e4m3fn:
        flat[0] = -0.0 if flat[0].item() == 0 else flat[0]
        flat[1] = float("nan") if fraction > 0.2 else flat[1]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.is_contiguous() else _same_bits(a.clone(), b)


@settings(max_examples=12)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    encoding=st.sampled_from(("sparse", "bitmask")),
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    strided=st.booleans(),
    chunk=st.sampled_from([16, 1 << 20]),
)
def test_twenty_consecutive_deltas_are_exact(seed, dtype, encoding, rows, cols, strided, chunk):
    gen = torch.Generator().manual_seed(seed)
    whole = torch.randn(rows, cols + 3, generator=gen).to(dtype)
    cur = whole[:, 1 : cols + 1] if strided else whole[:, :cols].contiguous()  # a column slice: strided
    base, engine = cur.clone(), cur.clone()
    engine_view = torch.zeros(rows, cols + 2, dtype=dtype)[:, 1:-1]  # strided destination too
    engine_view.copy_(engine)
    for _ in range(20):
        _step(cur, float(torch.rand(1, generator=gen)) ** 3, gen)
        idx, vals = find_changes(base, cur, chunk_bytes=chunk)
        want = (
            base.contiguous().view(torch.uint8).view(-1, dtype.itemsize)
            != cur.contiguous().view(torch.uint8).view(-1, dtype.itemsize)
        ).any(1)
        assert torch.equal(idx, want.nonzero().squeeze(1))
        n = cur.numel()
        payload = torch.empty(wire_bytes(encoding, n, len(idx), dtype.itemsize), dtype=torch.uint8)
        encode(encoding, n, idx, vals, payload)
        got_idx, got_vals = decode(encoding, n, len(idx), payload, dtype)
        check_indices(got_idx, n, "test")
        apply_changes(engine_view, got_idx, got_vals)
        apply_changes(base, idx, vals)
        assert _same_bits(engine_view, cur)
        assert _same_bits(base, cur)


@settings(max_examples=12)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 24),
    cols8=st.integers(1, 5),
    strided=st.booleans(),
)
def test_twenty_consecutive_word_deltas_are_exact(seed, dtype, rows, cols8, strided):
    """Changed 64-bit words (``refit.delta.words``, the torch path) through the wire format, into a strided
    destination and into the base, over 20 random steps: every step bit-exact."""
    gen = torch.Generator().manual_seed(seed)
    cols = cols8 * 8  # whole words for every dtype
    whole = torch.randn(rows, cols + 8, generator=gen).to(dtype)
    cur = whole[:, 8:] if strided else whole[:, :cols].contiguous()
    base = cur.clone()
    engine_view = torch.zeros(rows, cols + 16, dtype=dtype)[:, 8:-8]
    engine_view.copy_(cur)
    n, nwords = cur.numel(), words_in(cur)
    for _ in range(20):
        _step(cur, float(torch.rand(1, generator=gen)) ** 3, gen)
        idx, words = find_words(base, cur)
        per = 8 // dtype.itemsize
        want = (base.contiguous().view(torch.int64) != cur.contiguous().view(torch.int64)).reshape(-1)
        assert torch.equal(idx.long(), want.nonzero().squeeze(1)) and nwords == n // per
        payload = torch.empty(wire_bytes("words", n, len(idx), dtype.itemsize), dtype=torch.uint8)
        parts = word_parts(idx, words)
        torch.cat(parts, out=payload)
        got_idx, got_words = decode("words", n, len(idx), payload, dtype)
        assert check_words_many([(got_idx, nwords)])
        scatter_words_many([(engine_view, got_idx, got_words), (base, idx, words)])
        assert _same_bits(engine_view, cur)
        assert _same_bits(base, cur)
    bad = torch.tensor([0, nwords], dtype=torch.int32)
    assert not check_words_many([(bad, nwords)]) and not check_words_many([(bad - 1, nwords)])


def test_the_rule_picks_dense_on_one_device_and_when_everything_changed():
    n = 1 << 24  # a 32 MiB bf16 tensor
    for f in (0.0, 0.001, 0.01, 0.1, 1.0):
        assert choose_encoding([(n, int(f * n), 2)], LINKS["same_device"]) == "dense"
    for link in ("nic", "cpu"):
        assert choose_encoding([(n, n, 2)], LINKS[link]) == "dense"
        assert choose_encoding([(n, n // 100, 2)], LINKS[link]) == "sparse"
    assert choose_encoding([(n, n // 10, 2)], LINKS["nic"]) == "bitmask"  # 10% of bf16: a bit beats an index
    assert choose_encoding([(0, 0, 2)], LINKS["nic"]) == "dense"


def test_the_rule_never_picks_a_delta_slower_than_dense_at_the_measured_h100_rates():
    """docs/benchmarks.md (H100, Llama-3.1-8B shapes, 16.06 GB bf16 in 291 pieces, 1% changed): find
    41 ms, pack + base update + apply 33 ms, dense over NVLink 42 ms. A delta cannot win on NVLink:
    the rule sends dense at every fraction (the model's total agrees with what was measured), and
    sparse over a 50 GB/s NIC, where dense takes 320 ms."""
    pieces = 291
    n = 16_060_000_000 // 2 // pieces
    for f in (0.0, 0.001, 0.01, 0.1, 1.0):
        assert choose_encoding([(n, int(f * n), 2)] * pieces, LINKS["nvlink"]) == "dense", f
    at_1pct = sum(predicted_seconds("sparse", n, n // 100, 2, LINKS["nvlink"]) for _ in range(pieces))
    assert 0.065 < at_1pct < 0.085  # 41 + 33 ms measured (+ 1.3 ms on the wire)
    assert choose_encoding([(n, n // 100, 2)] * pieces, LINKS["nic"]) == "sparse"
    fast_find = replace(LINKS["nvlink"], find_gbps=3000.0, apply_gbps=3000.0, piece_s=0.0)  # at HBM speed
    assert choose_encoding([(n, n // 1000, 2)] * pieces, fast_find) == "sparse"
    with pytest.raises(ConfigError, match="LinkSpeed.piece_s"):
        replace(LINKS["nic"], piece_s=-1.0)


def test_a_delta_must_pay_by_a_margin_and_auto_runs_the_plain_path_where_none_can():
    # the 1 GB embedding of Llama-3.1-8B over NVLink: its best case (nothing changed) beats dense by ~1%,
    # inside the rates' error and less than the delta path's own header exchange costs: never diffed
    emb = (128_256 * 4096, 2)
    best = predicted_seconds("sparse", emb[0], 0, 2, LINKS["nvlink"])
    assert best < predicted_seconds("dense", emb[0], 0, 2, LINKS["nvlink"]) < best / PAY_MARGIN
    assert not may_pay([emb], LINKS["nvlink"]) and not may_pay([emb], LINKS["same_device"])
    assert may_pay([emb], LINKS["nic"]) and may_pay([emb], LINKS["cpu"]) and not may_pay([(0, 2)], LINKS["nic"])
    lay = layout_from_spec(param_shapes("llama-3.1-8b"), parse_spec("tp=1", "src"))
    cfg = TransferConfig(transport="p2p", delta="auto")
    for devices, pays in (
        (("cuda:0", "cuda:1"), False),  # NVLink: the plain P2P path, no base copy, no header exchange
        (("a/cuda:0", "b/cuda:0"), True),  # a NIC between hosts
        (None, True),  # CPU processes (gloo)
    ):
        plan = build_plan(lay, lay, ProcessMap((0,), (1,), devices), config=cfg)
        assert plan_may_pay(plan, cfg) is pays, devices
    # word deltas over NVLink pay where the chunks are few (each chunk's header exchange and syncs cost
    # ~1 ms): with a 2 x 2 GiB staging budget (S1 measured 0.47-0.51x dense), not with 2 x 256 MiB (1.1x)
    for buffer_mb, pays in ((2048, True), (256, False)):
        cfg = TransferConfig(transport="p2p", delta="auto", num_buffers=2, buffer_bytes=buffer_mb << 20)
        plan = build_plan(lay, lay, ProcessMap((0,), (1,), ("cuda:0", "cuda:1")), config=cfg)
        assert plan_may_pay(plan, cfg) is pays, buffer_mb


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 1 << 26), st.floats(0, 0.6), st.sampled_from([1, 2, 4])), min_size=1, max_size=4
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from(["nvlink", "nic", "same_device"]),
)
def test_the_rule_at_once_decides_every_message_as_one_at_a_time(messages, link_name):
    """``choose_words_many`` (a find batch's messages at once, numpy) picks what ``choose_words`` picks for each
    message: the same sums in the same order, the share of a chunk included."""
    import numpy as np

    link = LINKS[link_name]
    pieces = [[(n, int(f * n * s / 8), s) for n, f, s in m] for m in messages]
    shares = [sum(n * s for n, _, s in m) / (4 << 30) for m in pieces]
    flat = [p for m in pieces for p in m]
    n, k, size = (np.array([p[i] for p in flat], dtype=np.int64) for i in range(3))
    first = np.cumsum([0, *(len(m) for m in pieces)])
    got = choose_words_many(n, k, size, first, link, np.array(shares))
    assert got.tolist() == [choose_words(m, link, sh) == "words" for m, sh in zip(pieces, shares)]


def test_the_rule_weighs_words_with_their_share_of_a_chunk():
    """A 55 MB bf16 tensor over NVLink: words at 1% changed (3.9% of the words) beat dense in a 4 GiB chunk,
    not alone in a 64 MiB one (its chunk's fixed cost); at 10% (34% of the words) dense wins."""
    n, link = 27_000_000, LINKS["nvlink"]
    words = int(0.039 * n / 4)
    assert choose_words([(n, words, 2)], link, share=n * 2 / (4 << 30)) == "words"
    assert choose_words([(n, words, 2)], link, share=1.0) == "dense"
    assert choose_words([(n, int(0.34 * n / 4), 2)], link, share=n * 2 / (4 << 30)) == "dense"
    assert choose_words([(n, 0, 2)], LINKS["same_device"]) == "dense"
    # whether auto finds a whole-word message per word: on CUDA links (word find 1.7 TB/s against 0.78 per
    # element, 2 us against 108 us per piece) yes; over CPU gloo (the same find rate, twice the bytes) no
    assert prefer_words([(n, 2)], link) and prefer_words([(2 * n, 1)], LINKS["nic"])
    assert not prefer_words([(n, 2)], LINKS["cpu"])
    # the words changed at 1% of the elements: 4 bf16 per word, 8 FP8, 1 float64
    assert words_changed(0.01, 2) == pytest.approx(0.0394, abs=1e-4)
    assert words_changed(0.01, 1) == pytest.approx(0.0773, abs=1e-4) and words_changed(0.01, 8) == pytest.approx(0.01)
    # Llama-3.1-8B's k/v projection (1024 x 4096 bf16, 8 MiB) in a 4 GiB chunk: worth a diff, and sent as words
    # at 1% (measured faster than dense on 2x H200); a 4096-element norm is never diffed (its best case loses)
    kv, share = 1024 * 4096, 1024 * 4096 * 2 / (4 << 30)
    assert may_pay([(kv, 2)], link, words=True, share=share) and not may_pay([(4096, 2)], link, words=True)
    assert choose_words([(kv, round(words_changed(0.01, 2) * kv / 4), 2)], link, share=share) == "words"


def test_sparse_wire_bytes_at_one_percent_of_bf16_are_under_eight_percent_of_dense():
    n = 1 << 24
    assert wire_bytes("sparse", n, n // 100, 2) / wire_bytes("dense", n, n // 100, 2) < 0.08


def test_out_of_range_indices_never_reach_the_scatter():
    with pytest.raises(DeltaError, match="index 12 is outside the piece's 12 elements"):
        check_indices_many(
            [(torch.tensor([1, 2]), 4), (torch.tensor([], dtype=torch.int64), 0), (torch.tensor([12]), 12)], "x"
        )
    check_indices_many([(torch.tensor([0, 3]), 4), (torch.tensor([11]), 12)], "x")
    # each piece against its own bound (side by side: an index fine for the first piece, not the second)
    i32 = partial(torch.tensor, dtype=torch.int32)
    check_indices_many([(i32([9, 0]), 10), (i32([3]), 4)], "x")
    with pytest.raises(DeltaError, match="index 5 is outside the piece's 4 elements"):
        check_indices_many([(i32([9, 5]), 10), (i32([5]), 4), (i32([0]), 1)], "x")
    with pytest.raises(DeltaError, match="index -1 is outside the piece's 10 elements"):
        check_indices_many([(i32([0]), 4), (i32([-1, 2]), 10)], "x")
    with pytest.raises(DeltaError, match="index 4 is outside"):  # int32 and int64 pieces together
        check_indices_many([(i32([3]), 4), (torch.tensor([4]), 4)], "x")
    with pytest.raises(DeltaError, match="outside the piece's 10 elements"):
        check_indices(torch.tensor([3, 10], dtype=torch.int32), 10, "x")
    with pytest.raises(DeltaError, match="marks 1 elements, its header says 2"):
        decode("bitmask", 8, 2, torch.tensor([1] + [0] * 15, dtype=torch.uint8), torch.uint8)


def test_a_host_sparse_delta_is_scattered_only_when_every_index_is_inside_its_piece():
    from refit.delta.ops import DeltaOp
    from refit.delta.receive import host_sparse, scatter_host
    from refit.delta.rule import LINKS

    dst = torch.zeros(10, dtype=torch.bfloat16)
    op = DeltaOp(_Op(3, 0, dst, [], ("w",), step=0), [dst], [], LINKS["cpu"], torch.empty(0), kind="sparse")

    def payload(idx: list[int]) -> torch.Tensor:
        out = torch.zeros(wire_bytes("sparse", 10, len(idx), 2), dtype=torch.uint8)
        encode("sparse", 10, torch.tensor(idx), torch.full((len(idx),), 2.0, dtype=torch.bfloat16), out)
        return out

    for bad, named in (([-1, 2], -1), ([3, 10], 10), ([-(2**31), 0], -(2**31))):  # negative ones too
        op.changes, op.payload = [len(bad)], payload(bad)
        with pytest.raises(DeltaError, match=f"index {named} is outside the piece's 10 elements"):
            host_sparse([op])
        assert not dst.any()
    for _ in range(2):  # the destination's view is kept for the next refit
        op.changes, op.payload = [2], payload([0, 9])
        items, rest = host_sparse([op])
        scatter_host(items)
        assert not rest and dst[[0, 9]].tolist() == [2.0, 2.0] and not dst[1:9].any()


def test_indices_are_checked_chunk_by_chunk_with_each_piece_against_its_bound(monkeypatch):
    import refit.delta.elements as delta

    monkeypatch.setattr(delta, "CHECK_CHUNK", 3)  # several chunks, one piece alone in a chunk
    monkeypatch.setattr(delta, "CHECK_ALONE", 4)  # the piece of 4 indices checked on its own
    i32 = partial(torch.tensor, dtype=torch.int32)
    good = [(i32([1, 2]), 3), (i32([0, 1, 2, 3]), 4), (i32([5]), 6), (torch.tensor([1]), 2)]
    check_indices_many(good, "x")
    for k, bad in ((0, i32([3, 0])), (1, i32([0, 4, 1, 2])), (2, i32([-2])), (3, torch.tensor([2]))):
        pieces = list(good)
        pieces[k] = (bad, good[k][1])
        with pytest.raises(DeltaError, match=f"outside the piece's {good[k][1]} elements"):
            check_indices_many(pieces, "x")


def test_a_delta_on_another_base_version_is_refused_naming_both_versions():
    op = _Op(peer=3, tag=0, tensor=torch.empty(0), pack=[], names=("w",), step=0)
    with pytest.raises(
        DeltaError, match=r"computed on base version 4, process 7 \(destination rank 1\) holds version 3"
    ):
        check_header([1, 4, 5, 2], [10], version=5, held=3, op=op, me="process 7 (destination rank 1)")
    with pytest.raises(DeltaError, match="holds no version"):
        check_header([2, 4, 5, 2], [10], version=5, held=None, op=op)
    assert check_header([0, -1, 5, 0], [10], version=5, held=None, op=op) == ("dense", [0])  # dense heals
    with pytest.raises(DeltaError, match="claims 11 changes in a piece of 10"):
        check_header([1, 4, 5, 11], [10], version=5, held=4, op=op)
    with pytest.raises(DeltaError, match="is of version 6"):
        check_header([1, 4, 6, 1], [10], version=5, held=4, op=op)


def test_word_and_dense_headers_read_at_once_only_when_every_field_is_what_check_header_accepts():
    """A receiver reads one peer's headers at once (``headers_at_once``) only where each would pass
    ``check_header`` as words or as dense (counts 0, as senders write them); any other header leaves every op
    untouched, for ``check_header`` to name."""
    from refit.delta.ops import DeltaOp
    from refit.delta.receive import headers_at_once
    from refit.delta.wire import ENCODINGS

    group = []
    for pieces in ([16, 8], [4]):  # words per piece
        op = _Op(
            peer=3, tag=0, tensor=torch.empty(sum(pieces) * 4, dtype=torch.bfloat16), pack=[], names=("w",), step=0
        )
        d = DeltaOp(op, [torch.zeros(n * 4, dtype=torch.bfloat16) for n in pieces], [], LINKS["nvlink"], torch.empty(0))
        d.nwords = pieces
        group.append(d)
    words, dense = ENCODINGS.index("words"), ENCODINGS.index("dense")
    good = [words, 4, 5, 3, 8, words, 4, 5, 0]
    bad = {
        "a count over its piece": [words, 4, 5, 3, 9, words, 4, 5, 0],
        "a negative count": [words, 4, 5, -1, 8, words, 4, 5, 0],
        "another base": [words, 3, 5, 3, 8, words, 4, 5, 0],
        "another version": [words, 4, 5, 3, 8, words, 4, 6, 0],
        "not words": [words, 4, 5, 3, 8, ENCODINGS.index("sparse"), 4, 5, 0],
        "a dense count": [words, 4, 5, 3, 8, dense, -1, 5, 1],
        "a dense one of another version": [words, 4, 5, 3, 8, dense, -1, 4, 0],
        "too short": good[:-1],
    }
    for what, header in bad.items():
        assert not headers_at_once(group, header, version=5, held=4), what
        assert [d.kind for d in group] == ["dense", "dense"] and all(d.wire == 0 for d in group), what
        assert all(d.payload is None for d in group), what
    assert not headers_at_once(group, good, version=5, held=None)  # no base held: no delta applies
    assert headers_at_once(group, good, version=5, held=4)
    assert [(d.kind, d.changes, d.wire) for d in group] == [("words", [3, 8], 16 + 24 + 32 + 64), ("words", [0], 0)]
    for d, n in zip(group, ([16, 8], [4])):  # the same as op by op
        assert check_header(good[:3] + d.changes, n, 5, 4, op, words=n) == ("words", d.changes)
    mixed = [dense, -1, 5, 0, 0, words, 4, 5, 2]  # a dense message (any base) beside one of words
    for held in (4, None):
        expect = held is not None
        assert headers_at_once(group, mixed, version=5, held=held) == expect
    assert [(d.kind, d.changes) for d in group] == [("dense", [0, 0]), ("words", [2])]
    assert group[0].payload is group[0].op.tensor and group[1].payload is None and group[1].wire == 8 + 16
    assert check_header(mixed[:5], [64, 32], 5, 4, group[0].op, words=[16, 8]) == ("dense", [0, 0])
    assert headers_at_once(group, [dense, -1, 5, 0, 0, dense, 7, 5, 0], version=5, held=None)  # a first refit
    assert [d.kind for d in group] == ["dense", "dense"]


def test_held_records_and_quiet_trailers_are_checked_field_by_field():
    """What a peer publishes before a delta refit (``{"held", "quiet"}``) and the quiet refits a header
    announces are checked before use: anything else raises ``DeltaError`` naming the process."""

    class Store:  # the signed store's get/put, returning one record
        def __init__(self, rec):
            self.rec = rec

        def put(self, key, value):
            self.rec = value

        def get(self, key, timeout_s):
            return self.rec

    out, told = exchange_held(Store({"held": 3, "quiet": [0, 5]}), "k", 0, None, False, [1], 1.0)
    assert out == {0: None, 1: 3} and told == {1: True}
    assert exchange_held(Store(None), "k", 2, 4, True, [], 1.0) == ({2: 4}, {})
    bad = [{"held": 3}, {"held": -1, "quiet": []}, {"held": True, "quiet": []}, {"held": 3, "quiet": ["0"]}]
    bad += [{"held": 3, "quiet": [True]}, {"held": 3, "quiet": 0}, {"held": 3, "quiet": [], "x": 1}, [3], None]
    for rec in bad:
        with pytest.raises(DeltaError, match="process 1 published"):
            exchange_held(Store(rec), "k", 0, None, False, [1], 1.0)
    op = _Op(peer=3, tag=0, tensor=torch.empty(0), pack=[], names=("w",), step=0)
    assert announced(QUIET_MAX, op) == QUIET_MAX
    for value in (-1, QUIET_MAX + 1):
        with pytest.raises(DeltaError, match=f"from process 3: {value} quiet refits announced"):
            announced(value, op)


def test_config_refuses_unknown_delta_settings():
    with pytest.raises(ConfigError, match="TransferConfig.delta must be one of"):
        TransferConfig(delta="yes")
    with pytest.raises(ConfigError, match="delta_base"):
        TransferConfig(delta="auto", delta_base="disk")
    with pytest.raises(ConfigError, match="delta_link_gbps"):
        TransferConfig(delta="auto", delta_link_gbps=0)
    with pytest.raises(ConfigError, match="checksums"):
        TransferConfig(delta="auto", checksums=True)
    with pytest.raises(ConfigError, match="over CUDA IPC pulls in one stage, not TransferConfig.stages=2"):
        TransferConfig(delta="sparse", transport="ipc", stages=2)  # the rest: tests/test_ipc_delta.py


def test_auto_sends_deltas_between_hosts_over_p2p_even_where_nixl_is_installed(monkeypatch):
    import refit.config

    monkeypatch.setattr(refit.config, "nixl_installed", lambda: True)
    assert TransferConfig(transport="auto").cross_host == "nixl"
    assert TransferConfig(transport="auto", delta="auto").cross_host == "p2p"
    src = layout_from_spec(SHAPES, parse_spec("tp=1", "src"))
    dst = layout_from_spec(SHAPES, parse_spec("tp=1", "dst"))
    two_hosts = ProcessMap((0,), (1,), ("host-a/cpu:1", "host-b/cpu:2"))
    for delta, want in (("off", "nixl"), ("auto", "p2p")):
        plan = build_plan(src, dst, two_hosts, TransferConfig(transport="auto", delta=delta))
        assert {m.transport for m in plan.messages} == {want}


# ------------------------------------------------------------------------------------- multi-process (gloo)

SHAPES = [(n, s, torch.bfloat16) for n, s, _ in param_shapes("tiny-llama")]
VERSIONS = 6


def _weights(layout, rank, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        t.name: torch.randn(t.shape, generator=gen).to(t.dtype)[box_slices(b)].clone()
        for t, b in layout.local_tensors(rank)
    }


def _optimizer_step(local, version, burst=()):
    """Master weights in float32 plus a tiny update, rounded to bf16: a few bf16 values change (at a version
    in ``burst``, nearly every value does)."""
    gen = torch.Generator().manual_seed(1000 + version)
    for t in local.values():
        share, scale = (1.0, 0.5) if version in burst else (0.05, 2e-3)
        upd = torch.randn(t.shape, generator=gen) * scale * (torch.rand(t.shape, generator=gen) < share)
        t.copy_((t.float() + upd * t.float().abs()).to(t.dtype))


def _delta_worker(world, src, dst, config, mode):
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    burst = (5,) if mode == "burst" else ()  # version 5 changes nearly every value: words over their slots
    if world.src_rank is not None:
        local = {n: t for n, t in _weights(src, world.src_rank, 0).items()}
        s = Sender(src, dst, world.rank, local, procs=procs, config=config)
        if mode == "lie":  # a buggy sender that believes every receiver holds its base
            s._held = lambda v, a, d: {p: s.executor.delta.base.version for p in range(world.world_size)}
        at = [0]  # the version being pushed
        if mode == "corrupt":
            _corrupt_an_index_at_version_3(at)
        out = []
        for v in range(1, (3 if mode == "corrupt" else VERSIONS) + 1):
            at[0] = v
            if v > 1:
                _optimizer_step(local, v, burst)
            try:
                st = s.push(v)
            except RefitAborted as e:
                if mode != "corrupt":
                    raise
                out.append(("refused", str(e)))
                break
            if config.delta == "words" and mode not in ("lie", "corrupt"):  # nothing stale, shared ones committed
                assert _base_is_sent(s, local), f"version {v}: the sender's base is not the weights it sent"
            if st.delta is None:  # the plain P2P path: no delta protocol, no base copy
                out.append((None, s.executor.delta_base_bytes))
                continue
            out.append((st.delta.wire_bytes, st.delta.dense_bytes, dict(st.delta.encodings)))
        return out
    local = {n: torch.zeros_like(t) for n, t in _weights(dst, world.dst_rank, 0).items()}
    r = Receiver(src, dst, world.rank, local, procs=procs, config=config)
    exact = []
    for v in range(1, (3 if mode == "corrupt" else VERSIONS) + 1):
        if v == 4 and mode in ("heal", "lie") and world.dst_rank == 1:
            for t in local.values():
                t.zero_()  # this replica lost its weights (e.g. reloaded): it no longer holds version 3
            r.invalidate()
        try:
            r.pull(v)
        except (DeltaError, RefitAborted) as e:
            if mode != "corrupt":
                raise
            exact.append(("refused", str(e), *_left_by_refusal(src, dst, world.dst_rank, local, 2, 3)))
            break
        exact.append(_matches_reference(src, dst, world.dst_rank, local, v, burst))
    return exact


def _corrupt_an_index_at_version_3(at: list[int]) -> None:
    """An attacker on a sender's side: at version ``at[0] == 3`` the first piece it packs as words by address
    claims a word index past its piece (its own base update leaves that piece out: it would write past it)."""
    import refit.delta.payload as td

    real = td._pack_spans

    def pack(found, spans, buf, ops):
        rows = real(found, spans, buf, ops)
        if at[0] != 3 or not len(rows[0]):
            return rows
        first = int(rows[1][0]) - buf.data_ptr()
        buf[first : first + 4].view(torch.int32)[0] = int(rows[4][0]) + 7
        at[0] = 0  # once
        return tuple(r[1:] for r in rows)

    td._pack_spans = pack


def _base_is_sent(sender, local) -> bool:
    """The sender's delta base (its copies of every tensor it sends over P2P) equals its weights bit for bit."""
    base = sender.executor.delta.base
    return all(
        torch.equal(copy.view(torch.int16), local[name].view(torch.int16))
        for name, parts in base.local.src.items()
        for _, copy in parts
    )


def _matches_reference(src, dst, dst_rank, local, version, burst=()):
    """The engine's bytes equal the trainer's full tensors of ``version``, sliced to this rank's boxes."""
    want = _reference(src, dst, dst_rank, version, burst)
    return all(torch.equal(local[n].view(torch.int16), w.view(torch.int16)) for n, w in want.items())


def _reference(src, dst, dst_rank, version, burst=()):
    """This rank's boxes of the trainer's full tensors of ``version``, by name."""
    full = {}
    for r in range(src.world_size):
        w = _weights(src, r, 0)
        for v in range(2, version + 1):
            _optimizer_step(w, v, burst)
        for t, b in src.local_tensors(r):
            full.setdefault(t.name, torch.empty(t.shape, dtype=t.dtype))[box_slices(b)] = w[t.name]
    return {t.name: full[t.name][box_slices(b)] for t, b in dst.local_tensors(dst_rank)}


def _left_by_refusal(src, dst, dst_rank, local, old, new):
    """After a refused version ``new``: the elements (16-bit) still at version ``old`` where it differs, and
    those at neither version."""
    a, b = (_reference(src, dst, dst_rank, v) for v in (old, new))
    kept = neither = 0
    for name, t in local.items():
        x, o, n = (v.view(torch.int16) for v in (t, a[name], b[name]))
        kept += int(((x == o) & (o != n)).sum())
        neither += int(((x != o) & (x != n)).sum())
    return kept, neither


def _run(mode, commit="in_place", timeout=150, dst_spec="tp=2", link_gbps=None, delta="auto"):
    src = layout_from_spec(SHAPES, parse_spec("fsdp=2", "src"))
    dst = layout_from_spec(SHAPES, parse_spec(dst_spec, "dst"))
    cfg = TransferConfig(
        num_buffers=2, buffer_bytes=16 << 10, delta=delta, commit=commit, deadline_s=60, delta_link_gbps=link_gbps
    )
    return run_local(_delta_worker, 2, 2, src, dst, cfg, mode, backend="gloo", timeout_s=timeout)


def test_each_step_is_cut_into_chunks_of_the_staging_budget_per_sender_the_same_on_every_process():
    from refit.delta.chunks import step_chunks

    src = layout_from_spec(SHAPES, parse_spec("fsdp=2", "src"))
    for dst_spec in ("tp=2", "tp=1,dp=2"):
        dst = layout_from_spec(SHAPES, parse_spec(dst_spec, "dst"))
        cfg = TransferConfig(num_buffers=2, buffer_bytes=16 << 10, delta="auto")  # the multi-process tests' budget
        plan = build_plan(src, dst, ProcessMap.disjoint(2, 2), cfg)
        chunk = step_chunks(plan, cfg)
        p2p = [i for i, m in enumerate(plan.messages) if m.transport == "p2p"]
        assert sorted(chunk) == p2p and chunk == step_chunks(plan, replace(cfg))  # every message, deterministic
        for step in {plan.messages[i].step for i in p2p}:
            ids = [i for i in p2p if plan.messages[i].step == step]
            cuts = [chunk[i] for i in ids]
            assert cuts == sorted(cuts) and cuts[0] == 0  # in plan order, from 0, no gaps
            assert set(cuts) == set(range(cuts[-1] + 1))
            senders = len({plan.procs.src[plan.messages[i].src] for i in ids})
            for c in set(cuts):
                part = [plan.messages[i].nbytes for i in ids if chunk[i] == c]
                assert len(part) == 1 or sum(part) <= 2 * (16 << 10) * senders  # within the budget, or one message
        assert max(chunk.values()) > 0, dst_spec  # the tests below run several chunks per step


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_auto_on_a_link_where_no_delta_can_pay_runs_the_plain_path_exactly():
    # a 1000 GB/s link against the CPU's 10 GB/s find: even an unchanged tensor is cheaper sent whole
    out = _run("heal", link_gbps=1000.0)
    senders, receivers = out[:2], out[2:]
    assert receivers == [[True] * VERSIONS] * 2  # exact after every version (and the replica that lost v3 healed)
    assert senders == [[(None, 0)] * VERSIONS] * 2  # no delta protocol, no base copy kept


@pytest.mark.multiproc
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "commit,dst_spec,delta",
    [
        ("in_place", "tp=2", "auto"),
        ("staged", "tp=2", "auto"),
        ("in_place", "tp=1,dp=2", "auto"),  # each source box goes to both replicas: its base is updated at commit
        ("in_place", "tp=1,dp=2", "words"),  # changed 64-bit words, every message
    ],
)
def test_deltas_are_exact_send_fewer_bytes_and_heal_a_replica_that_lost_its_version(commit, dst_spec, delta):
    out = _run("heal", commit, dst_spec=dst_spec, delta=delta)
    senders, receivers = out[:2], out[2:]
    assert receivers == [[True] * VERSIONS] * 2  # exact after every version, on both replicas

    def deltas(enc):
        return enc["words"] if delta == "words" else enc["sparse"] + enc["bitmask"] + enc["words"]

    for per_version in senders:
        wire, dense, enc = per_version[0]
        assert enc["dense"] > 0 and deltas(enc) == 0  # version 1: nothing to diff against
        for v in (1, 4, 5):  # versions 2, 3 (and 5, 6): deltas to both replicas
            wire, dense, enc = per_version[v]
            assert deltas(enc) > 0 and wire < 0.5 * dense, (v + 1, per_version[v])
            if delta == "words":
                assert enc["dense"] == 0 and enc["words"] == sum(enc.values()), per_version[v]
    # version 4: the replica that lost version 3 got dense messages (healed); the other deltas
    assert sum(p[3][2]["dense"] for p in senders) > 0
    assert all(deltas(p[3][2]) > 0 for p in senders)


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_forced_words_send_pieces_without_whole_words_per_element_exactly():
    """``delta="words"`` on a plan with pieces that have no whole 64-bit words (3 and 35 bf16 elements): those
    messages go per element (sparse), the others as words; exact after every version."""
    shapes = [
        ("a.weight", (16, 8), torch.bfloat16),
        ("b.bias", (3,), torch.bfloat16),
        ("c.weight", (5, 7), torch.bfloat16),
    ]
    lay = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    cfg = TransferConfig(num_buffers=2, buffer_bytes=16 << 10, delta="words", deadline_s=60)
    sent, got = run_local(_delta_worker, 1, 1, lay, lay, cfg, "plain", backend="gloo", timeout_s=150)
    assert got == [True] * VERSIONS
    for _, _, enc in sent[1:]:
        assert enc == {"dense": 0, "sparse": 2, "bitmask": 0, "words": 1}, enc


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_delta_onto_the_wrong_base_version_is_refused_on_every_process():
    with pytest.raises(WorkerError) as e:
        _run("lie")
    msg = str(e.value)
    assert "computed on base version 3" in msg and "(destination rank 1) holds no version" in msg, msg
    assert RefitAborted.__name__ in msg


INTERPRET_SCRIPT = Path(__file__).with_name("delta_interpret.py")


@pytest.mark.timeout(300)
@needs_triton
def test_one_pass_kernel_in_interpreter_equals_the_torch_path():
    assert_all_ok_in_interpreter(INTERPRET_SCRIPT, 280)


@pytest.mark.multiproc
@pytest.mark.timeout(500)
@needs_triton
def test_word_deltas_by_address_are_exact_end_to_end_in_interpreter():
    """Forced words over CPU gloo with the word kernels in Triton's interpreter: every message goes by
    address (one find, base update, pack, check and scatter launch per batch), exact after every version,
    the sender's base equal to its weights, healed, fan-out, a version over the find's slots."""
    assert_all_ok_in_interpreter(Path(__file__).with_name("delta_words_e2e_interpret.py"), 480)


@pytest.mark.timeout(300)
@needs_triton
def test_word_kernels_in_interpreter_equal_the_torch_path():
    """One launch over many pieces: find (with a piece over its slots), check (in range, out of range) and
    scatter, against ``refit.delta.words``' torch reference."""
    assert_all_ok_in_interpreter(Path(__file__).with_name("delta_words_interpret.py"), 280)


def _fp8_worker(world):
    from refit.quant import Fp8Quantizer, fp8_layout
    from refit.tools.verify import reference_shards

    plain = layout_from_spec(param_shapes("tiny-qwen3"), parse_spec("tp=1", "src"))
    src = fp8_layout(plain, block=(32, 32))
    dst = fp8_layout(layout_from_spec(param_shapes("tiny-qwen3"), parse_spec("tp=1", "dst")), block=(32, 32))
    procs = ProcessMap.disjoint(1, 1)
    cfg = TransferConfig(num_buffers=2, buffer_bytes=16 << 10, delta="auto", deadline_s=60)
    out = []
    if world.src_rank is not None:
        live = reference_shards(plain, 0)
        quantizer = Fp8Quantizer(src, 0, live, (32, 32))
        sender = Sender(src, dst, world.rank, quantizer.tensors, procs=procs, prepare=quantizer, config=cfg)
        for v in range(1, 5):
            if v > 1:
                _optimizer_step(live, v)  # float32 master weights: a few FP8 values (and scales) change
            st = sender.push(v)
            out.append((_raw(quantizer.tensors), st.delta.wire_bytes, st.delta.dense_bytes))
        return out
    local = {t.name: torch.zeros([b - a for a, b in box], dtype=t.dtype) for t, box in dst.local_tensors(0)}
    recv = Receiver(src, dst, world.rank, local, procs=procs, config=cfg)
    for v in range(1, 5):
        recv.pull(v)
        out.append(_raw(local))
    return out


def _raw(tensors):
    """Bytes of every tensor (FP8 tensors do not pickle back through the launcher)."""
    return {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_fp8_deltas_are_exact_and_send_only_changed_fp8_elements():
    sent, got = run_local(_fp8_worker, 1, 1, backend="gloo", timeout_s=120)
    for v, ((want, wire, dense), have) in enumerate(zip(sent, got), start=1):
        assert set(want) == set(have)
        assert all(want[n] == have[n] for n in want), v
        if v > 1:
            assert wire < 0.5 * dense, (v, wire, dense)
    assert any(sent[0][0][n] != sent[-1][0][n] for n in sent[0][0])  # the weights did change


def _fanout_worker(world):
    from refit.fanout import Fanout

    shapes = param_shapes("tiny-llama")
    trainer = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    replica = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    tensors = (
        _weights(trainer, 0, 0)
        if world.rank == 0
        else {n: torch.zeros_like(t) for n, t in _weights(replica, 0, 0).items()}
    )
    cfg = TransferConfig(name="fan", delta="auto", deadline_s=30.0, preflight_timeout_s=60.0)
    f = Fanout(trainer, replica, world.rank, [0], [[1], [2], [3]], tensors, config=cfg)
    out = []
    for v in range(1, 5):
        if world.rank == 0 and v > 1:
            _optimizer_step(tensors, v)
        f.run(v)
        sent = [
            p.last.delta.encodings
            for _, p in f.peers.values()
            if p.last is not None and p.last.delta and p.executor.delta.receivers
        ]
        out.append((_raw(tensors), sent))
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_fanout_replicas_get_deltas_from_the_trainer_and_from_each_other():
    out = run_local(_fanout_worker, 1, 3, backend="gloo", timeout_s=180)
    for v in range(4):
        assert all(o[v][0] == out[0][v][0] for o in out[1:]), v + 1  # every replica holds the trainer's bytes
    later = [enc for o in out for enc in o[3][1]]  # version 4: every sender (trainer, replica 0) sent deltas
    assert len(later) >= 2 and all(e["sparse"] + e["bitmask"] + e["words"] > 0 for e in later), later


def _tiny_pair():
    """tiny-llama at tp=1 on both sides, ``auto`` over a 2 x 16 KiB staging budget, one sender, one receiver."""
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes("tiny-llama")]
    lay = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    cfg = TransferConfig(num_buffers=2, buffer_bytes=16 << 10, delta="auto", deadline_s=60)
    return lay, cfg, ProcessMap.disjoint(1, 1)


def _receive_versions(world, lay, cfg, procs, versions: int, before=None) -> tuple[list, list]:
    """A receiver of ``_tiny_pair``: pulls versions 1 to ``versions``; its tensors' raw bytes after each, and what
    ``before(receiver)`` says before each pull (nothing without it)."""
    local = {n: torch.zeros_like(t) for n, t in _weights(lay, 0, 0).items()}
    r = Receiver(lay, lay, world.rank, local, procs=procs, config=cfg)
    got, seen = [], []
    for v in range(1, versions + 1):
        if before is not None:
            seen.append(before(r))
        r.pull(v)
        got.append(_raw(local))
    return got, seen


def _policy_worker(world):
    lay, cfg, procs = _tiny_pair()
    out = []
    if world.src_rank is not None:
        local = _weights(lay, 0, 0)
        s = Sender(lay, lay, world.rank, local, procs=procs, config=cfg)
        for v in range(1, 22):
            for t in local.values():  # versions 2-11: every element changes; then a few
                flip = torch.rand(t.shape) < (1.0 if v <= 11 else 0.01)
                t.view(torch.int16)[flip] ^= 1
            st = s.push(v)
            out.append((_raw(local), st.delta.diffed, dict(st.delta.encodings)))
        return out
    # before each pull: the senders whose refit about to run comes without headers
    return _receive_versions(world, lay, cfg, procs, 21, lambda r: r.executor.delta.quiet_senders())


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_steady_full_change_is_sent_dense_without_diffing_and_deltas_resume_when_it_drops():
    sent, (got, quiet) = run_local(_policy_worker, 1, 1, backend="gloo", timeout_s=120)
    assert [s[0] for s in sent] == got  # exact at every version
    # quiet refits: after version 2 measured 100%, versions 3-10 (7 skips and the refresh) go without headers,
    # announced by version 2's last header; version 11 diffs with headers again; the same after version 11
    assert [bool(q) for q in quiet] == [False] * 2 + [True] * 8 + [False] + [True] * 8 + [False] * 2, quiet
    diffed = [s[1] for s in sent]
    n = sum(sent[0][2].values())
    assert diffed[0] == 0 and diffed[1] == n  # version 1: nothing to diff against; 2: measured (100%)
    assert all(s[2]["dense"] == n for s in sent[:11])  # the rule: dense at 100%
    assert diffed[2:9] == [0] * 7  # versions 3-9: no diff (nor base copy) while the fraction says dense
    assert diffed[9] == 0 and diffed[10] == n  # version 10 refreshes the base, 11 measures again
    # versions 12-21 change 1%: the stale fraction keeps dense until the next probe (versions 19, 20),
    # then deltas again
    assert diffed[11:18] == [0] * 7 and diffed[19] == n, diffed
    assert sent[-1][2]["sparse"] + sent[-1][2]["bitmask"] + sent[-1][2]["words"] == n, sent[-1][1:]


def _joined_worker(world):
    """tiny-llama, one sender and one receiver under ``auto``: the norms change wholly every version (dense), the
    other tensors 1% (deltas). Every ``P2PSchedule.post`` is recorded: per side, each message's peer and whether
    it is a header."""
    from refit.delta.header import HEADER_TAG
    from refit.transport.p2p import P2PSchedule

    posted = []
    real = P2PSchedule.post

    def post(self, sends, recvs):  # per message: its peer, and whether it is a header
        posted.append([[(p, tag >= HEADER_TAG) for p, _, tag in side] for side in (sends, recvs)])
        return real(self, sends, recvs)

    P2PSchedule.post = post
    lay, cfg, procs = _tiny_pair()
    if world.src_rank is not None:
        local, out = _weights(lay, 0, 0), []
        s = Sender(lay, lay, world.rank, local, procs=procs, config=cfg)
        for v in range(1, 6):
            for name, t in local.items():
                t.view(torch.int16)[torch.rand(t.shape) < (1.0 if "norm" in name else 0.01)] ^= 1
            out.append((_raw(local), dict(s.push(v).delta.encodings)))
        return out, posted
    return _receive_versions(world, lay, cfg, procs, 5)[0], posted


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_small_dense_messages_travel_in_their_peers_joined_buffer_beside_the_deltas():
    (sent, sent_posts), (got, got_posts) = run_local(_joined_worker, 1, 1, backend="gloo", timeout_s=120)
    assert [s[0] for s in sent] == got  # exact at every version
    norms = sum("norm" in n for n, _, _ in param_shapes("tiny-llama"))
    for _, enc in sent[2:]:  # versions 3-5: the norms dense (the rule, then skipped), the rest as deltas
        assert enc["dense"] == norms and enc["sparse"] + enc["bitmask"] + enc["words"] > 0, enc
    # every post: per peer at most one header and one payload message, the small dense ones joined to the
    # deltas' buffer (a sender posts a chunk's headers and payloads at once, its receiver one after the other)
    for sends, recvs in sent_posts + got_posts:
        assert len(sends) == len(set(sends)) and len(recvs) == len(set(recvs)), (sends, recvs)
    payloads = [m for sends, _ in sent_posts for m in sends if not m[1]]
    assert len(payloads) == sum(not m[1] for _, recvs in got_posts for m in recvs) > 5  # several chunks a version


@pytest.mark.gpu
def test_one_pass_kernel_on_cuda_equals_the_torch_path_and_deltas_apply():
    from refit.delta.elements import find_changes_many

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype, n in ((torch.bfloat16, (1 << 22) + 5), (torch.float32, 1 << 20), (torch.float8_e4m3fn, 12345)):
        cur = torch.randn(n, device="cuda", generator=gen).to(dtype)
        base, engine = cur.clone(), cur.clone()
        for f in (0.001, 0.01, 0.3, 1.0):
            bits_of = cur.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[cur.element_size()])
            bits_of ^= (torch.rand(n, device="cuda", generator=gen) < f).to(bits_of.dtype)
            want_i, want_v = find_changes(base, cur, use_triton=False)
            (got_i, got_v), (many_i, _) = find_changes(base, cur, use_triton=True), find_changes_many([(base, cur)])[0]
            order = torch.argsort(got_i)
            assert torch.equal(got_i[order], want_i) and torch.equal(torch.sort(many_i).values, want_i)
            assert torch.equal(got_v[order].view(torch.uint8), want_v.view(torch.uint8))
            check_indices_many([(got_i, n)], "gpu")
            apply_changes(engine, got_i, got_v)
            apply_changes(base, want_i, want_v)
            assert torch.equal(engine.view(torch.uint8), cur.view(torch.uint8))


@pytest.mark.gpu
def test_word_kernels_on_cuda_equal_the_torch_path_in_one_launch_for_many_pieces():
    """``find_words_many`` (one launch over pieces of three dtypes, one overflowing its slots), the one-launch
    check and the scatter into an engine copy and the base: equal to the torch reference, bit for bit."""
    from refit.delta.words import find_words_many

    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = [(torch.bfloat16, (1 << 22) + 4), (torch.float32, 1 << 20), (torch.float8_e4m3fn, 12344 * 8)]
    curs = [torch.randn(n, device="cuda", generator=gen).to(d) for d, n in specs]
    bases, engines = [c.clone() for c in curs], [c.clone() for c in curs]
    for f in (0.001, 0.01, 0.3):
        for c in curs:
            b = c.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[c.element_size()])
            b ^= (torch.rand(c.numel(), device="cuda", generator=gen) < f).to(b.dtype)
        found = find_words_many(list(zip(bases, curs)))
        for b, c, (i, w, k) in zip(bases, curs, found):
            want_i, want_w = find_words(b, c)
            assert k == len(want_i)
            if i is None:  # over a quarter of the words changed: the caller sends dense
                assert f == 0.3 and k > words_in(c) // 4
                continue
            order = torch.argsort(i)
            assert torch.equal(i[order], want_i) and torch.equal(w[order], want_w)
        done = [(e, b, i, w) for e, b, (i, w, _) in zip(engines, bases, found) if i is not None]
        assert check_words_many([(i, words_in(e)) for e, _, i, _ in done])
        scatter_words_many([(e, i, w) for e, _, i, w in done] + [(b, i, w) for _, b, i, w in done])
        for e, b, c in zip(engines, bases, curs):
            if any(e is x for x, _, _, _ in done):
                assert torch.equal(e.view(torch.uint8), c.view(torch.uint8))
                assert torch.equal(b.view(torch.uint8), c.view(torch.uint8))
            else:
                e.copy_(c)
                b.copy_(c)
    bad = torch.tensor([0, 5, words_in(curs[1])], dtype=torch.int32, device="cuda")
    assert not check_words_many([(bad, words_in(curs[1]))])


def test_host_sparse_deltas_are_checked_before_any_is_written_and_scatter_as_apply_changes_does():
    """``host_sparse`` (a NIXL receiver's sparse deltas into host memory, through numpy): the same result as
    ``apply_changes`` for every element size; an index outside its piece, in any message, is refused naming that
    message before any message is written; other deltas are left for ``apply_received``."""
    from refit.delta.ops import DeltaOp
    from refit.delta.receive import host_sparse, scatter_host

    gen = torch.Generator().manual_seed(11)

    def received(dtype, k, bad=None):
        view = torch.randn(12, 10, generator=gen).to(dtype)
        idx = torch.randperm(view.numel(), generator=gen)[:k].sort().values
        values = torch.randn(k, generator=gen).to(dtype)
        payload = torch.empty(wire_bytes("sparse", view.numel(), k, view.element_size()), dtype=torch.uint8)
        encode("sparse", view.numel(), idx.to(torch.int32), values, payload)
        if bad is not None:
            payload[:4].view(torch.int32)[0] = bad
        op = _Op(peer=2, tag=0, tensor=view, pack=[], names=("w",), step=0)
        d = DeltaOp(op, [view], [], LINKS["cpu"], torch.empty(0), payload=payload, kind="sparse", changes=[k])
        want = view.clone()
        apply_changes(want, idx, values)
        return d, want

    dtypes = (torch.bfloat16, torch.float32, torch.uint8, torch.float64)
    ops = [received(dt, k) for dt in dtypes for k in (0, 1, 17)]
    words = DeltaOp(ops[0][0].op, [torch.zeros(8)], [], LINKS["cpu"], torch.empty(0), kind="words", changes=[1])
    items, rest = host_sparse([d for d, _ in ops] + [words])
    assert rest == [words] and len(items) == len(ops)
    scatter_host(items)
    for d, want in ops:
        assert torch.equal(bits(d.views[0]), bits(want))
    for bad in (-1, 120):
        ok, _ = received(torch.bfloat16, 5)
        before = ok.views[0].clone()
        wrong, _ = received(torch.bfloat16, 5, bad=bad)
        with pytest.raises(DeltaError, match=f"process 2 .*delta index {bad} is outside the piece's 120 elements"):
            host_sparse([ok, wrong])
        assert torch.equal(bits(ok.views[0]), bits(before))
