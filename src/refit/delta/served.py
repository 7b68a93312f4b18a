"""What a fan-out replica received, kept so that it can serve the same deltas to later waves without a base.

A replica that held v-1 and read the delta to v over NIXL holds, in its landing buffer, the payload it read
(indices and values, already checked and scattered) until its next refit. ``Received`` notes, per message box
(tensor, box), the version, the base version, the encoding, the counts and a view of that payload; as a source
in a later wave of the same version (``NixlDelta.serve_received``) the replica copies the payload of each
message with the same box into its staging and announces it with the same header: its receivers, on v-1 as
it was, apply it as they would the trainer's. No copy of the base is kept, no find runs on the replica.

A message whose box it received as several messages (its sources' layout cut it, the wave's plan does not) is
composed (``Received.compose``): the received deltas that tile the box, their indices moved into the box's
coordinates (words as their elements), one sparse delta of the live values there.

A message it cannot serve so goes dense and the reason is counted in ``DeltaStats.dense_why``: a box its
received messages do not tile (``"not received as one message"``), one it read dense (``"received dense"``), one
received in another version (``"not received in this version"``), or a payload over this refit's staging for
that receiver (``"over the staging budget"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit.delta.wire import WORD, decode, encode, wire_bytes
from refit.layout import box_intersect, box_numel, box_shape

NOT_RECEIVED = "not received as one message"
RECEIVED_DENSE = "received dense"
OTHER_VERSION = "not received in this version"
OVER_STAGING = "over the staging budget"


@dataclass(frozen=True)
class Got:
    """One message this process received: ``payload`` None where it was read dense."""

    version: int
    base: int | None
    kind: str
    counts: tuple[int, ...]
    payload: torch.Tensor | None


def box_key(tensor: str, box) -> tuple:
    """A message's key: its tensor and its box (global coordinates) as nested tuples."""
    return tensor, tuple(tuple(int(x) for x in b) for b in box)


class Received:
    """One process's messages received over NIXL in its last refit, by ``box_key`` (the same object is given to
    every wave's ``NixlDelta`` of a fan-out replica process: its receiving wave notes, its later waves serve)."""

    def __init__(self) -> None:
        self.got: dict[tuple, Got] = {}
        self.boxes: dict[str, set[tuple]] = {}  # tensor -> the boxes noted of it

    def note(self, key: tuple, got: Got) -> None:
        self.got[key] = got
        self.boxes.setdefault(key[0], set()).add(key[1])

    def delta(self, key: tuple, version: int) -> tuple[Got | None, str]:
        """The delta received for ``key`` in ``version`` and ``""``, or None and why it cannot be served."""
        got = self.got.get(key)
        if got is None:
            return None, NOT_RECEIVED
        if got.version != version:
            return None, OTHER_VERSION
        if got.payload is None or got.kind == "dense" or got.base is None:
            return None, RECEIVED_DENSE
        return got, ""

    def compose(self, key: tuple, version: int, view: torch.Tensor, most: int) -> tuple[Got | None, str]:
        """A sparse delta of ``version`` for the box of ``key`` from the deltas received for the boxes that tile
        it (``view``: this process's live view of the box, holding ``version``), or None and why not: a box that
        another received box crosses, or that they do not cover, one read dense or in another version, a delta
        over ``most`` bytes (known before anything is built)."""
        tensor, box = key
        parts = [b for b in self.boxes.get(tensor, ()) if box_intersect(b, box) is not None]
        if not parts or any(box_intersect(b, box) != b for b in parts) or sum(map(box_numel, parts)) != box_numel(box):
            return None, NOT_RECEIVED
        got = [self.delta((tensor, b), version) for b in parts]
        why = next((w for g, w in got if g is None), "")
        if why or len({g.base for g, _ in got}) != 1 or box_numel(box) >= 2**31:
            return None, why or NOT_RECEIVED
        per = WORD // view.element_size()
        k = sum(g.counts[0] * (per if g.kind == "words" else 1) for g, _ in got)  # each changed element once
        if wire_bytes("sparse", view.numel(), k, view.element_size()) > most:
            return None, OVER_STAGING
        idx = torch.cat([_in_box(b, g, box, view.dtype) for b, (g, _) in zip(parts, got)]).sort().values
        values = view[torch.unravel_index(idx, view.shape)]
        n = view.numel()
        payload = torch.empty(wire_bytes("sparse", n, k, view.element_size()), dtype=torch.uint8, device=view.device)
        encode("sparse", n, idx.to(torch.int32), values, payload)
        return Got(version, got[0][0].base, "sparse", (k,), payload), ""


def _in_box(part: tuple, got: Got, box: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The elements a delta received for box ``part`` changed, as flat indices of the enclosing ``box``."""
    n, k = box_numel(part), got.counts[0]
    idx, _ = decode(got.kind, n, k, got.payload, dtype)
    idx, dev = idx.long(), idx.device
    if got.kind == "words":  # a word: its elements in row-major order
        per = WORD // torch.empty(0, dtype=dtype).element_size()
        idx = (idx[:, None] * per + torch.arange(per, device=dev)).reshape(-1)
    coords = torch.stack(torch.unravel_index(idx, box_shape(part)), dim=1)
    coords += torch.tensor([a - b for (a, _), (b, _) in zip(part, box)], device=dev)
    strides = torch.tensor(torch.empty(box_shape(box), device="meta").stride(), device=dev)
    return (coords * strides).sum(1)
