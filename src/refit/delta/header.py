"""What travels beside a delta's payloads: the header of each message (``[kind, base version, version, k per
piece]``, checked field by field by ``check_header``), the trailer that announces quiet refits (``announced``)
and the version each receiver holds, exchanged through the store before a run (``exchange_held``). Every value
read from a peer is checked before it sizes or addresses anything.
"""

from __future__ import annotations

from refit.delta.wire import ENCODINGS, DeltaError
from refit.transport.p2p import _Op
from refit.transport.store import SignedStore

HEADER_TAG = (1 << 20) + (1 << 19)  # a header: its message tag plus this (inside a fan-out tag window of 1 << 21)
QUIET_MAX = 1 << 20  # the most quiet refits one header announces (a pair where no delta can ever pay)


def check_header(
    header: list[int],
    sizes: list[int],
    version: int,
    held: int | None,
    op: _Op,
    me: str = "this receiver",
    words: list[int | None] | None = None,
) -> tuple[str, list[int]]:
    """A received header, field by field: the encoding, the version being sent, a delta's base version
    equal to the version this receiver holds, and ``0 <= k <= n`` per piece (``n``: its elements, or for
    words its 64-bit ``words``, None where it has none). Returns ``(encoding, counts)``; ``DeltaError``
    names both versions and the peer otherwise."""
    who = f"process {op.peer} ({op.what()})"
    if len(header) != 3 + len(sizes) or not 0 <= header[0] < len(ENCODINGS):
        raise DeltaError(f"malformed delta header from {who}: {header[:3]}")
    kind, base, sent, counts = ENCODINGS[header[0]], header[1], header[2], header[3:]
    if sent != version:
        raise DeltaError(f"the message from {who} is of version {sent}, this refit is version {version}")
    if kind != "dense" and base != held:
        mine = "no version" if held is None else f"version {held}"
        raise DeltaError(
            f"{me} refuses a delta of version {version} from {who}: it was computed on base version {base}, "
            f"{me} holds {mine} (a dense refit heals it)"
        )
    if kind == "words":
        sizes = [-1 if w is None else w for w in (words or [None] * len(sizes))]
    for k, n in zip(counts, sizes):
        if not 0 <= k <= n:
            raise DeltaError(f"delta header from {who} claims {k} changes in a piece of {n} elements")
    return kind, counts


def announced(value: int, op: _Op) -> int:
    """A header trailer (the quiet refits a sender announces), checked: ``DeltaError`` unless in range."""
    if not 0 <= value <= QUIET_MAX:
        raise DeltaError(f"malformed delta header from process {op.peer}: {value} quiet refits announced")
    return value


def exchange_held(
    store: SignedStore,
    key: str,
    proc: int,
    held: int | None,
    publish: bool,
    peers: list[int],
    timeout_s: float,
    quiet: list[int] = (),
) -> tuple[dict[int, int | None], dict[int, bool]]:
    """Before a delta run: a receiving process publishes ``{"held": version, "quiet": [senders]}`` under
    ``{key}/{proc}`` (signed; ``quiet``: the senders whose refit it expects without headers,
    ``DeltaSchedule.quiet_senders``), a sending one reads its receivers' (``timeout_s`` each); returns
    ``({proc: version}`` with this process's own, ``{receiver: whether it expects this sender quiet})``. A
    record that is not ``{"held": int >= 0 or null, "quiet": [int >= 0, ...]}`` raises ``DeltaError``."""
    if publish:
        store.put(f"{key}/{proc}", {"held": held, "quiet": list(quiet)})
    out, told = {proc: held}, {}
    for p in peers:
        rec = store.get(f"{key}/{p}", timeout_s)
        ok = isinstance(rec, dict) and set(rec) == {"held", "quiet"}
        v, q = (rec["held"], rec["quiet"]) if ok else (-1, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            ok = False
        if not isinstance(q, list) or len(q) > 1 << 16 or not all(_proc_id(x) for x in q):
            ok = False
        if not ok:
            raise DeltaError(
                f"process {p} published {rec!r} as the version it holds, not "
                "{'held': version or null, 'quiet': [process, ...]}"
            )
        out[p], told[p] = v, proc in q
    return out, told


def _proc_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31
