"""Run by tests/test_checksum.py with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors): the kernel of
``refit.transport.checksum_triton`` against ``reference_sum``, bit for bit. Prints ALL OK."""

from __future__ import annotations

import os

import torch

from refit.transport.checksum import KEY, LEN_KEY, MUL1, MUL2, Piece, PieceSums, reference_sum
from refit.transport.checksum_triton import SumLaunch, kernel_row
from refit.transport.p2p import MessageSums, _Op, _Step

assert os.environ.get("TRITON_INTERPRET") == "1"
G = torch.Generator().manual_seed(0)
CONSTANTS = (KEY, MUL1, MUL2, LEN_KEY)


def rand_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=G)


def kernel_sums(pieces: list[Piece], n_out: int, **launch) -> torch.Tensor:
    """Every piece through the kernel (each must be addressable), with ``launch``'s block and steps."""
    rows = [kernel_row(p.src, p.dst, p.base, p.slot) for p in pieces]
    assert all(r is not None for r in rows), rows
    out = torch.zeros(n_out, dtype=torch.int64)
    SumLaunch(rows, torch.device("cpu"), CONSTANTS, **launch).launch(out)
    return out


def ref(t: torch.Tensor, base: int = 0) -> int:
    return int(reference_sum(t, base))


def odd_sizes() -> None:
    for n in (0, 1, 7, 8, 9, 1023, (1 << 17) + 5):
        t = rand_bytes(n)
        out = torch.zeros(2, dtype=torch.int64)
        ps = PieceSums([Piece(t, 1, base=3)], out, use_triton=True)
        ps.run()
        assert ps.kernel_pieces == 1 and int(out[1]) == ref(t, 3), n
        d = torch.zeros(n, dtype=torch.uint8)
        ps = PieceSums([Piece(t, 0, dst=d)], out, use_triton=True)
        ps.run()
        assert torch.equal(d, t) and int(out[0]) == ref(t), n
        for loop in (False, True):  # many chunks per piece
            small = kernel_sums([Piece(t, 0)], 1, block=16, steps=2, loop=loop)
            assert int(small[0]) == ref(t), n


def pitched_rows() -> None:
    narrow = torch.randn(40, 30, generator=G)[:, 4:24]  # rows of 10 words, pitch 15: shorter than a block
    wide = torch.randn(40, 100, generator=G)[:, 4:68]  # rows of 32 words, pitch 50: a block crosses one row end
    for v in (narrow, wide):
        for loop in (False, True):
            assert int(kernel_sums([Piece(v, 0)], 1, block=16, steps=2, loop=loop)[0]) == ref(v)
            assert int(kernel_sums([Piece(v, 0)], 1, block=16, steps=4, loop=loop)[0]) == ref(v)
            dense = torch.zeros(v.shape)
            pitched = torch.zeros(v.shape[0], v.shape[1] + 16)[:, 8:-8]
            out = kernel_sums([Piece(v, 0, dst=dense), Piece(v, 1, dst=pitched)], 2, block=16, steps=2, loop=loop)
            assert torch.equal(dense, v) and torch.equal(pitched, v)
            assert out.tolist() == [ref(v)] * 2
    bf = torch.randn(64, 2048, generator=G).to(torch.bfloat16)[:, 1024:]  # rows of 256 words, default block
    out = torch.zeros(1, dtype=torch.int64)
    PieceSums([Piece(bf, 0)], out, use_triton=True).run()
    assert int(out[0]) == ref(bf)


def many_pieces_one_launch() -> None:
    a, b, c = rand_bytes(100), torch.randn(9, 20, generator=G)[:, 2:18], rand_bytes(8)
    want = [(ref(a, 2) + ref(b, 40) + (1 << 63)) % (1 << 64) - (1 << 63), ref(c), ref(a)]
    for loop in (False, True):
        pieces = [Piece(a, 0, base=2), Piece(b, 0, base=40), Piece(c, 1), Piece(a, 2)]
        out = kernel_sums(pieces, 3, block=16, steps=2, loop=loop)
        assert out.tolist() == want, (loop, out.tolist(), want)


def unaligned_falls_back() -> None:
    raw = rand_bytes(203)
    v = raw[3:]  # 3 bytes into the storage: the kernel cannot address it
    assert kernel_row(v, None, 0, 0) is None
    out = torch.zeros(1, dtype=torch.int64)
    ps = PieceSums([Piece(v, 0)], out, use_triton=True)
    ps.run()
    assert ps.kernel_pieces == 0 and int(out[0]) == ref(v)


def fused_p2p_message_equals_plain() -> None:
    """A sender that packs and sums in one kernel and a receiver that sums the buffer agree."""
    src = [torch.randn(6, 20, generator=G)[:, 4:12], rand_bytes(37), torch.randn(5, generator=G)]
    offsets = [0, 192, 256]
    buf = torch.zeros(320, dtype=torch.uint8)
    pack = [(buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape), t) for o, t in zip(offsets, src)]
    send = _Op(peer=1, tag=0, tensor=buf[:276], pack=pack)
    step = _Step(sends=[send])
    sender = MessageSums([step], torch.device("cpu"), fused=True)
    step.pack_sums.run()  # packs and sums
    assert all(torch.equal(bv, tv) for bv, tv in pack)
    for fused in (False, True):
        rbuf = buf.clone()
        dsts = [torch.zeros_like(t) for t in src]
        rpack = [
            (rbuf[o : o + d.numel() * d.element_size()].view(d.dtype).view(d.shape), d) for o, d in zip(offsets, dsts)
        ]
        recv = _Op(peer=0, tag=0, tensor=rbuf[:276], pack=rpack)
        rstep = _Step(recvs=[recv])
        receiver = MessageSums([rstep], torch.device("cpu"), fused=fused)
        receiver.want.copy_(sender.sent)
        rstep.unpack_sums.run()
        receiver.check()
        assert recv.got.tolist() == send.sum.tolist()
        if fused:
            assert all(torch.equal(d, t) for d, t in zip(dsts, src))


for case in (odd_sizes, pitched_rows, many_pieces_one_launch, unaligned_falls_back, fused_p2p_message_equals_plain):
    case()
    print(case.__name__, "ok", flush=True)
print("ALL OK")
