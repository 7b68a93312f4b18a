"""The NIXL transport: pure pieces (runs, records, planning, UCX settings) and multi-process refits on CPU
through real NIXL (UCX over shared memory / CMA on one host). Skipped where nixl is not installed."""

import os
import time

import pytest
import torch

from refit.config import PIECE_ALIGN, TransferConfig
from refit.errors import ChecksumError, PlanError, RefitAborted
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.tools.launch import run_local
from refit.tools.verify import holds, reference_shards, verify
from refit.transfer import Peer, Receiver, Sender
from refit.transport import nixl, nixl_agent, nixl_memory, nixl_record, nixl_requests
from refit.transport.clock import RunClock

needs_nixl = pytest.mark.skipif(
    not nixl_agent.available(), reason="nixl is not installed (pip install 'refit-rl[nixl]')"
)


def _layouts(model: str, src: str, dst: str):
    shapes = param_shapes(model)
    return layout_from_spec(shapes, parse_spec(src, "src")), layout_from_spec(shapes, parse_spec(dst, "dst"))


def _zeros(layout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s local tensors of ``layout``, zero."""
    return {t.name: torch.zeros(tuple(b - a for a, b in box), dtype=t.dtype) for t, box in layout.local_tensors(rank)}


# ---------------------------------------------------------------------------- pure pieces
def test_runs_merge_the_trailing_dims_dense_on_both_sides():
    # a [4, 6] box of a [4, 8] source row-major tensor into a dense [4, 6] destination: one run per row
    s, d, n = nixl_memory.runs((4, 6), 1000, (8, 1), 5000, (6, 1), 4)
    assert (
        n == 24 and s.tolist() == [1000 + 32 * i for i in range(4)] and d.tolist() == [5000 + 24 * i for i in range(4)]
    )
    # dense on both sides: one run
    s, d, n = nixl_memory.runs((4, 6), 0, (6, 1), 64, (6, 1), 2)
    assert (s.tolist(), d.tolist(), n) == ([0], [64], 48)
    # size-1 dims do not cut runs; an empty box has none
    assert nixl_memory.runs((1, 3, 1), 0, (99, 1, 7), 0, (3, 1, 1), 4)[2] == 12
    assert len(nixl_memory.runs((0, 3), 0, (3, 1), 0, (3, 1), 4)[0]) == 0


def test_storage_regions_merge_views_of_one_storage():
    base = torch.zeros(100)
    regions = nixl_memory.storage_regions([base[:10], base[50:], torch.zeros(3)])
    assert len(regions) == 2
    assert [base.data_ptr(), 400, 0, "DRAM"] in regions


def test_touching_storages_merge_only_inside_one_allocation():
    # two GPU allocations can lie back to back: a region across both breaks UCX's cuda_ipc (it maps one)
    ranges = [(64, 96), (0, 32), (32, 64), (100, 110), (104, 108)]
    gpu = nixl_memory._allocation_of("VRAM", 0, {0: [(0, 64), (64, 200)]})
    assert nixl_memory.merge_ranges(ranges, gpu) == [[0, 64], [64, 96], [100, 110]]
    unknown, host = nixl_memory._allocation_of("VRAM", 0, {}), nixl_memory._allocation_of("DRAM", 0, {})
    assert nixl_memory.merge_ranges(ranges, unknown) == [[0, 32], [32, 64], [64, 96], [100, 110]]
    assert nixl_memory.merge_ranges(ranges, host) == [[0, 96], [100, 110]]  # host memory
    # host tensors: storages that touch become one region
    buf = bytearray(64)
    a = torch.frombuffer(memoryview(buf)[:32], dtype=torch.uint8)
    b = torch.frombuffer(memoryview(buf)[32:], dtype=torch.uint8)
    assert b.data_ptr() == a.data_ptr() + 32 and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert nixl_memory.storage_regions([b, a, a[4:8]]) == [[a.data_ptr(), 64, 0, "DRAM"]]


def _record(**change):
    rec = {
        "agent": "refit-1-abc",
        "metadata": "AAAA",
        "regions": [[4096, 4096, 0, "DRAM"]],
        "parts": {"w": [4096, [4, 1], 0, "DRAM"]},
        "staged": {"3": 4096},
        "rounds": {"count": 3, "slots": 2, "of": {"3": 2}},
    }
    return {**rec, **change}


@pytest.mark.parametrize(
    "change,match",
    [
        ({"extra": 1}, "has keys"),
        ({"agent": 7}, "agent name"),
        ({"metadata": "not base64!"}, "metadata"),
        ({"regions": [[4096, -1, 0, "DRAM"]]}, "region"),
        ({"regions": [[2**63 - 10, 4096, 0, "DRAM"]]}, "region"),
        ({"regions": [[4096, 4096, 0, "HBM"]]}, "region"),
        ({"parts": {"w": [4096, [4], 0, "DRAM"]}}, "part 'w'"),
        ({"parts": {"w": [4096, [4, -1], 0, "DRAM"]}}, "part 'w'"),
        ({"parts": {"v": [4096, [4, 1], 0, "DRAM"]}}, "parts"),
        ({"staged": {"4": 4096}}, "staged names messages \\[4\\]"),
        ({"staged": {"3": -1}}, "staged"),
        ({"staged": [3]}, "staged"),
        ({"staged": {"\u00b3": 4096}}, "staged must map"),  # a digit, but not an ASCII one
        ({"rounds": {"count": 3, "slots": 2, "of": {}}}, "a round per staged message"),
        ({"rounds": {"count": 3, "slots": 0, "of": {"3": 0}}}, "rounds must be"),
        ({"rounds": {"count": 3, "slots": 2, "of": {"3": 3}}}, "outside 0..2"),
        ({"rounds": {"count": 3, "slots": 2, "of": {"3": 1, "x": 1}}}, "a round per staged message"),
        ({"rounds": [3, 2, {"3": 1}]}, "rounds must be"),
    ],
)
def test_records_are_checked_field_by_field(change, match):
    with pytest.raises(PlanError, match=match):
        nixl_record.check_record(_record(**change), "process 1", {"w": 2}, {3})
    rec = nixl_record.check_record(_record(), "process 1", {"w": 2}, {3})
    assert rec["metadata"] == b"\0\0\0" and rec["staged"] == {3: 4096}
    assert rec["rounds"] == {"count": 3, "slots": 2, "of": {3: 2}}


def test_a_piece_outside_the_registered_regions_is_refused():
    from refit.binding import bind_local

    src, dst = _layouts("tiny-llama", "tp=1", "tp=1")
    plan = build_plan(src, dst, config=TransferConfig(transport="nixl"))
    local = bind_local(plan, 1, None, {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in dst})
    k = next(k for k, m in enumerate(plan.messages) if m.pieces[0].tensor == "lm_head.weight")
    rows, cols = src["lm_head.weight"].shape
    rec = {"parts": {"lm_head.weight": [1 << 20, [cols, 1], 0, "DRAM"]}, "regions": [[1 << 20, 1024, 0, "DRAM"]]}
    with pytest.raises(PlanError, match="outside every region it registered"):
        nixl_requests.piece_runs(plan, k, local, rec, "process 0")
    rec["regions"] = [[1 << 20, rows * cols * 4, 0, "DRAM"]]
    kind, s, d, n = nixl_requests.piece_runs(plan, k, local, rec, "process 0")
    assert kind == ("DRAM", 0, "DRAM", 0) and s.tolist() == [1 << 20] and n == rows * cols * 4


def test_sources_stage_short_run_pieces_in_rounds_within_the_budget():
    from refit.binding import bind_local

    src, dst = _layouts("tiny-llama", "fsdp=2", "tp=2")  # row shards -> column slices of o_proj / down_proj
    for slot, slots in ((2 * (1 << 20), 1), (40 << 10, 2), ((40 << 10) + 8, 2), (64, 2)):
        cfg = TransferConfig(transport="nixl", num_buffers=slots, buffer_bytes=slot)
        plan = build_plan(src, dst, config=cfg)
        local = bind_local(plan, 0, reference_shards(src, 0), None)
        st = nixl_memory.SourceStaging(plan, 0, local, slot, slots, torch.device("cpu"))
        strided = []
        for k, m in enumerate(plan.messages):
            p = m.pieces[0]
            if plan.procs.src[m.src] == 0 and not local.src_view(p.tensor, p.box).is_contiguous():
                strided.append(k)
        # every strided piece that fits a slot is staged, however many rounds that takes; the buffer stays in budget
        fits = [k for k in strided if plan.messages[k].pieces[0].nbytes <= slot]
        assert sorted(st.offsets) == fits and (len(fits) > 0) is (slot > 64)
        assert st.buffer.numel() <= slots * slot and len(st.rounds) >= (len(fits) > 0)
        assert (len(st.rounds) > slots) is (40 << 10 <= slot < 1 << 20)  # small slots: more rounds than slots
        # the receivers (processes 2 and 3) take turns through the rounds: neither waits for the other's part
        order = [
            plan.procs.dst[plan.messages[k].dst] for k in sorted(fits, key=lambda k: (st.round_of[k], st.offsets[k]))
        ]
        assert order == [2, 3] * (len(order) // 2)
        stride = slot // PIECE_ALIGN * PIECE_ALIGN
        for r in range(len(st.rounds)):
            st.pack(r)
            for k in [k for k in fits if st.round_of[k] == r]:
                p = plan.messages[k].pieces[0]
                view = local.src_view(p.tensor, p.box)
                off = st.offsets[k]
                assert r % slots * stride <= off and off + p.nbytes <= (r % slots + 1) * stride  # inside slot r % slots
                got = st.buffer[off : off + p.nbytes].view(view.dtype).view(view.shape)
                assert torch.equal(got, view)


def test_only_a_signed_announcement_of_this_run_ends_a_wait():
    import threading
    import warnings

    import torch.distributed as dist

    from refit.errors import DeadlineExceeded
    from refit.transport.clock import RunClock
    from refit.transport.store import SignedStore

    store = SignedStore(dist.HashStore(), b"the-job-secret-0123456789")
    link = nixl.NixlLink(None, "refit-0-x", store, TransferConfig(name="t"), 1)
    link.shared = nixl.SharedAgent(("cpu", False), None, "refit-0-x", threaded=False)  # no worker to progress
    link.runs, link.sources = 2, {0: "refit-0-x"}
    key = "t/nixl/refit-0-x/ready/2"

    def waits(block: bool, noted: bool = False) -> bool:
        """Whether a wait for process 0's announcement (``block``: a receiver's, blocking on the store between
        reads; else polling ``key``) ran into its deadline."""
        link.receivers = [] if block else [3]  # a receiver that is no source blocks
        clock = RunClock(time.monotonic() + 0.2)
        try:
            if block:
                link._wait_announced(clock)
            else:
                link._wait_for(key, clock, lambda: "process 0 announcing its tensors", noted=noted)
        except DeadlineExceeded as e:
            assert "process 0 announcing its tensors" in str(e) and key in str(e)
            return True
        return False

    for block in (False, True):  # polling, and blocking on the store between reads (a receiver's wait)
        store.raw.delete_key(key)
        assert waits(block)  # nothing there
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store.raw.set(key, b"refit1." + b"ab" * 32 + b".2")  # a stranger's forgery
            assert waits(block) and store.rejected[key] == 1
        store.put(key, 1)  # a real announcement, of the run before (a replay)
        assert waits(block)
        store.put(key, 2)
        assert not waits(block)
        store.raw.delete_key(key)
        later = threading.Timer(0.05, store.put, (key, 2))  # written while the wait is on: it ends it
        later.start()
        assert not waits(block)
        later.join()
    store.raw.delete_key(key)  # a wait that also reads notifications (a source's for its receivers' done)
    for forged in (b"refit1." + b"ab" * 32 + b".2", store.sign(key, 1), store.sign("t/nixl/other", 2)):
        link.shared.notes[key] = forged  # a stranger's, a replay of the run before, another key's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert waits(False, noted=True)
    link.shared.notes[key] = store.sign(key, 2)
    assert not waits(False, noted=True) and not store.has(key)  # the notification alone ends it
    link.shared.notes.clear()
    store.put(key, 2)
    assert not waits(False, noted=True)  # the store still does


def test_a_receivers_done_write_goes_on_a_thread_and_a_failed_one_fails_the_next_refit():
    import torch.distributed as dist

    from refit.errors import TransferError
    from refit.transport.clock import RunClock
    from refit.transport.store import SignedStore

    class Refusing(dist.HashStore):
        def multi_set(self, keys, values):
            raise dist.DistStoreError("the store refused the write")

    for raw, fails in ((dist.HashStore(), False), (Refusing(), True)):
        store = SignedStore(raw, b"the-job-secret-0123456789")
        link = nixl.NixlLink(None, "refit-1-x", store, TransferConfig(name="t"), 1)
        link.runs, key = 3, "t/nixl/refit-0-x/done/1"
        link._write_done({key: store.sign(key, 3)})
        link._done.exception(timeout=10)  # the write, on the link's thread
        if fails:
            with pytest.raises(TransferError, match="writing the last refit's done values failed.*refused the write"):
                link.finish(RunClock(time.monotonic() + 5))
        else:
            assert store.peek(key) == 3
        link.close()


def test_plans_mark_nixl_links_and_auto_uses_them_only_between_hosts():
    src, dst = _layouts("tiny-llama", "tp=2", "tp=2")
    every = build_plan(src, dst, config=TransferConfig(transport="nixl"))
    assert {m.transport for m in every.messages} == {"nixl"} and every.ratio == 1.0
    p2p = build_plan(src, dst, config=TransferConfig(transport="p2p"))
    assert every.digest != p2p.digest  # the transport is part of what peers must agree on
    two_hosts = ProcessMap((0, 1), (2, 3), ("a/cpu", "a/cpu", "b/cpu", "b/cpu"))
    auto = build_plan(src, dst, two_hosts, TransferConfig(transport="auto"))
    assert {m.transport for m in auto.messages} == {"nixl" if nixl_agent.available() else "p2p"}
    one_host = ProcessMap((0, 1), (2, 3), ("cuda:0", "cuda:1", "cuda:2", "cuda:3"))
    assert {m.transport for m in build_plan(src, dst, one_host, TransferConfig(transport="auto")).messages} == {"ipc"}


def test_engine_jobs_take_the_transport_and_auto_learns_where_each_process_runs():
    import torch.distributed as dist

    from refit.engines.vllm.common import RefitInitInfo, location, process_map
    from refit.errors import ConfigError
    from refit.transport.store import SignedStore

    assert RefitInitInfo(transport="nixl").transfer_config().transport == "nixl"
    with pytest.raises(ConfigError, match="transport must be one of"):
        RefitInitInfo(transport="rdma")
    here = location("cpu")
    assert here.count("/") == 1 and here.endswith(f"/cpu:{os.getpid()}")
    src, dst = _layouts("tiny-llama", "tp=1", "tp=1")
    for transport, other, want in (
        ("auto", "elsewhere-0123abcd/cpu:7", "nixl" if nixl_agent.available() else "p2p"),  # another host
        ("auto", here.split("/")[0] + "/cpu:7", "p2p"),  # this host, CPU
        ("nixl", None, "nixl"),  # no locations needed
    ):
        store = SignedStore(dist.HashStore(), b"the-job-secret-0123456789")
        info = RefitInitInfo(n_trainer=1, n_workers=1, transport=transport, timeout_s=5)
        if other is not None:
            store.put("where/1", other)
        procs = process_map(info, store, 0, "cpu")
        assert procs.devices == ((here, other) if other else None)
        plan = build_plan(src, dst, procs, info.transfer_config())
        assert {m.transport for m in plan.messages} == {want}
    store.put("where/1", "no-slash")
    with pytest.raises(ConfigError, match="process 1 published location 'no-slash'"):
        process_map(RefitInitInfo(n_trainer=1, n_workers=1, transport="auto", timeout_s=5), store, 0, "cpu")


# ---------------------------------------------------------------------------- multi-process, real NIXL
PAIRS = [("fsdp=2", "tp=2"), ("tp=2,pp=2", "tp=1,dp=2"), ("tp=3", "tp=2")]


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("src,dst", PAIRS)
def test_reshard_over_nixl_is_bit_exact(src, dst):
    s, d = _layouts("tiny-qwen2", src, dst)
    # a small budget: each source's pieces are cut into many READ requests, two in flight
    res = verify(s, d, config=TransferConfig(transport="nixl", num_buffers=2, buffer_bytes=16 << 10), timeout_s=360)
    assert res.ok, res.mismatches[:5]
    assert {m.transport for m in res.plan.messages} == {"nixl"}
    assert res.plan.ratio == 1.0 and res.bytes_checked == res.plan.bytes_needed


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_moe_reshard_over_nixl_is_bit_exact():
    s, d = _layouts("tiny-qwen3-moe", "ep=2,tp=2", "tp=2")
    res = verify(s, d, config=TransferConfig(transport="nixl"), timeout_s=360)
    assert res.ok, res.mismatches[:5]
    assert res.plan.ratio == 1.0 and res.bytes_checked == res.plan.bytes_needed


ROUNDS_CFG = TransferConfig(transport="nixl", num_buffers=2, buffer_bytes=40 << 10, deadline_s=60.0)


def _rounds_worker(world, versions):
    src, dst = _layouts("tiny-llama", "fsdp=2", "tp=2")
    procs = ProcessMap.disjoint(2, 2)
    if world.src_rank is not None:
        tensors = reference_shards(src, world.src_rank)
        s = Sender(src, dst, world.rank, tensors, procs=procs, config=ROUNDS_CFG)
        for v in range(1, versions + 1):
            s.push(v)
            for t in tensors.values():
                t.mul_(2)  # exact: the next version is the reference times 2 ** (v - 1)
        s.close()
        return None
    want = reference_shards(dst, world.dst_rank)
    live = _zeros(dst, world.dst_rank)
    r = Receiver(src, dst, world.rank, live, procs=procs, config=ROUNDS_CFG)
    exact = []
    for v in range(1, versions + 1):
        r.pull(v)
        exact.append(all(torch.equal(live[n], want[n] * 2.0 ** (v - 1)) for n in live))
    r.close()
    return exact


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_staging_in_more_rounds_than_slots_is_exact_refit_after_refit():
    from refit.binding import bind_local

    src, dst = _layouts("tiny-llama", "fsdp=2", "tp=2")
    plan = build_plan(src, dst, config=ROUNDS_CFG)
    st = nixl_memory.SourceStaging(plan, 0, bind_local(plan, 0, reference_shards(src, 0), None), 40 << 10, 2, "cpu")
    assert len(st.rounds) > 3 * st.slots  # each refit packs most rounds while its receivers read the others
    out = run_local(_rounds_worker, 2, 2, 3, backend="gloo", timeout_s=240)
    assert out[2:] == [[True, True, True]] * 2  # three versions in a row, each bit for bit


# ---------------------------------------------------------------------------- checksums
@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_reshard_over_nixl_with_checksums_is_bit_exact():
    s, d = _layouts("tiny-llama", "fsdp=2", "tp=2")  # column slices are staged, the rest read in place
    cfg = TransferConfig(transport="nixl", checksums=True, num_buffers=2, buffer_bytes=64 << 10)
    res = verify(s, d, config=cfg, timeout_s=240)
    assert res.ok, res.mismatches[:5]
    assert res.plan.ratio == 1.0 and res.bytes_checked == res.plan.bytes_needed


def test_checksum_records_are_checked_field_by_field():
    from refit.binding import bind_local
    from refit.errors import TransferError

    src, dst = _layouts("tiny-llama", "tp=1", "tp=2")
    plan = build_plan(src, dst, ProcessMap.disjoint(1, 2), TransferConfig(transport="nixl"))
    local = bind_local(plan, 1, None, _zeros(dst, 0))
    sums = nixl.NixlSums(plan, 1, local, torch.device("cpu"))
    good = {str(k): 7 for k in sums.reads}
    assert sums.check_record({"run": 3, "sums": good}, 0, 3) == {k: 7 for k in sums.reads}
    assert sums.check_record({"run": 2, "sums": {}}, 0, 3) is None  # the run before: keep waiting
    k0 = next(iter(sums.reads))
    for bad in (
        {"run": 3},
        {"run": 3, "sums": {**good, "999999": 1}},
        {"run": 3, "sums": {**good, str(k0): 1 << 63}},
        {"run": 3, "sums": {**good, str(k0): "7"}},
        {"run": 4, "sums": good},
    ):
        with pytest.raises(TransferError, match="NIXL checksum record of process 0"):
            sums.check_record(bad, 0, 3)
    with pytest.raises(ChecksumError, match=f"checksum mismatch in tensor '{plan.messages[k0].pieces[0].tensor}'"):
        sums.check({**{k: 0 for k in sums.reads}}, RunClock())  # zeros sum to non-zero values


def _corrupt_worker(world, victim, dst_spec="tp=2", devices=None):
    src, dst = _layouts("tiny-llama", "tp=1", dst_spec)
    procs = ProcessMap.disjoint(1, dst.world_size)
    procs, dev = (procs, "cpu") if devices is None else (procs.with_devices(devices), world.device)
    cfg = TransferConfig(transport="nixl", checksums=True, commit="staged", deadline_s=60.0, preflight_timeout_s=120.0)
    if world.src_rank is not None:
        tensors = {n: t.to(dev) for n, t in reference_shards(src, 0).items()}
        s = Sender(src, dst, world.rank, tensors, procs=procs, config=cfg, device=dev)
        s.push(1)
        for t in tensors.values():
            t.mul_(2)
        seen = []

        def corrupt(where, info):  # the source's sums are taken: one element of the victim changes
            seen.append(where)
            if where == "nixl-announce":
                tensors[victim].view(-1)[0] += 1.0

        try:
            s.run(2, fault_hook=corrupt)
            return "completed", seen
        except RefitAborted as e:
            return str(e), seen
        finally:
            s.close()
    live = {n: t.to(dev) for n, t in _zeros(dst, world.dst_rank).items()}
    r = Receiver(src, dst, world.rank, live, procs=procs, config=cfg, device=dev)
    r.pull(1)
    try:
        r.pull(2)
        msg = "completed"
    except RefitAborted as e:
        msg = str(e)
    r.close()
    return msg, r.version, holds({n: t.cpu() for n, t in live.items()}, dst, world.dst_rank)


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "victim",
    [
        "model.layers.0.self_attn.o_proj.weight",  # a column slice: packed into the source's staging buffer
        "model.layers.0.self_attn.q_proj.weight",  # a row slice: read in place
    ],
)
def test_a_source_piece_changed_after_its_checksum_is_caught_and_nothing_commits(victim):
    out = run_local(_corrupt_worker, 1, 2, victim, backend="gloo", timeout_s=240)
    msg, seen = out[0]
    assert seen == ["nixl-announce"] and "aborted" in msg
    for m, version, same in out[1:]:
        # receiver 0 reads the changed element; everyone raises its error
        assert f"ChecksumError: checksum mismatch in tensor '{victim}'" in m and "from process 0" in m, m
        assert version == 1 and same  # staged: the live tensors are still version 1, bit for bit


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
def test_nixl_on_one_gpu_is_exact_and_checksums_catch_a_changed_source():
    # trainer and engine processes on one GPU: UCX reads over CUDA IPC (REFIT_NIXL_DEBUG=1 -s shows how)
    gpu = ["cuda:0", "cuda:0"]
    victim = "model.embed_tokens.weight"
    out = run_local(_corrupt_worker, 1, 1, victim, "tp=1", gpu, devices=gpu, timeout_s=240)
    assert out[0][1] == ["nixl-announce"] and "aborted" in out[0][0]
    msg, version, same = out[1]
    assert f"ChecksumError: checksum mismatch in tensor '{victim}'" in msg, msg
    assert version == 1 and same  # version 1 arrived bit for bit and stayed (staged): version 2 was refused


FROZEN_S = 20.0


def _frozen_worker(world):
    src, dst = _layouts("tiny-llama", "tp=1", "tp=2")
    procs = ProcessMap.disjoint(1, 2)
    cfg = TransferConfig(transport="nixl", commit="staged", deadline_s=8.0, preflight_timeout_s=120.0)
    if world.src_rank is not None:
        tensors = reference_shards(src, 0)
        frozen = {"on": False}

        def prepare(names):
            if frozen["on"]:
                time.sleep(FROZEN_S)  # alive, but never says its tensors are final in time

        s = Sender(src, dst, world.rank, tensors, procs=procs, config=cfg, prepare=prepare)
        s.push(1)
        for t in tensors.values():
            t.mul_(2)
        frozen["on"] = True
        try:
            s.push(2)
        except RefitAborted as e:
            return str(e)
        finally:
            s.close()
        return "completed"
    live = _zeros(dst, world.dst_rank)
    r = Receiver(src, dst, world.rank, live, procs=procs, config=cfg)
    r.pull(1)
    t0 = time.monotonic()
    try:
        r.pull(2)
        msg = "completed"
    except RefitAborted as e:
        msg = str(e)
    waited = time.monotonic() - t0
    r.close()
    return msg, r.version, holds(live, dst, world.dst_rank), waited


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_frozen_source_aborts_at_the_deadline_and_engines_keep_their_version():
    out = run_local(_frozen_worker, 1, 2, backend="gloo", timeout_s=240)
    assert "aborted" in out[0]
    for msg, version, same, waited in out[1:]:
        assert "DeadlineExceeded" in msg and "process 0 announcing its tensors" in msg, msg
        assert version == 1 and same  # staged: the live tensors are still version 1, bit for bit
        assert waited < FROZEN_S  # gave up at its own deadline, not when the source woke up


# ---------------------------------------------------------------------------- one agent per process
def _two_peers_worker(world):
    src, dst = _layouts("tiny-llama", "tp=1", "tp=1")
    is_src = world.src_rank is not None
    tensors = {k: reference_shards(src, 0, seed=k) if is_src else _zeros(dst, 0) for k in (1, 2)}
    peers = {}
    for k in (1, 2):  # two pairings of the same two processes, each its own Peer (and store namespace)
        cfg = TransferConfig(name=f"pair{k}", transport="nixl", preflight_timeout_s=120.0)
        peers[k] = Peer(src, dst, world.rank, src_tensors=tensors[k] if is_src else None,
                        dst_tensors=None if is_src else tensors[k], config=cfg)  # fmt: skip
    links = [peers[k].executor.nixl for k in (1, 2)]
    out = {"same": links[0].shared is links[1].shared, "users": links[0].shared.users}
    out["agents"] = nixl_agent.SharedAgent.count()
    for k in (1, 2):
        peers[k].run(1)
    peers[1].close()  # the other Peer goes on with the process's agent and its remote agent
    if is_src:
        tensors[2] = {n: t.mul_(2) for n, t in tensors[2].items()}
    peers[2].run(2)
    out["exact"] = is_src or (holds(tensors[1], dst, 0, seed=1) and holds(tensors[2], dst, 0, seed=2, scale=2.0))
    peers[2].close()
    out["after"] = nixl_agent.SharedAgent.count()
    return out


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_peers_of_a_process_share_one_nixl_agent():
    out = run_local(_two_peers_worker, 1, 1, backend="gloo", timeout_s=240)
    for r in out:
        assert r == {"same": True, "users": 2, "agents": 1, "exact": True, "after": 0}, r


# ---------------------------------------------------------------------------- fan-out and joining
REPLICAS = 3


def _fanout_worker(world, kill):
    from refit.fanout import Fanout

    trainer, replica = _layouts("tiny-llama", "tp=1", "tp=1")
    proc = world.rank
    if proc == 0:
        tensors = reference_shards(trainer, 0)
    else:
        tensors = {t.name: torch.full(t.shape, float("nan"), dtype=t.dtype) for t in replica}
    cfg = TransferConfig(name="fan", transport="nixl", deadline_s=15.0, preflight_timeout_s=120.0)
    f = Fanout(trainer, replica, proc, [0], [[1 + j] for j in range(REPLICAS)], tensors, config=cfg)
    if kill is not None and proc == kill[0]:
        f.hook = lambda wave, attempt: os._exit(3) if wave == kill[1] else None  # dies as its wave starts
    s = f.run(1)
    out = {"ok": proc == 0 or holds(tensors, replica, 0), "dead": s.dead, "seen": s.sources_seen}
    out["version"], out["attempts"] = f.version, s.attempts
    out["transports"] = sorted({m.transport for _, p in f.peers.values() for m in p.plan.messages})
    f.close()
    return out


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_fanout_waves_over_nixl_pull_from_replicas_that_hold_the_version():
    res = run_local(_fanout_worker, 1, REPLICAS, None, timeout_s=360)
    assert all(r["ok"] and r["version"] == 1 and r["transports"] == ["nixl"] for r in res), res
    # wave 1's receivers (replicas 1, 2) checked replica 0 (process 1), which holds the version, as a source
    assert {p for r in res[2:] for _, _, p, v in r["seen"] if v == 1} == {1}


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_source_replica_that_dies_is_planned_around_and_the_version_completes():
    # replica 0 (process 1) received in wave 0; it dies as wave 1 starts, where it is a source
    res = run_local(_fanout_worker, 1, REPLICAS, (1, 1), timeout_s=360, expect_dead={1})
    assert res[1] is None
    for r in (res[0], res[2], res[3]):
        assert r["ok"] and r["version"] == 1 and r["dead"] == [1], r
    assert res[0]["attempts"] == 3  # wave 0, then wave 1 twice: again without the dead source


def _joining_worker(world):
    src, rep = _layouts("tiny-llama", "tp=2", "tp=1")
    cfg = TransferConfig(name="first", transport="nixl", preflight_timeout_s=120.0)
    if world.rank < 2:  # the trainer: sends version 1 to replica A, then does nothing more
        s = Sender(src, rep, world.rank, reference_shards(src, world.rank), procs=ProcessMap((0, 1), (2,)), config=cfg)
        s.push(1)
        s.close()
        return None
    live = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in rep}
    if world.rank == 2:  # replica A: holds version 1, then serves it to the replica that joins
        r = Receiver(src, rep, 2, live, procs=ProcessMap((0, 1), (2,)), config=cfg)
        r.pull(1)
        r.close()
    # replica B joins now: its peer group is {A, B}; the trainer takes no part
    join = TransferConfig(name="join", transport="nixl", preflight_timeout_s=120.0)
    is_a = world.rank == 2
    p = Peer(rep, rep, world.rank, src_tensors=live if is_a else None, dst_tensors=None if is_a else live,
             procs=ProcessMap((2,), (3,)), config=join)  # fmt: skip
    p.run(1)
    p.close()
    return holds(live, rep, 0)


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_replica_joining_mid_run_pulls_the_current_version_from_a_peer():
    out = run_local(_joining_worker, 2, 2, backend="gloo", timeout_s=240)
    assert out[2:] == [True, True]


# ---------------------------------------------------------------------------- NIC settings, cost model
def test_ucx_settings_follow_the_nic_knobs_and_the_bind_address(tmp_path):
    from test_net import _node

    _node(tmp_path, 4)
    root = str(tmp_path)

    def settings(device, **env):
        env = {"REFIT_SYSFS_ROOT": root, **env}
        nixl_agent.apply_ucx_settings(torch.device(device), env)
        return {k: v for k, v in env.items() if k.startswith("UCX_")}

    get = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}  # on CUDA: READs over CUDA IPC even without NVLink
    assert settings("cuda:2") == {"UCX_NET_DEVICES": "mlx5_2:1,lo", "UCX_MAX_RMA_RAILS": "1", **get}  # auto: nearest
    stripe = settings("cuda:2", REFIT_NIC_MODE="stripe")
    assert stripe == {"UCX_NET_DEVICES": "mlx5_2:1,mlx5_3:1,mlx5_0:1,mlx5_1:1,lo", "UCX_MAX_RMA_RAILS": "4", **get}
    assert settings("cpu", REFIT_NIC_MODE="off") == {"UCX_NET_DEVICES": "lo"}
    assert settings("cpu", REFIT_NIC_MODE="stripe", REFIT_NIC_MIN_RATE_GBPS="500") == {"UCX_NET_DEVICES": "lo"}
    bound = settings("cuda:0", REFIT_BIND_ADDRESS="0.0.0.0")
    assert bound == {"UCX_NET_DEVICES": "mlx5_0:1", "UCX_MAX_RMA_RAILS": "1", **get}
    mine = settings("cuda:0", UCX_NET_DEVICES="mlx5_3:1", UCX_MAX_RMA_RAILS="2", UCX_CUDA_IPC_ENABLE_GET_ZCOPY="n")
    assert mine == {"UCX_NET_DEVICES": "mlx5_3:1", "UCX_MAX_RMA_RAILS": "2", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    # every peer on this host: no NIC (shared memory, CMA, CUDA IPC); debug: UCX says what it chose
    env = {"REFIT_SYSFS_ROOT": root, "REFIT_NIXL_DEBUG": "1"}
    nixl_agent.apply_ucx_settings(torch.device("cpu"), env, one_host=True)
    assert {k: v for k, v in env.items() if k.startswith("UCX_")} == {
        "UCX_NET_DEVICES": "lo",
        "UCX_LOG_LEVEL": "info",
        "UCX_PROTO_INFO": "y",
    }


def test_a_later_agent_chooses_its_ucx_settings_anew_unless_the_user_set_them(tmp_path):
    from test_net import _node

    _node(tmp_path, 4)
    env = {"REFIT_SYSFS_ROOT": str(tmp_path)}
    nixl_agent.apply_ucx_settings(torch.device("cuda:2"), env, one_host=True)  # a first agent: peers on this host
    assert env["UCX_NET_DEVICES"] == "lo"
    nixl_agent.apply_ucx_settings(torch.device("cuda:2"), env)  # a later one with peers elsewhere: its NIC again
    assert env["UCX_NET_DEVICES"] == "mlx5_2:1,lo" and env["UCX_MAX_RMA_RAILS"] == "1"
    env["UCX_NET_DEVICES"] = "mlx5_3:1"  # the user changed it since: it stands
    nixl_agent.apply_ucx_settings(torch.device("cuda:0"), env, one_host=True)
    assert env["UCX_NET_DEVICES"] == "mlx5_3:1"


def test_nics_are_left_out_only_where_the_plan_shows_every_peer_on_this_host():
    src, dst = _layouts("tiny-llama", "tp=2", "tp=1")
    cfg = TransferConfig(transport="nixl")
    assert not nixl_agent.peers_on_this_host(build_plan(src, dst, config=cfg), 2)  # no devices: not known
    one = ProcessMap((0, 1), (2,), ("cuda:0", "cuda:1", "cuda:0"))
    assert all(nixl_agent.peers_on_this_host(build_plan(src, dst, one, cfg), p) for p in range(3))
    two = ProcessMap((0, 1), (2,), ("a/cuda:0", "b/cuda:0", "a/cuda:1"))
    plan = build_plan(src, dst, two, cfg)
    assert [nixl_agent.peers_on_this_host(plan, p) for p in range(3)] == [True, False, False]


def test_debug_trace_prints_a_line_per_phase_only_when_asked(monkeypatch, capsys):
    monkeypatch.delenv("REFIT_NIXL_DEBUG", raising=False)
    nixl_agent.Trace(3)("registered %d regions", 7)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("REFIT_NIXL_DEBUG", "1")
    trace = nixl_agent.Trace(3)
    trace("registered %d regions", 7)
    err = capsys.readouterr().err
    assert f"pid {os.getpid()} process 3 +" in err and err.strip().endswith("registered 7 regions")
    assert not trace.every("read", 0.05)  # the first call starts the period
    time.sleep(0.06)
    assert trace.every("read", 0.05) and not trace.every("read", 0.05)


def _striped_worker(world, sysfs):
    # before any agent exists: the fake node's NICs, striped (UCX warns they are absent here and uses lo)
    os.environ.update({"REFIT_SYSFS_ROOT": sysfs, "REFIT_NIC_MODE": "stripe"})
    src, dst = _layouts("tiny-llama", "tp=1", "tp=1")
    cfg = TransferConfig(transport="nixl", preflight_timeout_s=120.0)
    if world.src_rank is not None:
        Sender(src, dst, 0, reference_shards(src, 0), config=cfg).push(1)
        return nixl_agent.ucx_config()
    live = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in dst}
    r = Receiver(src, dst, 1, live, config=cfg)
    r.pull(1)
    seen = nixl_agent.ucx_config()  # UCX's own reading, while the agent that moved the bytes is alive
    r.close()
    return seen, holds(live, dst, 0)


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_nic_settings_are_in_the_ucx_configuration_of_a_running_transfer(tmp_path):
    from test_net import _node

    _node(tmp_path, 4)
    out = run_local(_striped_worker, 1, 1, str(tmp_path), backend="gloo", timeout_s=240)
    assert out[1][1]  # the bytes arrived
    for cfg in (out[0], out[1][0]):
        assert cfg["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,lo"
        assert cfg["UCX_MAX_RMA_RAILS"] == "4"


def test_the_cost_model_prices_nixl_plans_with_the_selected_nics():
    from refit.cost import Topology, predict

    src, dst = _layouts("tiny-llama", "tp=4", "tp=4")  # trainer on node 0, engine on node 1
    topo = Topology(nodes=2, gpus_per_node=4, nics_per_node=8, nic_gbps=50.0, pcie_gbps=55.0)
    by = {m: {p.strategy: p for p in predict(src, dst, topo, nixl_nic_mode=m)} for m in ("auto", "stripe")}
    auto, stripe = by["auto"]["nixl"], by["stripe"]["nixl"]
    assert auto.busiest.startswith("nic_") and stripe.busiest.startswith("nic_")  # cross-node: the NICs set it
    assert auto.busiest_bytes == stripe.busiest_bytes == by["auto"]["p2p"].busiest_bytes  # the same plan
    assert auto.seconds / stripe.seconds == pytest.approx(55.0 / 50.0)  # stripe: all NICs, capped by PCIe
    assert "stripe (55 GB/s per GPU)" in stripe.note
    assert "nixl" not in {p.strategy for p in predict(src, dst, topo)}


# ---------------------------------------------------------------------------- security
NAME = "nixlsec"


def _listeners() -> list[str]:
    """Every address this process listens on (TCP listeners, unconnected UDP sockets)."""
    import psutil

    conns = psutil.Process(os.getpid()).net_connections("inet")
    return [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == "LISTEN" or (c.type == 2 and not c.raddr)]


def _secure_worker(world, workdir):
    from pathlib import Path

    import torch.distributed as dist

    work = Path(workdir)
    if world.rank == 0:  # where the store is (a stranger would scan for it)
        world.store.raw.set("probe", "x")
        from refit.transport import auth
        from refit.transport.authstore import access_key  # the store's access key, not the job secret

        store = dist.distributed_c10d._get_default_store().underlying_store
        key = access_key(auth.job_secret(), os.environ.get("REFIT_JOB_ID", "")).hex()
        (work / "port").write_text(f"{store.port} {key}")
    src, dst = _layouts("tiny-llama", "tp=1", "tp=1")
    cfg = TransferConfig(name=NAME, transport="nixl", preflight_timeout_s=120.0, deadline_s=60.0)
    tensors = (
        reference_shards(src, 0) if world.rank == 0 else {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in dst}
    )
    p = Peer(src, dst, world.rank, src_tensors=tensors if world.rank == 0 else None,
             dst_tensors=None if world.rank == 0 else tensors, config=cfg)  # fmt: skip
    p.run(1)
    listening = _listeners()  # with the agent alive and connected
    (work / f"ran{world.rank}").write_text("1")
    deadline = time.monotonic() + 120
    while not (work / "stranger-done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # keep the job (its store, agents, registered memory) alive for the stranger
    p.close()
    return listening, holds(tensors, dst, 0)


def _stranger(work, result):
    """No job secret: reads the NIXL record from the live store and tries to use it."""

    from refit.errors import ConfigError
    from refit.transport.store import SignedStore

    try:
        while not ((work / "ran0").exists() and (work / "ran1").exists()):
            time.sleep(0.05)
        from refit.transport.authstore import AuthStore  # on the store (its access key), without the job secret

        port, key = (work / "port").read_text().split()
        store = AuthStore("127.0.0.1", int(port), bytes.fromhex(key), 30.0)
        prefix = next(k for k in store.list_keys() if k.endswith("probe"))[: -len("probe")]
        keys = [k for k in store.list_keys() if "/nixl/record/" in k]
        raw = bytes(store.get(keys[0]))
        result["keys"], result["raw"] = keys, raw
        wrong = SignedStore(store, b"not-the-job-secret-" + os.urandom(8).hex().encode(), "")
        try:
            wrong.get_sealed(keys[0][len(prefix) :], 2.0)
            result["unsealed"] = True
        except (ConfigError, TimeoutError):
            result["unsealed"] = False
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("stranger", nixl_agent_config(backends=["UCX"], enable_listen_thread=False))
        try:  # the sealed blob as agent metadata
            agent.add_remote_agent(raw)
            result["connected"] = True
        except Exception:  # noqa: BLE001 - NIXL refuses it
            result["connected"] = False
    except BaseException as e:  # noqa: BLE001 - reported by the test
        result["error"] = repr(e)
    finally:
        (work / "stranger-done").write_text("1")


@needs_nixl
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_with_nixl_only_loopback_listens_and_a_stranger_gets_nothing_usable(tmp_path):
    import threading

    result: dict = {}
    t = threading.Thread(target=_stranger, args=(tmp_path, result), daemon=True)
    t.start()
    try:
        out = run_local(_secure_worker, 1, 1, str(tmp_path), backend="gloo", timeout_s=240)
    finally:
        (tmp_path / "stranger-done").write_text("1")
        t.join(timeout=60)
    assert "error" not in result, result.get("error")
    assert out[1][1]  # the refit itself was exact
    for listening, _ in out:
        assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening
        assert not any(a.endswith(":8888") for a in listening)  # NIXL's own metadata listener is off
    # the record that grants access is sealed: no agent name, metadata or address in clear
    assert result["keys"] and result["raw"].startswith(b"refit1.") and b'{"sealed":' in result["raw"]
    assert b"metadata" not in result["raw"] and b"regions" not in result["raw"]
    assert result["unsealed"] is False and result["connected"] is False


def _landed_worker(world, versions):
    # 8 x 256 MiB bf16 weights, tp=1 -> tp=1: each version's values must be in the engine's tensors, whole, as
    # soon as pull() returns (checked on the device without waiting for it first), although the trainer writes
    # the next values into its tensors as soon as push() returns
    shapes = [(f"model.layers.{i}.mlp.down_proj.weight", (8192, 16384), torch.bfloat16) for i in range(8)]
    src, dst = (layout_from_spec(shapes, parse_spec("tp=1", side)) for side in ("src", "dst"))
    procs = ProcessMap.disjoint(1, 1).with_devices(world.devices)
    cfg = TransferConfig(transport="nixl", deadline_s=60.0, preflight_timeout_s=120.0)
    if world.src_rank is not None:
        tensors = {n: torch.full(s, 1.0, dtype=d, device=world.device) for n, s, d in shapes}
        s = Sender(src, dst, world.rank, tensors, procs=procs, config=cfg, device=world.device)
        for v in range(1, versions + 1):
            s.push(v)
            for t in tensors.values():
                t.fill_(-1.0)  # the trainer's next step, at once
            for t in tensors.values():
                t.fill_(v + 1.0)
        s.close()
        return []
    live = {n: torch.zeros(s, dtype=d, device=world.device) for n, s, d in shapes}
    r = Receiver(src, dst, world.rank, live, procs=procs, config=cfg, device=world.device)
    wrong = []
    for v in range(1, versions + 1):
        r.pull(v)
        exact = torch.stack([(t == v).all() for t in live.values()])  # queued at once on the engine's stream
        wrong += [(v, n) for n, ok in zip(live, exact.tolist()) if not ok]
    r.close()
    return wrong


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
def test_nixl_reads_between_gpus_have_landed_when_pull_returns():
    gpus = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    out = run_local(_landed_worker, 1, 1, 4, devices=gpus, timeout_s=240)
    assert out == [[], []], out[1]
