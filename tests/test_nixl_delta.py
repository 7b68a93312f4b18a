"""Delta refits over NIXL pulls on CPU (real NIXL: host memory, UCX on one host): bit exact after every refit for
three layout pairs over versions with 0%, 0.1%, 1%, 30% and 100% of the elements changed, the bytes read at 1% of
them changed (refit's own statistics), a receiver without the base version healed dense (it reads the messages its
source staged as deltas dense: nothing is refused over a pull), in fan-out waves a replica serving the deltas it
received with no base of its own and a late replica reading the previous version from its peers. One spawned job
for every layout pair and the fan-out. Skipped where nixl is not installed."""

import json
import zlib

import pytest
import torch

from refit.binding import bind_local
from refit.config import TransferConfig
from refit.errors import RefitAborted
from refit.fanout_join import JOIN
from refit.layout import box_slices
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.tools.launch import run_local
from refit.tools.verify import reference_tensor
from refit.transfer import Receiver, Sender
from refit.transport import nixl_agent
from refit.transport.nixl_delta import NixlDelta, delta_caps

needs_nixl = pytest.mark.skipif(
    not nixl_agent.available(), reason="nixl is not installed (pip install 'refit-rl[nixl]')"
)

FRACTIONS = (0.0, 0.001, 0.01, 0.3, 1.0)  # the changes of versions 2..6 (version 1: the first refit, dense)
ONE_PERCENT = 3  # the index of the version with 1% changed
BUDGET = dict(num_buffers=2, buffer_bytes=256 << 10)


def _shapes(model: str) -> list:
    """``model``'s parameters in bf16 (read from its config here, in the test process: a spawned rank that did it
    itself would spend seconds importing transformers)."""
    return [(n, s, torch.bfloat16) for n, s, _ in param_shapes(model)]


def _layouts(shapes: list, src: str, dst: str):
    return layout_from_spec(shapes, parse_spec(src, "src")), layout_from_spec(shapes, parse_spec(dst, "dst"))


class _Model:
    """The trainer's full tensors version by version, the same in every process: version 1 the reference values,
    each later one with ``fraction`` of every tensor's elements changed (the lowest bit flipped: each differs)."""

    def __init__(self, layout) -> None:
        self.full = {t.name: reference_tensor(t.name, t.shape, t.dtype) for t in layout}
        self.version = 1

    def step(self, fraction: float) -> None:
        self.version += 1
        for name, t in self.full.items():
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{self.version}".encode()))
            flat = t.view(-1).view(torch.int16)
            flat[torch.randperm(flat.numel(), generator=gen)[: round(fraction * flat.numel())]] ^= 1

    def shards(self, layout, rank: int) -> dict[str, torch.Tensor]:
        return {t.name: self.full[t.name][box_slices(b)] for t, b in layout.local_tensors(rank)}


FANOUT_CHANGES = (None, *FRACTIONS, 0.01)  # versions 1..7 (1: dense to every replica; 7: replica 2 joins late)
LATE = 7


def _fanout_worker(world, shapes: list, replicas: int):
    """Replica 0 receives from the trainer in wave 0, replicas 1 and 2 from the trainer and replica 0 in wave 1;
    before version ``LATE`` replica 2 (process 3) lost its weights. Per version: exact, the replicas that joined,
    per wave this process took part in (its Peer's last refit): ``(read, dense, delta stats)``."""
    from refit.fanout import Fanout

    trainer, replica = _layouts(shapes, "tp=1", "tp=1")
    m = _Model(trainer)
    tensors = {n: t.clone() for n, t in m.shards(trainer, 0).items()}
    if world.rank > 0:
        tensors = {n: torch.zeros_like(t) for n, t in tensors.items()}
    cfg = TransferConfig(name="fan", transport="nixl", delta="words", deadline_s=60.0, **BUDGET)
    f = Fanout(trainer, replica, world.rank, [0], [[1 + j] for j in range(replicas)], tensors, config=cfg)
    out = []
    for v, fraction in enumerate(FANOUT_CHANGES, 1):
        if fraction is not None:
            m.step(fraction)
            if world.rank == 0:
                for n, t in m.shards(trainer, 0).items():
                    tensors[n].copy_(t)
        if v == LATE and world.rank == 3:  # its engine reloaded its weights
            for t in tensors.values():
                t.zero_()
            f.invalidate()
        st = f.run(v)
        want = m.shards(replica, 0)
        exact = all(torch.equal(tensors[n].view(torch.int16), w.view(torch.int16)) for n, w in want.items())
        waves = {k: (p.last.bytes_received, p.executor.bytes_received, p.last.delta) for k, (_, p) in f.peers.items()}
        out.append((exact, st.joined, waves))
    f.close()
    return out


def _pair(world, shapes: list, src_spec: str, dst_spec: str, config: TransferConfig, faults: bool):
    """This process's part of one layout pair (sources: processes ``0..``, destinations after them; the others sit
    it out): versions 1..6 (``FRACTIONS``); with ``faults`` a 7th where destination rank 1 lost its weights (its
    sources stage deltas all the same: it must read them dense)."""
    src, dst = _layouts(shapes, src_spec, dst_spec)
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    src_rank = world.rank if world.rank < src.world_size else None
    dst_rank = world.rank - src.world_size if src.world_size <= world.rank < len(procs.src + procs.dst) else None
    if src_rank is None and dst_rank is None:
        return None
    m = _Model(src)
    changes = [None, *FRACTIONS] + ([0.01] if faults else [])
    if src_rank is not None:
        local = {n: t.clone() for n, t in m.shards(src, src_rank).items()}
        peer, out = Sender(src, dst, world.rank, local, procs=procs, config=config), []
    else:
        local = {n: torch.zeros_like(t) for n, t in m.shards(dst, dst_rank).items()}
        peer, out = Receiver(src, dst, world.rank, local, procs=procs, config=config), []
    for v, fraction in enumerate(changes, 1):
        if fraction is not None:
            m.step(fraction)
        if src_rank is not None:
            for n, t in m.shards(src, src_rank).items():
                local[n].copy_(t)
        elif v >= 7 and dst_rank == 1:  # this replica lost its weights (e.g. the engine reloaded them)
            for t in local.values():
                t.zero_()
            peer.invalidate()
        try:
            st = peer.run(v)
        except RefitAborted as e:
            out.append(("refused", str(e)))
            break
        if src_rank is not None:
            out.append((st.delta.wire_bytes, st.delta.dense_bytes, dict(st.delta.encodings)))
        else:
            want = m.shards(dst, dst_rank)
            exact = all(torch.equal(local[n].view(torch.int16), w.view(torch.int16)) for n, w in want.items())
            out.append((exact, st.bytes_received, peer.executor.bytes_received))
    peer.close()
    return ("src" if src_rank is not None else "dst", out)


AUTO = dict(transport="nixl", delta="auto", delta_link_gbps=0.05, deadline_s=60, **BUDGET)  # a 50 MB/s link
PAIRS = {  # one spawned job runs them one after another (``_all_worker``), then the fan-out
    "pp": ("tiny-llama", "tp=2,pp=2", "tp=1,dp=2", TransferConfig(name="pp", **AUTO), False),
    "moe": ("tiny-qwen3-moe", "ep=2,tp=2", "tp=2", TransferConfig(name="moe", **AUTO), False),
    "fsdp": (
        "tiny-llama", "fsdp=2", "tp=2",
        TransferConfig(name="fsdp", transport="nixl", delta="words", deadline_s=60, **BUDGET), True,
    ),
}  # fmt: skip


def _all_worker(world, shapes: dict) -> dict:
    out = {k: _pair(world, shapes[model], s, d, cfg, faults) for k, (model, s, d, cfg, faults) in PAIRS.items()}
    out["fanout"] = _fanout_worker(world, shapes["tiny-llama"], 3) if world.rank < 4 else None
    return out


@pytest.fixture(scope="module")
def job():
    """Every layout pair and the fan-out in one spawned job of 6 processes; per case, the sources' and the
    destinations' results in process order."""
    shapes = {m: _shapes(m) for m in ("tiny-llama", "tiny-qwen3-moe")}
    out = run_local(_all_worker, 4, 2, shapes, backend="gloo", timeout_s=280)
    return {
        k: tuple([r[k][1] for r in out if r[k] is not None and r[k][0] == side] for side in ("src", "dst"))
        for k in PAIRS
    } | {"fanout": [r["fanout"] for r in out[:4]]}


def _exact_and_sparse_at_one_percent(receivers, versions):
    for got in receivers:
        assert [g[0] for g in got[:versions]] == [True] * versions, got  # bit exact after every refit
        _, read, dense = got[ONE_PERCENT]
        assert read <= 0.065 * dense, (read, dense)  # at 1% changed, refit's bytes read against dense


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_words_over_nixl_are_exact_and_a_receiver_without_the_base_reads_dense(job):
    senders, receivers = job["fsdp"]
    assert len(senders) == 2 and len(receivers) == 2
    _exact_and_sparse_at_one_percent(receivers, 7)
    for got in senders:
        assert got[0][2]["words"] == 0 and got[0][2]["dense"] > 0  # version 1: nothing to diff against
        assert all(got[v][2]["dense"] == 0 for v in (1, 2, 3)), got  # 0%, 0.1%, 1%: every message as words
        assert got[5][2]["dense"] > 0  # 100%: more than fits the staging budget goes dense
        assert got[6][2]["dense"] == 0  # version 7: words staged for both (no source waits to hear what they hold)
    healed, kept = receivers[1][6], receivers[0][6]  # ... and rank 1, without the base, read it all dense
    assert healed[1] >= healed[2] and kept[1] <= 0.065 * kept[2], (healed, kept)
    assert all(len(got) == 7 and "refused" not in [g[0] for g in got] for got in [*senders, *receivers])


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["pp", "moe"])
def test_auto_over_nixl_follows_the_cost_rule_and_is_exact(job, case):
    senders, receivers = job[case]  # a slow link: the rule sends words at few changes and dense at many
    assert senders and receivers
    _exact_and_sparse_at_one_percent(receivers, 6)
    for got in senders:  # on a CPU link the rule picks sparse elements over words; norms (128 bytes) stay dense
        one = got[ONE_PERCENT][2]
        assert _deltas(one) > one["dense"] and one["words"] == 0, got[ONE_PERCENT]
        assert _deltas(got[5][2]) == 0, got[5]  # 100% changed: dense


def _deltas(encodings: dict) -> int:
    return encodings["sparse"] + encodings["bitmask"] + encodings["words"]


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fanout_waves_over_nixl_send_deltas_from_the_trainer_and_from_replicas(job):
    trainer, *replicas = job["fanout"]
    for got in replicas:  # each replica: exact after every version; at 1% it read a delta (its wave's Peer)
        assert [e for e, _, _ in got] == [True] * len(FANOUT_CHANGES), got
        wave = 0 if got is replicas[0] else 1
        read, dense, _ = got[ONE_PERCENT][2][wave]
        assert read <= 0.065 * dense, (read, dense)
    n = sum(trainer[0][2][0][2].encodings.values())  # messages per receiver
    model = trainer[0][2][0][2].dense_bytes  # the model's bytes (what one receiver reads dense)
    for v, (_, _, waves) in enumerate(trainer[1:], 2):  # the trainer finds against its bases (one per wave)
        assert {w[2].base_bytes for w in waves.values()} == {model}, v
    for v, (_, _, waves) in enumerate(replicas[0][1:], 2):  # replica 0 serves the deltas it received: no base
        served, sent = waves[1][2], trainer[v - 1][2][0][2]
        assert served.base_bytes == 0 and served.diffed == 0, v
        assert served.encodings == sent.encodings and served.wire_bytes == sent.wire_bytes, v
        assert served.served + served.dense_why.get("received dense", 0) == n, v  # what it cannot serve: dense, said
        assert served.dense_why.get("received dense", 0) == sent.dense_why.get("over the staging budget", 0), v
    assert replicas[0][ONE_PERCENT][2][1][2].served == n  # at 1%: every message served as received
    assert trainer[5][2][0][2].dense_why["over the staging budget"] > 0  # 100%: over the staging budget, said


def test_a_late_replica_reads_the_previous_version_from_its_peers_then_its_delta(job):
    trainer, *replicas = job["fanout"]
    late = LATE - 1
    assert [got[late][1] for got in job["fanout"]] == [[2]] * 4  # every process saw replica 2 join
    assert all(got[v][1] == [] for got in job["fanout"] for v in range(late))
    join_read, _, _ = replicas[2][late][2][JOIN]  # dense from replicas 0 and 1 (the trainer is no source of it)
    read, dense, _ = replicas[2][late][2][1]  # then the delta in its wave
    assert join_read == dense and read <= 0.065 * dense, (join_read, read, dense)
    assert JOIN not in trainer[late][2]  # the trainer carried nothing for it: in every wave it staged 1% deltas
    for _, _, sent in trainer[late][2].values():
        assert sent.encodings["dense"] == 0 and sent.wire_bytes <= 0.065 * sent.dense_bytes, sent


def test_the_rule_keeps_nixl_dense_on_fast_links_and_the_staging_within_the_budget():
    src, dst = _layouts(_shapes("tiny-llama"), "fsdp=2", "tp=2")
    for gbps, pays in ((1000.0, False), (0.05, True)):
        cfg = TransferConfig(transport="nixl", delta="auto", delta_link_gbps=gbps, **BUDGET)
        plan = build_plan(src, dst, ProcessMap.disjoint(2, 2), cfg)
        tensors = {n: t.clone() for n, t in _Model(src).shards(src, 0).items()}
        d = NixlDelta(plan, 0, bind_local(plan, 0, tensors, None), cfg, torch.device("cpu"))
        ops = [o for ops in d.sends.values() for o in ops]
        assert ops and {o.may_pay for o in ops if o.nbytes >= 16384} == {pays}, gbps  # (a piece costs ~110 us)
        budget = cfg.num_buffers * cfg.buffer_bytes
        assert 0 < d.staging.numel() <= budget and d.landing.numel() == 0
        sent = {p.tensor for o in ops for p in plan.messages[o.op.message].pieces}
        assert d.base is None and d.ensure_base().nbytes == sum(tensors[n].nbytes for n in sent)  # built when used
        caps = delta_caps(plan, cfg)
        for p in (0, 1, 2, 3):
            assert sum(c for (s, r), c in caps.items() if p in (s, r)) <= budget


def test_refit_plan_names_nixl_delta_the_path_with_nixl_and_a_changed_fraction(tmp_path, capsys):
    from refit.tools.cli import main

    topo = tmp_path / "topo.json"
    topo.write_text('{"nodes": 2, "gpus_per_node": 2}')  # the engine on the other node: over NICs
    argv = ["plan", "--model", "llama-3.1-8b", "--src", "tp=2", "--dst", "tp=2", "--cluster", str(topo), "--json"]
    runs = {}
    for extra in (["--nixl", "auto", "--changed-fraction", "0.01"], ["--changed-fraction", "0.01"], ["--nixl", "auto"]):
        assert main([*argv, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        runs[tuple(extra)] = (out["path"], {p["strategy"]: p for p in out["predictions"]})
    path, preds = runs[("--nixl", "auto", "--changed-fraction", "0.01")]
    assert path == "nixl-delta" and preds["nixl-delta"]["seconds"] < 0.2 * preds["nixl"]["seconds"]
    assert "pulled through NIXL as deltas" in preds["nixl-delta"]["note"]
    assert runs[("--changed-fraction", "0.01")][0] == "delta" and "nixl" not in runs[("--changed-fraction", "0.01")][1]
    path, preds = runs[("--nixl", "auto")]
    assert path == "nixl" and "nixl-delta" not in preds
    assert main(["plan", "--nixl", "auto"]) == 2 and "--nixl auto needs --cluster" in capsys.readouterr().err


def test_the_cpu_find_reads_words_and_leaves_elements_unread_where_the_rule_says_dense():
    from refit.delta.elements import bits, find_changes
    from refit.delta.send import choose, dense_words, find_batch

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.float64):
        base = torch.randn(24, 40, generator=gen).to(dtype)
        cur = base.clone()
        flat = bits(cur).view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[:37]] ^= 1
        want = (bits(base) != bits(cur)).view(-1).nonzero().squeeze(1)  # the element-wise reference
        for b, c in ((base, cur), (base[:, 1:], cur[:, 1:])):  # whole words (numpy), strided (torch)
            idx, vals = find_changes(b, c)
            ref = (bits(b) != bits(c)).reshape(-1).nonzero().squeeze(1)
            assert torch.equal(idx, ref) and torch.equal(bits(vals), bits(c).reshape(-1)[ref]), dtype
        assert len(want) == 37
        words = int((base.view(-1).view(torch.int64) != cur.view(-1).view(torch.int64)).sum())
        assert find_changes(base, cur, most=words - 1) == (None, None)
        assert torch.equal(find_changes(base, cur, most=words)[0], want)
    for dtype, n in ((torch.bfloat16, 116), (torch.float32, 58), (torch.uint8, 232), (torch.float64, 29)):
        base = torch.randn(n, generator=gen).to(dtype)  # 29 words: not a whole number of groups of eight
        cur = base.clone()
        bits(cur)[torch.randperm(n, generator=gen)[:9]] ^= 1
        ref = (bits(base) != bits(cur)).nonzero().squeeze(1)
        for chunk in (1 << 20, 64):  # one pass, and passes of 8 words
            idx, vals = find_changes(base, cur, chunk_bytes=chunk)
            assert len(ref) == 9 and torch.equal(idx, ref) and torch.equal(bits(vals), bits(cur)[ref]), (dtype, chunk)
    src, dst = _layouts(_shapes("tiny-llama"), "tp=1", "tp=1")
    cfg = TransferConfig(name="dw", **AUTO)
    plan = build_plan(src, dst, ProcessMap.disjoint(1, 1), cfg)
    tensors = {n: t.clone() for n, t in _Model(src).shards(src, 0).items()}
    d = NixlDelta(plan, 0, bind_local(plan, 0, tensors, None), cfg, torch.device("cpu"))
    d.ensure_base()
    op = max(d.sends[1], key=lambda o: o.nbytes)
    assert not op.words and 0 < dense_words(op) < op.nwords[0]  # elements on a slow CPU link; dense past a count
    for fraction, kind in ((0.01, "sparse"), (1.0, "dense")):
        flat = op.views[0].view(-1).view(torch.int16)
        flat[torch.randperm(flat.numel(), generator=gen)[: round(fraction * flat.numel())]] ^= 1
        find_batch([op], None, "auto")
        assert (op.changes[0][0] is None) == (kind == "dense") and choose(op, "auto") == kind, fraction
        op.bases[0].copy_(op.views[0])


def test_a_delta_record_whose_payload_spans_overlap_or_leave_it_is_refused_before_anything_is_read():
    from types import SimpleNamespace

    from refit.delta.wire import DeltaError
    from refit.transport.nixl_delta import _in_payload

    op = SimpleNamespace(op=SimpleNamespace(message=7))
    ok = [(16, 8, op), (0, 16, op), (24, 0, op), (0, 0, op)]  # any order; empty ones anywhere
    assert _in_payload(ok, 24, 1) == ok
    for bad in ([(0, 16, op), (8, 8, op)], [(4, 8, op)], [(16, 16, op)], [("0", 8, op)], [(-8, 8, op)]):
        with pytest.raises(DeltaError, match="NIXL delta record of process 1: message 7"):
            _in_payload(bad, 24, 1)


def test_a_join_needs_a_late_replica_a_previous_version_and_a_peer_that_holds_it():
    from refit.fanout_join import join_of

    procs = [[1], [2], [3]]  # replica j on process j + 1; the coordinator is process 0
    assert join_of({0: 6, 1: 6, 2: 6, 3: None}, 0, procs, frozenset()) == ([2], [0, 1], 6)
    assert join_of({0: 6, 1: 6, 2: 4, 3: None}, 0, procs, frozenset()) == ([1, 2], [0], 6)  # an old version: late
    assert join_of({0: 6, 1: 6, 2: 6, 3: 6}, 0, procs, frozenset()) == ([], [], None)  # nobody late
    assert join_of({0: None, 1: None, 2: None, 3: None}, 0, procs, frozenset()) == ([], [], None)  # first refit
    assert join_of({0: 6, 1: None, 2: None, 3: None}, 0, procs, frozenset()) == ([], [], None)  # no peer holds 6
    assert join_of({0: 6, 1: 6, 3: None}, 0, procs, frozenset()) == ([2], [0], 6)  # process 2 silent: neither
    assert join_of({0: 6, 1: 6, 2: 6, 3: None}, 0, procs, frozenset({2})) == ([2], [0], 6)  # nor a dead one


def test_a_replica_composes_the_deltas_it_received_in_parts_into_one_for_the_whole_box():
    from refit.delta.served import Got, Received, box_key
    from refit.delta.wire import decode, encode, index_bytes, wire_bytes

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(8, 12, generator=gen).to(torch.bfloat16)
    cur = base.clone()
    cur.view(-1).view(torch.int16)[torch.randperm(96, generator=gen)[:9]] ^= 1

    def sparse(part):  # the delta a source sends for box ``part``: its changed elements
        b, c = base[box_slices(part)], cur[box_slices(part)]
        idx = (b.view(torch.int16) != c.view(torch.int16)).reshape(-1).nonzero().squeeze(1)
        out = torch.empty(wire_bytes("sparse", b.numel(), idx.numel(), 2), dtype=torch.uint8)
        encode("sparse", b.numel(), idx.to(torch.int32), c.reshape(-1)[idx], out)
        return Got(5, 4, "sparse", (idx.numel(),), out)

    def words(part):  # ... its changed 64-bit words (a contiguous row block)
        b, c = (t[box_slices(part)].reshape(-1).view(torch.int64) for t in (base, cur))
        idx = (b != c).nonzero().squeeze(1)
        out = torch.zeros(index_bytes(idx.numel()) + 8 * idx.numel(), dtype=torch.uint8)
        out[: 4 * idx.numel()].view(torch.int32).copy_(idx)
        out[index_bytes(idx.numel()) :].view(torch.int64).copy_(c[idx])
        return Got(5, 4, "words", (idx.numel(),), out)

    whole = ((0, 8), (0, 12))
    for parts in (
        {((0, 4), (0, 12)): sparse, ((4, 8), (0, 12)): words},
        {((0, 8), (0, 5)): sparse, ((0, 8), (5, 12)): sparse},
    ):
        r = Received()
        for part, make in parts.items():
            r.note(box_key("w", part), make(part))
        got, why = r.compose(box_key("w", whole), 5, cur, 1 << 20)
        assert why == "" and got.kind == "sparse" and got.base == 4, why
        idx, vals = decode("sparse", 96, got.counts[0], got.payload, torch.bfloat16)
        out = base.clone()
        out.view(-1)[idx.long()] = vals
        assert torch.equal(out.view(torch.int16), cur.view(torch.int16)), parts  # the delta onto v-1 gives v
        assert r.compose(box_key("w", whole), 5, cur, got.payload.numel() - 1) == (None, "over the staging budget")
        assert r.compose(box_key("w", ((0, 8), (0, 4))), 5, cur[:, :4], 1 << 20)[1] == "not received as one message"
        assert r.compose(box_key("w", whole), 6, cur, 1 << 20)[1] == "not received in this version"
    r.note(box_key("w", ((0, 8), (0, 5))), Got(5, None, "dense", (), None))
    assert r.compose(box_key("w", whole), 5, cur, 1 << 20)[1] == "received dense"


def _host_source(name: str) -> tuple:
    """A NIXL delta source of tiny-llama tp=1 -> tp=1 on host memory, with its base: ``(NixlDelta, SourceBase)``."""
    src, dst = _layouts(_shapes("tiny-llama"), "tp=1", "tp=1")
    cfg = TransferConfig(name=name, **AUTO)
    plan = build_plan(src, dst, ProcessMap.disjoint(1, 1), cfg)
    tensors = {n: t.clone() for n, t in _Model(src).shards(src, 0).items()}
    d = NixlDelta(plan, 0, bind_local(plan, 0, tensors, None), cfg, torch.device("cpu"))
    return d, d.ensure_base()


def test_a_source_applies_its_held_base_updates_on_its_own_thread_and_a_failed_one_fails_the_next_refit():
    import threading

    from refit.delta.wire import DeltaError

    d, base = _host_source("bt")
    view = max(d.sends[1], key=lambda o: o.nbytes).bases[0]
    idx, vals = torch.tensor([0, 5, view.numel() - 1]), torch.full((3,), 7.0, dtype=view.dtype)

    def base_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("refit-nixl-base")}

    before = base_threads()
    for bad in (False, True):
        base.commit(1)
        base.hold()
        base.update(-1, [(view, idx + view.numel() if bad else idx, vals)])  # -1: no shared message
        d.settle()
        assert len(base_threads() - before) == 1 and base.later is None  # handed to the base thread
        if bad:  # an index past the piece: the thread's scatter raises, the next refit's begin names it
            with pytest.raises(DeltaError, match="base update after refit failed: IndexError"):
                d.begin(2, None)
            assert base.version is None  # dropped: the next refit sends dense
        else:
            d.begin(2, None)  # waits for the thread: the find reads the updated base
            assert torch.equal(view.reshape(-1)[idx], vals) and base.version == 1
    d.close()
    assert not base_threads() - before


def test_a_source_copies_a_dense_message_into_its_base_before_the_refit_returns():
    """A message sent dense updates the base from the live tensor: that copy is made at ``settle`` (inside the
    refit), not on the base thread, which may still run when the trainer changes its tensors for the next step
    (the base would then hold the next version's values and the next delta miss them)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    d, base = _host_source("bt2")
    views = sorted(d.sends[1], key=lambda o: o.nbytes)[-2:]
    dense_view, word_view = views[0].bases[0], views[1].bases[0]
    live = torch.full_like(dense_view, 3.0)
    idx, vals = torch.tensor([0, 5]), torch.full((2,), 7.0, dtype=word_view.dtype)
    gate = threading.Event()  # the base thread held busy until the trainer has changed its tensors
    d._settler = ThreadPoolExecutor(1, thread_name_prefix="refit-nixl-base")
    d._settler.submit(gate.wait, 10)
    base.commit(1)
    base.hold()
    base.update(-1, [(dense_view, None, live)])  # a dense message: the live tensor
    base.update(-1, [(word_view, idx, vals)])  # changed elements: arrays of their own
    d.settle()
    live.fill_(9.0)  # the trainer's next optimizer step, right after the refit returned
    gate.set()
    d.begin(2, None)
    assert torch.equal(dense_view, torch.full_like(dense_view, 3.0))
    assert torch.equal(word_view.reshape(-1)[idx], vals)
    d.close()


def test_the_cpu_find_of_many_pieces_at_once_equals_each_piece_alone(monkeypatch):
    """``host_find.find_many`` (``find_changes_many``' CPU word path): the flags of many pieces side by side in one
    buffer, compacted together and cut by piece, give each piece's changes as the element-wise reference does,
    across pieces of 0 to 300 words (not multiples of eight), mixed dtypes, batches that fill up (a small
    ``BATCH_WORDS``), pieces larger than a batch, and ``most`` per piece."""
    from refit.delta import host_find
    from refit.delta.elements import bits, find_changes_many

    monkeypatch.setattr(host_find, "BATCH_WORDS", 256)
    gen = torch.Generator().manual_seed(11)
    pairs, refs = [], []
    for k, words in enumerate((0, 1, 7, 29, 64, 200, 255, 256, 300, 1000, 3, 130)):
        dtype = (torch.bfloat16, torch.float32, torch.uint8, torch.float64)[k % 4]
        n = words * 8 // dtype.itemsize
        base = torch.randn(n, generator=gen).to(dtype)
        cur = base.clone()
        if n:
            bits(cur)[torch.randperm(n, generator=gen)[: max(1, n // (3 + k))]] ^= 1
        pairs.append((base, cur))
        refs.append((bits(base) != bits(cur)).nonzero().squeeze(1))
    for got, (_, cur), ref in zip(find_changes_many(pairs), pairs, refs):
        assert torch.equal(got[0], ref) and torch.equal(bits(got[1]), bits(cur)[ref])
    changed = [int((b.view(torch.int64) != c.view(torch.int64)).sum()) for b, c in pairs]
    most = [m - 1 if k % 2 else m for k, m in enumerate(changed)]  # odd pieces one word over their most
    for k, (got, ref) in enumerate(zip(host_find.find_many(pairs, most), refs)):
        if k % 2 and changed[k]:
            assert got == (None, None), k
        else:
            assert torch.equal(got[0], ref), k


@pytest.mark.parametrize("mode", ["auto", "sparse", "bitmask"])
def test_the_host_stage_stages_what_the_message_by_message_path_stages(mode):
    """``refit.delta.host_stage`` (a host source's element deltas found, chosen and packed many at once) against
    the message-by-message path (``find_batch``, ``encode_op``, ``_encode``) on the same versions: the same
    records (headers, offsets, bytes), the same decoded payloads, statistics, per-message rule state and, after the
    base updates, the same bases, equal to the version sent. Versions of 0.1% to 100% changed and a staging too
    small for some deltas (they go dense, their bases brought up to date all the same)."""
    from refit.delta.wire import ENCODINGS, decode

    src, dst = _layouts(_shapes("tiny-llama"), "fsdp=2", "tp=1")
    cfg = TransferConfig(name=f"hs-{mode}", **{**AUTO, "delta": mode, "buffer_bytes": 8 << 10})
    plan = build_plan(src, dst, ProcessMap.disjoint(2, 1), cfg)
    m = _Model(src)
    tensors = [{n: t.clone() for n, t in m.shards(src, 0).items()} for _ in range(2)]
    fast, slow = (NixlDelta(plan, 0, bind_local(plan, 0, t, None), cfg, torch.device("cpu")) for t in tensors)
    slow.host_staging = None  # every message one by one
    over = 0
    for v, f in enumerate((None, 0.001, 0.0, 0.01, 0.05, "block", 0.3, 1.0), 1):
        if f == "block":  # 40% changed in one run: few words by the find's estimate, many elements for the rule
            for t in tensors:
                for x in t.values():
                    x.view(-1)[: x.numel() * 2 // 5].view(torch.int16).bitwise_xor_(1)
        elif f is not None:
            m.step(f)
            for t in tensors:
                for n, x in m.shards(src, 0).items():
                    t[n].copy_(x)
        recs = []
        for d in (fast, slow):
            d.begin(v, None)
            recs.append(json.loads(d.stage(v)[2]))
            d.settle()
            d.settled()
            d.commit(v)
        (a, b), ops = recs, [d for d in fast.sends[2]]
        assert {k: a[k] for k in a if k != "addr"} == {k: b[k] for k in b if k != "addr"}, v
        for key, off in a["offsets"].items():
            head, d = a["heads"][key], ops[[str(o.op.message) for o in ops].index(key)]
            kind, view = ENCODINGS[head[0]], d.views[0]
            if kind == "dense":
                continue
            size = (head[3] * 4 + 7) // 8 * 8 + view.numel()
            got = [decode(kind, view.numel(), head[3], x.staging[off : off + size], view.dtype) for x in (fast, slow)]
            assert all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(*got)), (v, key)
        assert fast.stats == slow.stats, v
        state = [[(o.kind, o.fraction, o.dense_next, o.dense_runs, o.stale) for o in x.sends[2]] for x in (fast, slow)]
        assert state[0] == state[1], v
        for x in (fast, slow):
            for o in (o for o in x.sends[2] if not o.stale):  # (a stale one's base waits for its probe)
                assert torch.equal(o.bases[0].view(torch.uint8), o.views[0].view(torch.uint8)), (v, o.op.message)
        over += fast.stats.dense_why.get("over the staging budget", 0)
        if f in (0.001, 0.0):
            want = 30 if mode == "auto" else 39  # each but the 9 norms (``auto``: they cannot pay), or all
            staged = fast.stats.encodings["sparse" if mode == "auto" else mode]
            assert staged + fast.stats.dense_why.get("over the staging budget", 0) == want, v
    assert over, "no delta went over the staging"
    for d in (fast, slow):
        d.close()
