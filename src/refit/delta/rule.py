"""The cost rule: when a delta pays, and which encoding a message takes. Pure arithmetic on measured rates.

A dense message costs its bytes over the link. A delta costs reading base and current once on the sender
(``2 x n x itemsize`` at the find rate), its wire bytes over the link (``refit.delta.wire``), the per-change
work (pack, base update, the receiver's scatter: ``k x (4 + 2 x itemsize)`` bytes at the apply rate) and a
fixed time per piece (the kernel launches of those steps); a delta also pays its share of its chunk's fixed
cost (header exchange, host syncs). The cheapest wins, dense on ties (``predicted_seconds``,
``choose_encoding``, ``choose_words``).

With the H100 rates measured (``LINKS``; find 0.78 TB/s: the find reads two versions, so it costs about what
NVLink takes to move one), a delta over NVLink does not beat dense and the rule sends dense there; over a
NIC (50 GB/s) a delta wins up to ~47% changed (sparse below ~4%, then the bitmask) at Llama-3.1-8B shapes.
On a same-device link (S2: the engine on the trainer's GPU) a dense copy (read n, write n) is never slower
than reading two versions: the rule returns dense there without looking at ``k``. Both sides read the same
rule, but only the sender decides; the message header carries its choice.

``prefer_words`` decides, from the plan alone, whether a message is found per 64-bit word or per element;
``best_case`` and ``may_pay`` whether a delta can ever beat dense on a link (``PAY_MARGIN``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from refit.delta.wire import ENCODINGS, INDEX_BYTES, wire_bytes
from refit.errors import ConfigError


@dataclass(frozen=True)
class LinkSpeed:
    """What the encoding rule weighs for one link, all measured: ``link_gbps`` (GB/s on the wire),
    ``find_gbps`` (GB/s of base + current the sender's find reads), ``apply_gbps`` (GB/s of index +
    value bytes of the per-change work: pack, base update, scatter), ``piece_s`` (fixed seconds per
    piece diffed) and ``same_device`` (the link is the device's own memory: dense always)."""

    link_gbps: float
    find_gbps: float
    apply_gbps: float
    piece_s: float = 0.0
    same_device: bool = False
    word_find_gbps: float | None = None
    word_piece_s: float | None = None
    chunk_s: float = 0.0

    def __post_init__(self) -> None:
        if self.word_find_gbps is None:
            object.__setattr__(self, "word_find_gbps", self.find_gbps)
        if self.word_piece_s is None:
            object.__setattr__(self, "word_piece_s", self.piece_s)
        for field in ("link_gbps", "find_gbps", "apply_gbps", "word_find_gbps"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ConfigError(f"LinkSpeed.{field} must be a finite number of GB/s > 0, got {value!r}")
        for field in ("piece_s", "word_piece_s", "chunk_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"LinkSpeed.{field} must be seconds in [0, 1), got {value!r}")


# CUDA rates measured on one H100 (docs/benchmarks.md, "Delta kernels on an H100": Llama-3.1-8B shapes,
# 16.06 GB bf16, 291 pieces): find 41 ms for 32 GB read at 1% changed (Triton); pack + base update +
# apply add ~31 ms at 0.1% (per piece: ~108 us) and ~15 ms more per 7.2e8 changes (~400 GB/s of
# index + value bytes).
_H100 = {"find_gbps": 780.0, "apply_gbps": 400.0, "piece_s": 108e-6}


# Word deltas (``refit.delta.words``), measured on 2x H200 (docs/benchmarks.md, "Word deltas by address"):
# the find read 2.3-2.65 TB/s; the rule takes 1.7 TB/s, that scaled to an H100's memory bandwidth (3.35 vs
# 4.8 TB/s; not measured on an H100). Per piece: 2 us (a piece is a row of the kernels' tables and of the host's
# numpy encoding; with 2 us `auto` sends the k/v projections as words, 0.37-0.41x dense at 1% on S1 against
# 0.41-0.54x with 10 us, docs/benchmarks.md "Finds behind one event"). Per chunk of a delta step (header exchange,
# the find's and the check's host syncs): 1.05 ms (S1 with 32 chunks vs 4: 54.9 vs 25.4 ms).
_WORDS = {"word_find_gbps": 1700.0, "word_piece_s": 2e-6, "chunk_s": 1.05e-3}


LINKS = {
    "same_device": LinkSpeed(1500.0, **_H100, same_device=True),  # S2: a copy on one H100 (read + write HBM)
    "nvlink": LinkSpeed(370.0, **_H100, **_WORDS),  # S1/S3: H100 NVLink, measured ~370 GB/s one way
    "nic": LinkSpeed(50.0, **_H100, **_WORDS),  # a 400 Gb/s NIC per GPU
    "cpu": LinkSpeed(2.0, 10.0, 10.0),  # gloo over loopback on a CPU host (rough; no per-piece time measured)
}
"""Speeds per kind of link (``TransferConfig.delta_link_gbps`` overrides the link's)."""


HOST = {"find_gbps": 10.0, "word_find_gbps": 10.0, "apply_gbps": 0.1, "piece_s": 70e-6, "word_piece_s": 70e-6}
"""The CPU path's rates, measured on one core of the 2-core CPU machine (process time, the least of 15 per step,
``.venv/bin/python -m bench.delta_host_rates``; six runs on 2026-11-30, two on 2026-12-01 on the code of today): the
find reads base and current at 8.6-10.6 GB/s with nothing changed (one numpy pass over 64-bit words); each changed
element costs ~73-76 ns to be told apart within its word (the two runs of 2026-12-01; 81-104 ns before the lanes were
compacted from a bool mask) and ~24-31 ns to encode, update the base and scatter (~100-105 ns in all): ``apply_gbps``
0.1 charges an element 80 ns and a word 200 ns. Each piece costs ~60-77 us of calls (find, encode, base update and
scatter of a 4 KiB piece, less its bytes and elements). A NIXL pull between CPU processes weighs these
(``nixl_link``); ``LINKS["cpu"]`` (P2P over gloo) still carries the rough figures its tests were written against:
with these, ``auto`` would send the small test models dense over a 2 GB/s loopback link, as the measurement says it
should."""


NIXL_PAIR_S = 1e-3
"""The fixed time a NIXL delta adds per source and receiver pair and refit: the held version and the sealed
delta record through the store and one more READ request (the delta's runs). Charged like ``chunk_s``, by each
message's part of the pair's bytes (``nixl_link``). Rough: a few store round trips on one host."""


def nixl_link(link: LinkSpeed, host: bool = False) -> LinkSpeed:
    """A NIXL pull's view of ``link``: the source finds (``find_gbps``), stages the changed words or elements
    and their indices into its registered staging and updates its base (the per-change work, ``apply_gbps``),
    the receiver reads them (``link_gbps``) and scatters them (``apply_gbps``); its fixed cost is
    ``NIXL_PAIR_S`` per pair (``chunk_s``), not a P2P chunk's. ``host``: both ends are CPU processes, whose
    find and per-change work run at the measured ``HOST`` rates."""
    return replace(link, chunk_s=NIXL_PAIR_S, **(HOST if host else {}))


IPC_PAIR_S = 2e-4
"""The fixed time a CUDA IPC delta adds per source and receiver pair and refit: the source's wait for its find's
counts and its header write, the receiver's header read and its read of the index check. Charged like ``chunk_s``,
by each message's part of the pair's bytes (``ipc_link``). Rough: a few small copies and host syncs, not measured."""


def ipc_link(link: LinkSpeed) -> LinkSpeed:
    """A CUDA IPC pull's view of ``link`` (``refit.transport.ipc_delta``): the source finds (``word_find_gbps``),
    packs the changed words into its staging (the per-change work, ``apply_gbps``), the receiver reads them over the
    link (``link_gbps``) and scatters them; its fixed cost is ``IPC_PAIR_S`` per pair (``chunk_s``). A same-device
    link stays one: dense."""
    return replace(link, chunk_s=IPC_PAIR_S)


def predicted_seconds(encoding: str, n: int, k: int, itemsize: int, link: LinkSpeed) -> float:
    """The rule's time for one message: see the module docstring."""
    wire = wire_bytes(encoding, n, k, itemsize) / (link.link_gbps * 1e9)
    if encoding == "dense":
        return wire
    if encoding == "words":  # k words of 8 bytes: index, word, base update and scatter
        find = 2 * n * itemsize / (link.word_find_gbps * 1e9)
        return find + wire + k * (INDEX_BYTES + 16) / (link.apply_gbps * 1e9) + link.word_piece_s
    find = 2 * n * itemsize / (link.find_gbps * 1e9)
    apply = k * (INDEX_BYTES + 2 * itemsize) / (link.apply_gbps * 1e9)
    return find + wire + apply + link.piece_s


def choose_encoding(pieces: list[tuple[int, int, int]], link: LinkSpeed, share: float = 0.0) -> str:
    """The cheapest encoding of one message whose pieces have ``(n, k, itemsize)`` (``k`` changes in ``n``
    elements) over ``link``: the sum of ``predicted_seconds`` over the pieces, dense on a same-device
    link and on ties; sparse never when a piece has 2**31 elements or more."""
    if link.same_device or not any(n for n, _, _ in pieces):
        return "dense"
    kinds = ["dense", "bitmask"] + (["sparse"] if all(n < 2**31 for n, _, _ in pieces) else [])
    return _cheapest(pieces, link, kinds, share)


def choose_words(pieces: list[tuple[int, int, int]], link: LinkSpeed, share: float = 0.0) -> str:
    """``"words"`` or ``"dense"`` for one message whose pieces have ``(n, k, itemsize)``, ``k`` changed 64-bit
    words in ``n`` elements (found by ``refit.delta.words``): the cheaper by ``predicted_seconds``,
    dense on a same-device link and on ties."""
    if link.same_device or not any(n for n, _, _ in pieces):
        return "dense"
    return _cheapest(pieces, link, ["dense", "words"], share)


def choose_words_many(
    n: np.ndarray, k: np.ndarray, itemsize: np.ndarray, first: np.ndarray, link: LinkSpeed, share: np.ndarray
) -> np.ndarray:
    """``choose_words`` of many messages over one ``link`` at once: their pieces as numpy arrays (``n``
    elements, ``k`` changed words, ``itemsize``), message ``j``'s pieces at ``first[j]:first[j + 1]`` (at least
    one each), ``share`` per message. True where ``"words"``: the same sums, in the same order."""
    first = np.asarray(first)
    if link.same_device:
        return np.zeros(len(first) - 1, dtype=bool)
    dense = _in_order(predicted_seconds("dense", n, k, itemsize, link), first)
    words = link.chunk_s * np.asarray(share) + _in_order(predicted_seconds("words", n, k, itemsize, link), first)
    return (np.add.reduceat(n, first[:-1]) > 0) & (words < dense)


def choose_encoding_many(n: np.ndarray, k: np.ndarray, itemsize: np.ndarray, link: LinkSpeed, share) -> np.ndarray:
    """``choose_encoding`` of many one-piece messages over one ``link`` at once (numpy int64 arrays: ``n``
    elements, each in ``(0, 2**31)``, ``k`` changes, ``itemsize``; ``share`` per message): each one's index in
    ``ENCODINGS``. The same sums in the same order; a tie goes to the earlier of ``ENCODINGS`` (dense first)."""
    if link.same_device:
        return np.zeros(len(n), dtype=np.int64)
    step = link.chunk_s * np.asarray(share, dtype=np.float64)
    cost = [predicted_seconds("dense", n, k, itemsize, link)]
    cost += [step + predicted_seconds(e, n, k, itemsize, link) for e in ("sparse", "bitmask")]
    return np.argmin(np.stack(cost), axis=0)  # rows in ``ENCODINGS``' order: the first least is the earliest


def _in_order(x: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Per message, its pieces' values (``x[first[j]:first[j + 1]]``) added one by one in order, as Python's
    ``sum`` adds them (``np.add.reduceat`` may add them in another order, and round differently)."""
    counts = np.diff(first)
    out = np.zeros(len(counts))
    for p in range(int(counts.max(initial=0))):
        has = counts > p
        out[has] += x[first[:-1][has] + p]
    return out


def _cheapest(pieces: list[tuple[int, int, int]], link: LinkSpeed, kinds: list[str], share: float = 0.0) -> str:
    """The kind of ``kinds`` with the least ``predicted_seconds`` summed over ``pieces``, earliest on ties; a
    delta also pays ``share`` (the message's part of its chunk's bytes) of the link's ``chunk_s``."""

    def cost(e: str) -> float:
        step = 0.0 if e == "dense" else link.chunk_s * share
        return step + sum(predicted_seconds(e, n, k, s, link) for n, k, s in pieces)

    return min(kinds, key=lambda e: (cost(e), ENCODINGS.index(e)))


PAY_MARGIN = 0.9
"""A delta is worth its machinery only where its best case (nothing changed) takes at most this share of
dense: the rates are measured to about 10%, and the rule leaves out the delta path's own per-step header
exchange (S1 on 2x H200, 289-291 of 291 messages sent dense through it: 1.10-1.30x the plain path,
docs/benchmarks.md)."""


TYPICAL_FRACTION = 0.01  # the changed fraction ``prefer_words`` weighs (RL steps on bf16: ~1%)


def words_changed(fraction: float, itemsize: int) -> float:
    """The share of 64-bit words that change where ``fraction`` of the elements (``itemsize`` bytes each)
    change independently: ``1 - (1 - fraction)**(8 // itemsize)``."""
    return 1 - (1 - fraction) ** max(1, 8 // itemsize)


def prefer_words(pieces: list[tuple[int, int]], link: LinkSpeed) -> bool:
    """Whether a message whose pieces have ``(n, itemsize)`` (all with whole 64-bit words) is better found per
    word than per element over ``link``, at ``TYPICAL_FRACTION`` of its elements changed (each word of ``E``
    elements then changes with probability ``1 - (1 - f)**E``): the words' predicted time against the best
    element encoding's. Words read faster and pay less per piece; elements send fewer bytes (FP8 over a NIC:
    5% of dense per element, 11.5% per word)."""
    f = TYPICAL_FRACTION
    words = [(n, round(words_changed(f, s) * n * s / 8), s) for n, s in pieces]
    elements = [(n, round(f * n), s) for n, s in pieces]
    kinds = ["bitmask"] + (["sparse"] if all(n < 2**31 for n, _ in pieces) else [])
    by_word = sum(predicted_seconds("words", n, k, s, link) for n, k, s in words)
    return by_word <= min(sum(predicted_seconds(e, n, k, s, link) for n, k, s in elements) for e in kinds)


def best_case(pieces: list[tuple[int, int]], link: LinkSpeed, words: bool = False) -> float:
    """The rule's time for a delta of a message whose pieces have ``(n, itemsize)`` when nothing changed: its
    cheapest encoding (``words``: found per 64-bit word, then that is its only one); ``inf`` on a
    same-device link or for an empty message."""
    if link.same_device or not any(n for n, _ in pieces):
        return math.inf
    if words:
        kinds = ["words"]
    else:
        kinds = ["bitmask"] + (["sparse"] if all(n < 2**31 for n, _ in pieces) else [])
    return min(sum(predicted_seconds(e, n, 0, s, link) for n, s in pieces) for e in kinds)


def may_pay(pieces: list[tuple[int, int]], link: LinkSpeed, words: bool = False, share: float = 0.0) -> bool:
    """Whether a delta of a message whose pieces have ``(n, itemsize)`` can pay over ``link``: with nothing
    changed (``best_case``), plus ``share`` (its part of its chunk's bytes) of ``link.chunk_s``, it takes at
    most ``PAY_MARGIN`` of dense (never on a same-device link)."""
    dense = sum(predicted_seconds("dense", n, 0, s, link) for n, s in pieces)
    return best_case(pieces, link, words) + link.chunk_s * share <= PAY_MARGIN * dense
