"""Run by tests/test_delta.py with TRITON_INTERPRET=1: refits with ``delta="words"`` over CPU gloo where the
word kernels run in Triton's interpreter, so every message takes the by-address path (one find, pack, check
and scatter launch per batch) end to end: exact after every version, each sender's base equal to its weights
after every refit (updated from its packed payloads, ``SourceBase.defer_packed``: mid-run where they pass the
32 KiB staging budget, else at the end), a replica that lost its version healed, fan-out's shared messages
deferred to commit, a version that changes nearly every value (words over the find's slots, found again)
followed by one that diffs against it, and an attacker's word index past its piece refused (nothing of its
chunk's words stored, the message named). Prints ALL OK."""

from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, str(Path(__file__).parent))

from test_delta import VERSIONS, _run  # noqa: E402


def main() -> None:
    for dst_spec in ("tp=2",):  # tp=1,dp=2 with words: test_delta's compiled-path case
        out = _run("heal", dst_spec=dst_spec, delta="words", timeout=240)
        senders, receivers = out[:2], out[2:]
        assert receivers == [[True] * VERSIONS] * 2, (dst_spec, receivers)
        for per_version in senders:
            for v in (1, 4, 5):
                wire, dense, enc = per_version[v]
                assert enc["words"] == sum(enc.values()) and wire < 0.5 * dense, (dst_spec, v + 1, per_version[v])
    out = _run("burst", delta="words", timeout=240)
    senders, receivers = out[:2], out[2:]
    assert receivers == [[True] * VERSIONS] * 2, receivers  # version 6 diffs against the bytes of version 5
    for per_version in senders:
        wire, dense, enc = per_version[4]  # version 5: over the slots, found again and sent as words all the same
        assert enc["words"] == sum(enc.values()) and wire > dense, per_version[4]
        wire, dense, enc = per_version[5]
        assert enc["words"] == sum(enc.values()) and wire < 0.5 * dense, per_version[5]
    # an attacker's word index past its piece (version 3): refused on every receiver (a sender may have finished
    # first), the message named, none of the bad chunk's words stored (elements still at version 2 where 3
    # differs), no element at another version
    out = _run("corrupt", delta="words", timeout=240)
    senders, receivers = out[:2], out[2:]
    for got in receivers:
        assert got[:2] == [True, True] and got[2][0] == "refused", got
        assert "a word index is outside its piece" in got[2][1] and "delta from process" in got[2][1], got
        assert got[2][3] == 0, got  # every element at version 2 or 3
    assert any(got[2][2] >= 1 for got in receivers), receivers  # the bad chunk's words not stored
    assert all(len(sent) == 3 for sent in senders), senders  # a sender refused, or done before the abort
    print("ALL OK")


if __name__ == "__main__":
    main()
