"""The record a NIXL source publishes for each of its receivers, and the receiver's field-by-field check.

A source publishes, per receiver, a record (``record_for``) sealed with the job secret
(``SignedStore.put_sealed``: AES-GCM, useless without the secret): its agent name and metadata
(base64), its registered regions (``[address, bytes, device, memory type]``), the address and strides
of every tensor part that receiver reads (``parts``, by ``plan.schedule.part_key``), the address of
every staged piece it reads (``staged``, by message index) and its staging rounds (``rounds``: count,
slots, the round of each staged piece). Plain JSON, never pickled (NIXL's ``get_serialized_descs`` is
not used).

A receiver checks every field of it (``check_record``: known keys, types, ranges; at most
``MAX_RECORD_ENTRIES`` regions and ``MAX_METADATA_BYTES`` of metadata) before ``add_remote_agent``, and
that every piece lies inside a region its source registered (``inside``, per piece, in the link's
``nixl_requests.piece_runs``). A bad record is a ``PlanError`` naming its source and the field. ``is_int`` is the
integer check the link's checksum records use too.

Uses ``refit.transport.nixl_memory`` (the staging buffer, a tensor's memory type); no NIXL.
"""

from __future__ import annotations

import base64

from refit.binding import LocalTensors
from refit.errors import PlanError
from refit.plan import Plan
from refit.plan.schedule import part_key
from refit.transport.nixl_memory import SourceStaging, memory_of

MEM_TYPES = ("DRAM", "VRAM")
MAX_RECORD_ENTRIES = 1 << 16  # regions or tensor parts in one record
MAX_METADATA_BYTES = 1 << 20
_ADDR_LIMIT = 1 << 63
_RECORD_KEYS = {"agent", "metadata", "regions", "parts", "staged", "rounds"}


def record_for(
    plan: Plan, local: LocalTensors, agent, name: str, regions: list, receiver: int, staging: SourceStaging
) -> dict:
    """What receiver process ``receiver`` needs to read this source's pieces (see the module docstring)."""
    parts, staged, of = {}, {}, {}
    for k, m in enumerate(plan.messages):
        if m.transport == "nixl" and plan.procs.dst[m.dst] == receiver and m.src == local.src_rank:
            for p in m.pieces:
                i, (_, t) = local.src_part(p.tensor, p.box)
                mem, dev = memory_of(t)
                parts[part_key(p.tensor, i)] = [t.data_ptr(), list(t.stride()), dev, mem]
            if k in staging.offsets:
                staged[str(k)], of[str(k)] = staging.address(k), staging.round_of[k]
    md = base64.b64encode(agent.get_agent_metadata()).decode()
    rounds = {"count": len(staging.rounds), "slots": staging.slots, "of": of}
    return {"agent": name, "metadata": md, "regions": regions, "parts": parts, "staged": staged, "rounds": rounds}


def is_int(x: object, lo: int = 0, hi: int = _ADDR_LIMIT) -> bool:
    """Whether ``x`` is an int (not a bool) in ``[lo, hi)``."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x < hi


def _check_regions(regions: object, who: str) -> list[list]:
    if not isinstance(regions, list) or not 0 < len(regions) <= MAX_RECORD_ENTRIES:
        raise PlanError(f"NIXL record of {who}: regions must be a list of 1..{MAX_RECORD_ENTRIES} entries")
    for r in regions:
        ok = isinstance(r, list) and len(r) == 4 and is_int(r[0]) and is_int(r[1], 1) and is_int(r[2], 0, 1 << 16)
        if not ok or r[3] not in MEM_TYPES or r[0] + r[1] > _ADDR_LIMIT:
            raise PlanError(f"NIXL record of {who}: region {str(r)[:80]} is not [address, bytes, device, memory]")
    return regions


def _check_parts(parts: object, who: str, ndims: dict[str, int]) -> dict[str, list]:
    """Exactly the parts this receiver reads, each ``[address, strides, device, memory type]``."""
    if not isinstance(parts, dict) or set(parts) != set(ndims):
        got = sorted(parts)[:5] if isinstance(parts, dict) else type(parts).__name__
        raise PlanError(f"NIXL record of {who}: parts {got} are not the {len(ndims)} tensor parts read from it")
    for key, p in parts.items():
        ok = isinstance(p, list) and len(p) == 4 and is_int(p[0]) and isinstance(p[1], list)
        ok = ok and len(p[1]) == ndims[key] and all(is_int(s, 0, 1 << 48) for s in p[1])
        if not ok or not is_int(p[2], 0, 1 << 16) or p[3] not in MEM_TYPES:
            raise PlanError(f"NIXL record of {who}: part {key!r} is {str(p)[:80]}, not [address, strides, dev, mem]")
    return parts


def _check_staged(staged: object, who: str, messages: set[int]) -> dict[int, int]:
    """Staged pieces: message index (one this receiver reads from ``who``) -> address."""
    if not isinstance(staged, dict) or not all(isinstance(k, str) and k.isascii() and k.isdigit() for k in staged):
        raise PlanError(f"NIXL record of {who}: staged must map message indices to addresses")
    out = {int(k): v for k, v in staged.items()}
    if not set(out) <= messages or not all(is_int(v) for v in out.values()):
        bad = sorted(set(out) - messages)[:5]
        raise PlanError(f"NIXL record of {who}: staged names messages {bad} not read from it, or a bad address")
    return out


def _check_rounds(rounds: object, who: str, staged: dict[int, int]) -> dict:
    """The source's staging rounds: ``{"count": rounds, "slots": slots, "of": {message: round}}`` with a
    round for exactly the staged messages."""
    ok = isinstance(rounds, dict) and set(rounds) == {"count", "slots", "of"} and isinstance(rounds["of"], dict)
    ok = ok and is_int(rounds["count"], 0, MAX_RECORD_ENTRIES + 1) and is_int(rounds["slots"], 1, 1 << 16)
    of = {int(k): v for k, v in rounds["of"].items() if k.isascii() and k.isdigit()} if ok else {}
    if not ok or set(of) != set(staged) or len(of) != len(rounds["of"]):
        raise PlanError(f"NIXL record of {who}: rounds must be {{count, slots, of}} with a round per staged message")
    if not all(is_int(r, 0, rounds["count"]) for r in of.values()):
        raise PlanError(f"NIXL record of {who}: a staged message's round is outside 0..{rounds['count'] - 1}")
    return {"count": rounds["count"], "slots": rounds["slots"], "of": of}


def check_record(rec: object, who: str, ndims: dict[str, int], messages: set[int] = frozenset()) -> dict:
    """A source's record if every field is well formed (known keys; an agent name; base64 metadata of at
    most ``MAX_METADATA_BYTES``; regions; the parts ``ndims`` names, each with one stride per dimension;
    staged pieces among ``messages``, the indices of the messages read from it, each in a staging round),
    else ``PlanError``
    naming ``who`` and the field. Whether each piece lies in a region: ``inside`` (per piece, in
    ``refit.transport.nixl_requests.piece_runs``)."""
    if not isinstance(rec, dict) or set(rec) != _RECORD_KEYS:
        keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise PlanError(f"NIXL record of {who} has keys {keys}, expected {sorted(_RECORD_KEYS)}")
    name = rec["agent"]
    if not isinstance(name, str) or not 0 < len(name) <= 200 or not name.isprintable():
        raise PlanError(f"NIXL record of {who}: agent name {str(name)[:80]!r} is not a short printable string")
    try:
        md = base64.b64decode(rec["metadata"], validate=True) if isinstance(rec["metadata"], str) else b""
    except ValueError:
        md = b""
    if not 0 < len(md) <= MAX_METADATA_BYTES:
        raise PlanError(f"NIXL record of {who}: metadata is not base64 of 1..{MAX_METADATA_BYTES} bytes")
    staged = _check_staged(rec["staged"], who, set(messages))
    return {
        "agent": name,
        "metadata": md,
        "regions": _check_regions(rec["regions"], who),
        "parts": _check_parts(rec["parts"], who, ndims),
        "staged": staged,
        "rounds": _check_rounds(rec["rounds"], who, staged),
    }


def inside(regions: list[list], mem: str, dev: int, lo: int, hi: int) -> bool:
    """Whether bytes ``[lo, hi)`` of ``mem``:``dev`` lie inside one of ``regions``."""
    return any(r[3] == mem and r[2] == dev and r[0] <= lo and hi <= r[0] + r[1] for r in regions)
