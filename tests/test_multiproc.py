"""Multi-process refits on CPU gloo: the layout matrix, pre-flight failures without hangs, DTensor modules."""

import pytest
import torch

from refit.config import TransferConfig
from refit.layout import Mesh, ModelLayout, TensorLayout, box_slices
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.launch import WorkerError, run_local
from refit.tools.verify import reference_tensor, verify
from refit.transfer import Receiver, Sender

pytestmark = pytest.mark.multiproc

PAIRS = [
    ("tp=2", "tp=1,dp=2"),
    ("fsdp=2", "tp=2"),
    ("tp=2,pp=2", "tp=4"),
    ("dp=2,tp=2", "tp=1,dp=4"),
    ("fsdp=4", "tp=2,dp=2"),
    ("dp=2,tp=2", "dp=2,tp=2"),
    ("tp=3", "tp=2"),  # uneven chunks everywhere
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("src,dst", PAIRS)
def test_reshard_is_bit_exact(src, dst):
    shapes = param_shapes("tiny-qwen2")  # q/k/v biases too
    # a small buffer forces packing, splitting and several steps
    res = verify(
        layout_from_spec(shapes, parse_spec(src, "src")),
        layout_from_spec(shapes, parse_spec(dst, "dst")),
        config=TransferConfig(num_buffers=2, buffer_bytes=16 << 10),
        timeout_s=200,
    )
    assert res.ok, res.mismatches[:5]
    assert res.plan.ratio == 1.0
    assert res.bytes_checked == res.plan.bytes_needed


BUDGET = TransferConfig(num_buffers=2, buffer_bytes=8 << 10)


def _bf16_worker(world, src, dst):
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    if world.src_rank is not None:
        local = {
            t.name: reference_tensor(t.name, t.shape, t.dtype)[box_slices(b)].clone()
            for t, b in src.local_tensors(world.src_rank)
        }
        s = Sender(src, dst, world.rank, local, procs=procs, config=BUDGET)
        for v in (1, 2):
            s.push(v)
        return s.executor.staging_bytes
    local = {
        t.name: torch.zeros(tuple(y - x for x, y in b), dtype=t.dtype) for t, b in dst.local_tensors(world.dst_rank)
    }
    r = Receiver(src, dst, world.rank, local, procs=procs, config=BUDGET)
    r.pull(1)
    r.executor.stamps = []  # profiling: the run's phases, in order (``Executor.stamps``)
    r.pull(2)
    stamps = r.executor.stamps
    assert [w for w, _ in stamps] == ["start", "moved"] and stamps[0][1] <= stamps[1][1], stamps
    same = all(
        torch.equal(
            local[t.name].view(torch.int16), reference_tensor(t.name, t.shape, t.dtype)[box_slices(b)].view(torch.int16)
        )
        for t, b in dst.local_tensors(world.dst_rank)
    )
    return same, r.version, r.executor.staging_bytes


@pytest.mark.timeout(120)
def test_bf16_bits_survive_within_the_buffer_budget():
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes("tiny-llama")]
    src = layout_from_spec(shapes, parse_spec("fsdp=2", "src"))
    dst = layout_from_spec(shapes, parse_spec("tp=2", "dst"))
    out = run_local(_bf16_worker, 2, 2, src, dst, backend="gloo", timeout_s=100)
    assert [o[:2] for o in out[2:]] == [(True, 2), (True, 2)]
    staging = out[:2] + [o[2] for o in out[2:]]
    assert all(0 < b <= BUDGET.num_buffers * BUDGET.buffer_bytes for b in staging), staging


def _mismatch_worker(world, src_shape, dst_shape):
    shape = src_shape if world.src_rank is not None else dst_shape
    t_src = TensorLayout("w", shape, torch.float32, Mesh((1,), ("tp",), (0,)), (torch.distributed.tensor.Replicate(),))
    lay = ModelLayout((t_src,), 1)
    cfg = TransferConfig(preflight_timeout_s=30)
    if world.src_rank is not None:
        Sender(lay, lay, world.rank, {"w": torch.ones(shape)}, config=cfg).push(1)
    else:
        Receiver(lay, lay, world.rank, {"w": torch.zeros(shape)}, config=cfg).pull(1)


@pytest.mark.timeout(90)
def test_shape_mismatch_between_sides_fails_fast_on_every_rank():
    with pytest.raises(WorkerError) as e:
        run_local(_mismatch_worker, 1, 1, (4, 4), (4, 5), backend="gloo", timeout_s=60)
    msg = str(e.value)
    assert "pre-flight" in msg and "'w'" in msg and "[4, 4]" in msg and "[4, 5]" in msg


def _bad_local_worker(world, fault="shape"):
    shapes = param_shapes("tiny-llama")
    src = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    dst = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    cfg = TransferConfig(preflight_timeout_s=30)
    if world.src_rank is not None:
        local = {t.name: reference_tensor(t.name, t.shape, t.dtype) for t in src}
        Sender(src, dst, world.rank, local, config=cfg).push(1)
    else:
        local = {t.name: torch.zeros(t.shape) for t in dst}
        if fault == "shape":
            local["lm_head.weight"] = torch.zeros(3, 3)  # the engine's live tensor has the wrong shape
        else:  # right shape, but a transposed view: not one dense run
            local["lm_head.weight"] = torch.zeros(tuple(reversed(local["lm_head.weight"].shape))).t()
        Receiver(src, dst, world.rank, local, config=cfg).pull(1)


@pytest.mark.timeout(90)
def test_wrong_local_tensor_fails_before_any_collective():
    with pytest.raises(WorkerError) as e:
        run_local(_bad_local_worker, 1, 1, backend="gloo", timeout_s=60)
    msg = str(e.value)
    assert "'lm_head.weight' has shape [3, 3], the layout expects [512, 128]" in msg


@pytest.mark.timeout(90)
def test_non_dense_local_tensor_fails_at_setup_not_on_the_wire():
    with pytest.raises(WorkerError) as e:
        run_local(_bad_local_worker, 1, 1, "strided", backend="gloo", timeout_s=60)
    msg = str(e.value)
    assert "destination rank 0: local tensor 'lm_head.weight' (strides [1, 512]) is not laid out densely" in msg


def _dtensor_worker(world):
    from refit.layout.models import build_model, load_config
    from refit.trainers.dtensor import layout_from_module, local_shards
    from refit.trainers.hf_tp import parallelize_tp

    shapes = param_shapes("tiny-qwen3")
    spec_layout = layout_from_spec(shapes, parse_spec("tp=2", "src"))
    if world.src_rank is None:
        return None
    model = build_model(load_config("tiny-qwen3"), torch.float32, seed=0)
    parallelize_tp(model, world.trainer_group, "cpu")
    lay = layout_from_module(model, world.n_src)
    local = local_shards(model)
    shapes_ok = all(
        tuple(local[t.name].shape) == tuple(y - x for x, y in b) for t, b in lay.local_tensors(world.src_rank)
    )
    from refit.plan import canonical_tensor

    return [canonical_tensor(t) for t in lay] == [canonical_tensor(t) for t in spec_layout], shapes_ok


@pytest.mark.timeout(120)
def test_layout_from_parallelized_module_matches_spec_rules():
    out = run_local(_dtensor_worker, 2, 1, backend="gloo", timeout_s=100)
    assert out[:2] == [(True, True), (True, True)]


def _fsdp_worker(world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh

    from refit.trainers.dtensor import layout_from_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    mesh = DeviceMesh.from_group(world.trainer_group, "cpu", mesh_dim_names=("fsdp",))
    fully_shard(model, mesh=mesh)
    lay = layout_from_module(model, world.n_src)
    return [(t.name, t.box(0), t.box(1)) for t in lay]


@pytest.mark.timeout(120)
def test_layout_from_fully_sharded_module():
    out = run_local(_fsdp_worker, 2, 0, backend="gloo", timeout_s=100)
    assert out[0] == out[1]
    assert out[0][0] == ("0.weight", ((0, 3), (0, 8)), ((3, 6), (0, 8)))
    assert out[0][3] == ("1.bias", ((0, 2),), ((2, 3),))


def _barrier_worker(world, seg):
    import time

    from refit.transport.host_barrier import HostBarrier

    b = HostBarrier(seg, world.rank, world.world_size, timeout_s=30)
    torch.distributed.barrier()  # every process attached
    waited = []
    for i in range(20):
        if i == 10 and world.rank == 0:
            time.sleep(0.3)  # the late one
        t0 = time.perf_counter()
        b.wait()
        waited.append(time.perf_counter() - t0)
    torch.distributed.barrier()
    b.close()
    return waited[10], b.gen


@pytest.mark.timeout(120)
def test_host_barrier_in_shared_memory_waits_for_the_late_process():
    import uuid

    out = run_local(_barrier_worker, 3, 0, f"refit_test_{uuid.uuid4().hex[:8]}", backend="gloo", timeout_s=100)
    assert [g for _, g in out] == [20, 20, 20]
    assert out[1][0] > 0.2 and out[2][0] > 0.2  # the others waited for rank 0


def _leave_worker(world, seg, fail_rank):
    import time

    from refit.transport.host_barrier import BarrierLeft, HostBarrier

    b = HostBarrier(seg, world.rank, world.world_size, timeout_s=30)
    torch.distributed.barrier()  # every process attached
    b.wait()  # one refit's barrier, passed by all
    outcome = "passed"
    if world.rank == fail_rank:
        time.sleep(0.2)  # the others are inside the next barrier
    else:
        try:
            b.wait(10.0)  # the failed process never arrives: it leaves
        except BarrierLeft as e:
            outcome = str(e)
    all_left = b.leave(10.0)
    b.close()
    return outcome, all_left


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fail_rank", [None, 0, 2])
def test_host_barrier_a_process_that_leaves_is_never_counted_as_arrived(fail_rank):
    # a process whose refit failed closes (leaves) instead of arriving: the others' wait raises at once
    # instead of passing (which would report the refit done) or waiting for the deadline; a process
    # that arrived and then left (fail_rank None: everyone passes, then leaves) counts as arrived
    import uuid

    seg = f"refit_test_{uuid.uuid4().hex[:8]}"
    out = run_local(_leave_worker, 3, 0, seg, fail_rank if fail_rank is not None else -1, backend="gloo", timeout_s=100)
    for rank, (outcome, all_left) in enumerate(out):
        assert all_left
        if fail_rank is None or rank == fail_rank:
            assert outcome == "passed"
        else:
            assert outcome == f"barrier: participants [{fail_rank}] left (closed) instead of arriving"


def test_host_barrier_arrive_counts_without_waiting():
    # an IPC receiver at a refit's last barrier only arrives: its sources pass, it does not wait for them, and its
    # next wait is for the generation after
    import uuid

    from refit.errors import DeadlineExceeded
    from refit.transport.host_barrier import HostBarrier

    name = f"refit_test_{uuid.uuid4().hex[:8]}"
    src = HostBarrier(name, 0, 2, timeout_s=10)
    rcv = HostBarrier(name, 1, 2, timeout_s=10)
    try:
        rcv.arrive()  # returns although the source has not arrived
        src.wait(5.0)  # the receiver counts as arrived
        with pytest.raises(DeadlineExceeded):
            src.wait(0.05)  # the next generation: the receiver is not there yet
        rcv.wait(5.0)  # generation 2 for both
        assert (src.gen, rcv.gen) == (2, 2)
    finally:
        rcv.close()
        src.close()


def _one_dies(world):
    import os
    import signal

    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no Python error, no result
    torch.distributed.barrier()  # the survivors see the peer's socket close


@pytest.mark.timeout(120)
def test_launcher_names_the_process_that_died_not_its_collateral():
    with pytest.raises(WorkerError) as e:
        run_local(_one_dies, 2, 1, backend="gloo", timeout_s=60)
    assert str(e.value).startswith("process 1 failed: process exited with signal SIGKILL")


def test_host_barrier_attaches_to_a_segment_created_but_not_yet_sized():
    # the owner's shm_open and ftruncate are two steps: a peer attaching in between sees an empty
    # file (mmap of 0 bytes fails); it must wait for the size, not crash
    import os
    import threading
    import time
    import uuid

    from refit.transport.host_barrier import HostBarrier

    name = f"refit_test_{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)  # created, size 0
    got = {}

    def attach():
        try:
            got["barrier"] = HostBarrier(name, 1, 2, timeout_s=10)
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e

    t = threading.Thread(target=attach)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # still waiting for the size
    os.ftruncate(fd, 16)
    t.join(timeout=10)
    os.close(fd)
    try:
        assert "error" not in got, got.get("error")
        b = got["barrier"]
        assert b.slots.shape == (2,) and list(b.slots) == [0, 0]
        b.close()
    finally:
        os.unlink(path)


def _shm_name() -> str:
    import uuid

    return f"refit_test_{uuid.uuid4().hex[:8]}"


def test_host_barrier_refuses_a_segment_others_can_open_or_a_symlink():
    # another local user could pre-create the segment (mode 0666) to read or forge the slots
    import os

    from refit.errors import PlanError
    from refit.transport.host_barrier import HostBarrier

    name, link = _shm_name(), _shm_name()
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 16)
        os.fchmod(fd, 0o666)
        with pytest.raises(PlanError, match=f"{path} has owner uid .* mode -rw-rw-rw-"):
            HostBarrier(name, 1, 2, timeout_s=5)
        os.fchmod(fd, 0o600)
        os.symlink(path, f"/dev/shm/{link}")
        with pytest.raises(PlanError, match="symbolic link"):
            HostBarrier(link, 1, 2, timeout_s=5)
    finally:
        os.close(fd)
        os.unlink(path)
        if os.path.lexists(f"/dev/shm/{link}"):
            os.unlink(f"/dev/shm/{link}")


class _Store:
    """A dict standing in for ``SignedStore``: ``put``, ``get``, ``get_all``; ``on_put`` sees each put."""

    def __init__(self, on_put=None):
        self.data, self.on_put = {}, on_put

    def put(self, key, value):
        if self.on_put is not None:
            self.on_put(key, value)
        self.data[key] = value

    def get(self, key, timeout_s):
        return self.data[key]

    def get_all(self, keys):
        return {k: self.data[k] for k in keys if k in self.data}


def test_host_barrier_owner_creates_a_private_segment_before_publishing_its_name():
    import os
    import stat

    from refit.transport.host_barrier import HostBarrier

    seen = {}

    def on_put(key, value):  # the name is published only once the segment exists, private
        seen["mode"] = stat.S_IMODE(os.stat(f"/dev/shm/{value['segment']}").st_mode)

    store = _Store(on_put)
    owner = HostBarrier.agree(store, "t/barrier", 0, 2, 5.0)
    other = HostBarrier.agree(store, "t/barrier", 1, 2, 5.0)
    assert seen["mode"] == 0o600 and owner.name == other.name
    path = f"/dev/shm/{owner.name}"
    other.close()
    owner.close()
    owner.close()  # idempotent
    assert not os.path.exists(path)


def test_host_barrier_never_closed_is_unlinked_when_collected():
    import gc
    import os

    from refit.transport.host_barrier import HostBarrier

    name = _shm_name()
    owner, other = HostBarrier(name, 0, 2, timeout_s=5), HostBarrier(name, 1, 2, timeout_s=5)
    assert os.path.exists(f"/dev/shm/{name}")
    del owner, other
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_launch_exit_barrier_is_skipped_without_cuda():
    # a process that never initialized CUDA maps nobody's GPU memory: it neither writes nor waits at exit
    from refit.tools.launch import release_at_exit

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the store was used: {name}")

    assert not torch.cuda.is_initialized()
    assert release_at_exit(Untouchable(), 0, [0, 1]) is False


def test_launch_exit_barrier_waits_for_the_listed_ranks_and_not_past_a_failed_store():
    from refit.tools.launch import _wait_for_all

    store = _Store()
    store.put("launch/exit/1", True)
    _wait_for_all(store, 0, [0, 1], timeout_s=30)  # both there: returns without waiting out the timeout
    assert store.get_all(["launch/exit/0", "launch/exit/1"]) == {"launch/exit/0": True, "launch/exit/1": True}
    _wait_for_all(store, 2, [0, 1, 2, 3], timeout_s=0.05)  # rank 3 never comes: bounded

    class Gone(_Store):
        def get_all(self, keys):
            raise RuntimeError("Connection reset by peer")  # the store's host (process 0) left

    _wait_for_all(Gone(), 1, [0, 1], timeout_s=30)
