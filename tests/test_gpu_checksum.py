"""The checksum kernel on a GPU (skipped on CPU): equal to the torch reference bit for bit, one launch for
many pieces, the fused copy, and IPC pulls with checksums on that catch a changed piece (one GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from refit.config import TransferConfig
from refit.layout import box_slices
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.launch import run_local
from refit.tools.verify import reference_tensor
from refit.transfer import Peer
from refit.transport.checksum import Piece, PieceSums, checksum, reference_sum, triton_enabled
from refit.transport.ipc import IpcSums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and not triton_enabled(), reason="needs triton"),
]


def _views(dev: str) -> list[torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    u8 = torch.randint(0, 256, ((64 << 20) + 5,), dtype=torch.uint8, device=dev, generator=g)
    m = torch.randn(1024, 4096, device=dev, generator=g).to(torch.bfloat16)
    return [
        *(u8[:n] for n in (0, 1, 7, 8, 9, 1023)),
        u8,  # 64 MiB and a tail
        m,
        m[:, 1024:3072],  # rows of 512 words, pitch 1024: a step crosses a row end
        m[:, 8:24],  # rows of 4 words: narrower than a step
        m[3:900],
        m.view(torch.float32)[:, 100:1900],
        m[:, 3:11],  # 6-byte offset: not addressable, torch path
    ]


def test_kernel_equals_torch_reference_on_cuda_and_cpu():
    for v in _views("cuda"):
        got = checksum(v).tolist()
        assert got[0] == int(reference_sum(v)) == int(reference_sum(v.cpu())), v.shape
        assert got[1] == v.numel() * v.element_size()


def test_one_launch_for_many_pieces_equals_one_per_piece():
    views = _views("cuda")
    out = torch.zeros(len(views), dtype=torch.int64, device="cuda")
    sums = PieceSums([Piece(v, i) for i, v in enumerate(views)], out)
    sums.run()
    assert sums.kernel_pieces == len(views) - 1  # all but the unaligned one
    assert out.tolist() == [int(checksum(v)[0]) for v in views]


def test_fused_copy_moves_the_bytes_and_sums_them():
    views = _views("cuda")
    dsts = [torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v) for v in views]
    pitched = torch.zeros(1024, 4096, dtype=torch.bfloat16, device="cuda")[:, 2048:]  # pitched destination
    pairs = [*zip(dsts, views), (pitched, views[8])]
    out = torch.zeros(len(pairs), dtype=torch.int64, device="cuda")
    PieceSums([Piece(s, i, dst=d) for i, (d, s) in enumerate(pairs)], out).run()
    assert all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in pairs if d.numel())
    assert out.tolist() == [int(checksum(s)[0]) for _, s in pairs]


def _ipc_worker(world, src_l, dst_l, procs, damage: str, gpus: int):
    """Version 1 clean; version 2 with one pulled piece changed after the pull (on the receiver). On one GPU a
    destination is summed only without Triton (with it, the kernel sums what it copies)."""
    os.environ["REFIT_SUM_TRITON"] = "0" if (damage, gpus) == ("destination", 1) else "1"
    dev = world.device
    is_src = world.rank in procs.src
    layout = src_l if is_src else dst_l
    tensors = {
        t.name: reference_tensor(t.name, t.shape, t.dtype, seed=1)[box_slices(b)].clone().to(dev)
        for t, b in layout.local_tensors(0)
    }
    if not is_src:
        for t in tensors.values():
            t.fill_(float("nan"))
    kw = {"src_tensors": tensors} if is_src else {"dst_tensors": tensors}
    cfg = TransferConfig(transport="ipc", checksums=True, deadline_s=60.0)
    flag = torch.zeros((), dtype=torch.uint8, device=dev)  # 1: the re-read's source is damaged first
    fused_here = not is_src and (damage, gpus) == ("source", 1)
    if fused_here:  # the fused work is recorded into the pull's CUDA graph at setup: damage inside it, by a flag
        _damage_rereads(flag)
    peer = Peer(src_l, dst_l, world.rank, procs=procs, config=cfg, device=dev, **kw)
    peer.run(1)
    exact = is_src or all(
        torch.equal(t.cpu(), reference_tensor(n, t.shape, t.dtype, seed=1)) for n, t in tensors.items()
    )
    fused, named = 0, None
    if not is_src:
        sums = peer.executor.ipc.sums
        fused = sum(f.kernel_pieces for f in sums.fused if f is not None)
        if damage == "source":  # the first pulled piece's source, changed after the pull, before its re-read
            victim = next((r for r in sums.reread if r is not None), None) or next(iter(sums.src_sums.values()))
        else:  # ... or its destination, before it is summed
            victim = sums.dst_sums
        named = sums.names[victim.pieces[0].slot]  # the error must name the tensor damaged
        if fused_here:
            assert peer.executor.ipc.pullers[0].graph is not None  # the fused work runs inside the graph
            flag.fill_(1)
        else:
            view, run = victim.pieces[0].src, victim.run

            def run_after_damage() -> None:  # on the stream the sum runs on: ordered after the copy
                b = view.view(torch.uint8)
                b[(0,) * b.dim()] ^= 1
                run()

            victim.run = run_after_damage
    try:
        peer.run(2)
        error = None
    except Exception as e:  # noqa: BLE001 - the result to report
        error = str(e)
    finally:
        peer.close()  # a failed refit still frees its barrier and mappings (no resource-tracker warnings)
    return exact, fused, error, named


def _damage_rereads(flag: torch.Tensor) -> None:
    """Every re-read of fused pieces (``IpcSums.fused_work``, recorded into the pull's graph) first flips the
    lowest bit of its first piece's source where ``flag`` is 1: a source changed after the pull read it."""
    fused_work = IpcSums.fused_work

    def damaging(self, stage: int):
        reread = self.reread[stage]
        if reread is not None and not hasattr(reread, "damaged"):
            b, run = reread.pieces[0].src.view(torch.uint8), reread.run

            def run_after_damage() -> None:
                b[(0,) * b.dim()] ^= flag
                run()

            reread.run, reread.damaged = run_after_damage, True
        return fused_work(self, stage)

    IpcSums.fused_work = damaging


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "damage,gpus",
    [
        ("source", 1),
        ("destination", 1),
        *(
            pytest.param(d, 2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"))
            for d in ("source", "destination")
        ),
    ],
)
def test_ipc_checksums_catch_a_changed_piece(damage, gpus):
    # one GPU with Triton: the kernel copies and sums (a source changed after the pull differs); across
    # GPUs (the copy engine moves the pieces) and without Triton the destination and source are summed
    # after the pull (a changed source or destination differs)
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes("tiny-llama")]
    src_l = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    dst_l = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    devices = ["cuda:0", "cuda:0" if gpus == 1 else "cuda:1"]
    procs = ProcessMap.disjoint(1, 1).with_devices(devices)
    out = run_local(_ipc_worker, 1, 1, src_l, dst_l, procs, damage, gpus, devices=devices, timeout_s=240)
    (_, _, src_error, _), (exact, fused, dst_error, named) = out
    assert exact
    assert (fused > 0) == (damage == "source" and gpus == 1)
    assert dst_error is not None and f"checksum mismatch in tensor {named!r}" in dst_error, (named, dst_error)
    assert src_error is not None and "checksum mismatch" in src_error, src_error
