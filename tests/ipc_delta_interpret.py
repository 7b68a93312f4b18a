"""Run by tests/test_ipc_delta.py with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors): a CUDA IPC delta
source (``refit.transport.ipc_delta.IpcDelta``: its plan, find, fit, pack, header and base update, on CPU tensors
here) over versions with nothing, a little, a lot and everything changed; after each, a receiver's ``IpcDelta``
(``_add_source`` given the source's staging as it would map it, then ``pull``: its header read and check, its dense
copies, ``rest`` and full pulls, its checked ``Scatter`` of ``scatter_rows``, ``verify``), reading the staging in place
and through its landing copy, brings the previous version bit for bit to the new one. Prints ALL OK."""

from __future__ import annotations

import os

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.delta.elements import bits
from refit.delta.served import OVER_STAGING
from refit.delta.staging import DENSE
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.transport import ipc_delta
from refit.transport.ipc_delta import HOST_BASE, NOT_ADDRESSED, OTHER_BASE, RULE, IpcDelta, read_header

assert os.environ.get("TRITON_INTERPRET") == "1"
G = torch.Generator().manual_seed(0)
# pieces of one and several kernel blocks (2048 words), one of 3 elements (no whole words: dense), fp32 and bf16
SHAPES = [
    ("model.layers.0.mlp.up_proj.weight", (64, 256), torch.bfloat16),
    ("model.layers.0.mlp.down_proj.weight", (256, 96), torch.bfloat16),
    ("model.layers.0.self_attn.q_proj.weight", (40, 48), torch.float32),
    ("model.layers.0.input_layernorm.weight", (3,), torch.bfloat16),
    ("model.layers.1.mlp.up_proj.weight", (128, 128), torch.bfloat16),
]


NORM = "model.layers.0.input_layernorm.weight"


def step(tensors: dict[str, torch.Tensor], fraction: float) -> None:
    for t in tensors.values():
        b = bits(t).view(-1)
        b ^= (torch.rand(b.shape, generator=G) < fraction).to(b.dtype)


def source(delta: str, budget_bytes: int, link_gbps: float | None = None, base: str = "device"):
    lay = layout_from_spec(SHAPES, parse_spec("tp=1", "src"))
    cfg = TransferConfig(transport="auto", delta=delta, num_buffers=1, buffer_bytes=budget_bytes,
                         delta_link_gbps=link_gbps, delta_base=base)  # fmt: skip
    plan = build_plan(lay, lay, ProcessMap((0,), (1,), ("cuda:0", "cuda:1")), cfg)
    cur = {n: torch.randn(s, generator=G).to(d) for n, s, d in SHAPES}
    parts = {t.name: ((b, cur[t.name]),) for t, b in lay.local_tensors(0)}
    return IpcDelta(plan, 0, LocalTensors(0, None, parts, {}, {}), cfg, "cpu"), plan, cur


class Copies:
    """A pull of ``pairs`` (destination, source) copy by copy: what the receiver's captured pulls do on a GPU."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs

    def pull(self, stream) -> None:
        for d, s in self.pairs:
            d.copy_(s)


def receiver(d: IpcDelta, plan, got: dict[str, torch.Tensor], land: bool) -> tuple[IpcDelta, Copies]:
    """Process 1's side of ``d``'s link into ``got``, its pulls reading ``d``'s tensors and staging directly (on GPUs:
    through their IPC mappings); ``land``: through its landing copy. Returns it and its pull of everything."""
    r = IpcDelta(plan, 1, LocalTensors(None, 0, {}, got, {}), d.config, "cpu")
    r.land = land
    r.make_copy = lambda dst, src: ("memcpy", lambda stream: dst.copy_(src))
    r.enable_peer_access = lambda device, peer: None
    sources = {plan.messages[k].pieces[0].tensor: op.views[0] for k, op in zip(d.facts[(0, 1)].ids, d.sends[1])}
    pulls = [(got[n], sources[n]) for n in (plan.messages[k].pieces[0].tensor for k in d.facts[(0, 1)].ids)]
    r._add_source(0, pulls, d.staging[1])
    r.rest = Copies([q for q in pulls if id(q) not in r.taken])
    return r, Copies(pulls)


def receive(r: IpcDelta, full: Copies, version: int, held: int | None) -> np.ndarray:
    """The receiver's refit of ``version`` holding ``held``. Returns the header's counts it read."""
    r.begin(version, held)
    r.pull(None, full)
    r.verify()
    f = r.recvs[0]
    return read_header(f.host.numpy(), version, f.nwords, f.facts.cap, "process 0")[1]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits(a[n]), bits(b[n])) for n in a)


def refit(d, plan, cur, got, version, held, fraction, r):
    """Source ``d`` refits ``version`` (``fraction`` of the bits flipped first) into receiver ``r`` = (its
    ``IpcDelta``, its full pull) holding ``held``: exact. Returns the counts per tensor, the source's statistics
    and the receiver's."""
    if fraction is not None:
        step(cur, fraction)
    d.begin(version, held)
    counts = receive(*r, version, held)
    d.pull(None, None)  # a source's pull after the barrier: its base update
    d.finish(version)
    assert same(got, cur), (version, fraction)
    for op in d.sends[1]:  # the base holds what was sent, where it is kept and not left stale
        assert not op.fast or op.stale or torch.equal(bits(op.bases[0]), bits(op.views[0])), op.op.names
    names = [plan.messages[k].pieces[0].tensor for k in d.facts[(0, 1)].ids]
    return dict(zip(names, counts.tolist())), d.stats, r[0].stats


def forced_words(land: bool) -> None:
    """Forced words, a budget that holds every delta but not 3 dense ones; finds of at most 40 kB (several batches,
    the next one found while this one's counts are read); the receiver reading in place or landing first."""
    d, plan, cur = source("words", 1 << 20)
    got = {n: torch.zeros_like(t) for n, t in cur.items()}
    r = receiver(d, plan, got, land)
    counts, st, rs = refit(d, plan, cur, got, 1, None, None, r)
    assert set(counts.values()) == {DENSE} and st.encodings["words"] == 0 and st.dense_why == {NOT_ADDRESSED: 1}
    counts, st, rs = refit(d, plan, cur, got, 2, 1, 0.0, r)  # nothing changed: every piece with words as 0 words
    assert counts == {**dict.fromkeys(counts, 0), NORM: DENSE} and st.encodings["words"] == 4 and st.diffed == 4
    counts, st, rs = refit(d, plan, cur, got, 3, 2, 0.01, r)
    assert all(k > 0 for n, k in counts.items() if n != NORM) and st.wire_bytes < 0.2 * st.dense_bytes, counts
    assert rs.dense_why == {} and rs.received_bytes < 0.2 * st.dense_bytes  # it read the changes, not the tensors
    counts, st, rs = refit(d, plan, cur, got, 4, 3, 0.5, r)  # over the find's slots (a quarter of the words): dense
    assert set(counts.values()) == {DENSE} and st.dense_why == {RULE: 4, NOT_ADDRESSED: 1}, st.dense_why
    counts, st, rs = refit(d, plan, cur, got, 5, 4, 0.001, r)
    assert st.encodings["words"] == 4
    # a receiver that holds another version: dense from the source's tensors (its copies), exact all the same
    for t in got.values():
        t.zero_()
    counts, st, rs = refit(d, plan, cur, got, 6, None, 0.001, r)
    assert st.encodings["words"] == 4  # the source staged them: it does not wait to hear what receivers hold
    assert rs.dense_why == {OTHER_BASE: 4} and rs.received_bytes >= st.dense_bytes, rs
    counts, st, rs = refit(d, plan, cur, got, 7, 6, 0.001, r)  # deltas again
    assert rs.dense_why == {} and st.encodings["words"] == 4
    # a staging budget of 2 KiB: the deltas that do not fit go dense, in order
    d, plan, cur = source("words", 2048)
    got = {n: t.clone() for n, t in cur.items()}
    r = receiver(d, plan, got, land)
    refit(d, plan, cur, got, 1, None, None, r)
    counts, st, rs = refit(d, plan, cur, got, 2, 1, 0.02, r)
    assert st.dense_why.get(OVER_STAGING, 0) > 0 and max(counts.values()) > 0, (counts, st.dense_why)


def main() -> None:
    ipc_delta.WORD_BATCH_BYTES = 40_000
    forced_words(land=False)
    forced_words(land=True)
    # under "auto" over a slow link (the pieces here are too small to pay over NVLink): words at 1%, dense at 100%,
    # then skipped (not even found) until the probe
    d, plan, cur = source("auto", 1 << 20, link_gbps=0.01)
    got = {n: t.clone() for n, t in cur.items()}
    r = receiver(d, plan, got, False)
    refit(d, plan, cur, got, 1, None, None, r)
    counts, st, _ = refit(d, plan, cur, got, 2, 1, 0.01, r)
    assert st.encodings["words"] == 4, counts
    counts, st, _ = refit(d, plan, cur, got, 3, 2, 1.0, r)
    assert set(counts.values()) == {DENSE} and st.diffed == 4
    counts, st, _ = refit(d, plan, cur, got, 4, 3, 0.01, r)
    assert set(counts.values()) == {DENSE} and st.diffed == 0  # the rule sent the last diff dense: skipped
    assert st.dense_why == {NOT_ADDRESSED: 1}
    # a source that keeps its base in host memory (``transport="auto"``): no base here, every message dense
    d, plan, cur = source("words", 1 << 20, base="host")
    got = {n: t.clone() for n, t in cur.items()}
    r = receiver(d, plan, got, False)
    refit(d, plan, cur, got, 1, None, None, r)
    counts, st, _ = refit(d, plan, cur, got, 2, 1, 0.01, r)
    assert d.base is None and set(counts.values()) == {DENSE} and st.dense_why == {HOST_BASE: 4, NOT_ADDRESSED: 1}
    print("ALL OK")


if __name__ == "__main__":
    main()
