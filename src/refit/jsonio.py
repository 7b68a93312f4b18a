"""JSON files read with bounds: a size cap before reading and a nesting-depth cap before parsing.

Python's ``json`` recurses once per nesting level, so a file of 100,000 ``[`` ends in ``RecursionError``
(a traceback, not a user error); an unbounded read of a huge file or a device (``/dev/zero``) takes all
memory. ``read_json(path, what, error)`` refuses both in one line naming the file and the limit, with
the caller's error type (``ModelError`` for ``--model``, ``TopologyError`` for ``--cluster``, ...).
Every JSON file refit reads from a user (model configs, topologies, layout documents) goes through it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from typing import Any

MAX_JSON_BYTES = 64 << 20
"""The largest JSON file read (64 MiB): a model config is a few KiB, a layout document a few MiB."""

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects accepted: refit's documents nest fewer than 10 levels."""

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings do not count);
    linear, no recursion, so it is safe on any input."""
    steps = (1 if b in "[{" else -1 for b in _BRACKETS.findall(_STRINGS.sub("", text)))
    return max(accumulate(steps, initial=0))


def loads_bounded(text: str, what: str, error: type[Exception], max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` once its depth is within ``max_depth``; ``error`` names ``what`` otherwise,
    and for text that is not JSON."""
    depth = json_depth(text)
    if depth > max_depth:
        raise error(f"cannot read {what}: it nests {depth} levels of arrays/objects; at most {max_depth} are read")
    try:
        return json.loads(text)
    except ValueError as e:
        raise error(f"cannot read {what}: not valid JSON: {e}") from None


def read_json(path: str | os.PathLike, what: str, error: type[Exception], max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in the regular file ``path``, at most ``max_bytes`` and ``MAX_JSON_DEPTH`` deep;
    ``error("<what> <path>: ...")`` for a file that is missing, not a regular file (a FIFO, a device),
    too large, not UTF-8 or not JSON."""
    name = f"{what} {str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise error(f"cannot read {name}: not a regular file")
        if st.st_size > max_bytes:
            raise error(f"cannot read {name}: it has {st.st_size:,} bytes; at most {max_bytes:,} are read")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"cannot read {name}: it has over {max_bytes:,} bytes; at most {max_bytes:,} are read")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"cannot read {name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return loads_bounded(text, name, error)
