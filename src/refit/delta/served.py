"""What a fan-out replica received, kept so that it can serve the same deltas to later waves without a base.

A replica that held v-1 and read the delta to v over NIXL holds, in its landing buffer, the payload it read
(indices and values, already checked and scattered) until its next refit. ``Received`` notes, per message box
(tensor, box), the version, the base version, the encoding, the counts and a view of that payload; as a source
in a later wave of the same version (``NixlDelta.serve_received``) the replica copies the payload of each
message with the same box into its staging and announces it with the same header: its receivers, on v-1 as
it was, apply it as they would the trainer's. No copy of the base is kept, no find runs on the replica.

A message it cannot serve so goes dense and the reason is counted in ``DeltaStats.dense_why``: a box it did not
receive as one message (``"not received as one message"``), one it read dense (``"received dense"``), one
received in another version (``"not received in this version"``), or a payload over this refit's staging for
that receiver (``"over the staging budget"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def note(self, key: tuple, got: Got) -> None:
        self.got[key] = got

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
