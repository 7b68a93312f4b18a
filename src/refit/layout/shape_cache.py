"""A model's parameter shapes kept on disk, so a fresh process need not import transformers to learn them.

``param_shapes`` derives shapes by building the model on the meta device, which costs a fresh process about
5 s of transformers' import: every rank of a job, every ``refit plan``. The shapes depend only on the model's
config, the dtype asked for, the transformers version and refit's own rules (``models.py``, ``hf_names.py``), so
the key is a digest of exactly those; a file that does not parse as shapes is ignored and written anew.

Where: ``$REFIT_CACHE_DIR/shapes`` (default ``$XDG_CACHE_HOME/refit`` or ``~/.cache/refit``); set
``REFIT_CACHE_DIR`` to an empty string to keep nothing on disk. A cache that cannot be written is skipped: it
never changes what ``param_shapes`` returns, only how long it takes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

import torch

from refit.errors import LayoutError
from refit.layout.rules import ParamShape
from refit.layout.tensors import dtype_from_name, dtype_name

CACHE_ENV = "REFIT_CACHE_DIR"
MAX_FILE = 64 << 20  # bytes: a model with a million tensors fits; a bigger file is not read
_RULES = ("models.py", "hf_names.py")  # the sources shapes are derived by


def cache_dir() -> Path | None:
    """The shapes' folder, or None where ``REFIT_CACHE_DIR`` is set empty."""
    root = os.environ.get(CACHE_ENV)
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "refit")
    return Path(root) / "shapes" if root else None


def shapes_key(config_text: str, dtype: torch.dtype | None) -> str:
    """The digest of what shapes depend on: the config (as text), the dtype asked for, transformers' version
    and refit's rules."""
    h = hashlib.sha256()
    for part in (config_text, str(dtype), _version("transformers"), _rules_digest()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


@functools.cache
def _rules_digest() -> str:
    """The digest of the rules' sources, read once a process."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _RULES)).hexdigest()


def read(key: str) -> list[ParamShape] | None:
    """The shapes stored under ``key``; None if there are none or the file is not shapes."""
    folder = cache_dir()
    path = folder / f"{key}.json" if folder else None
    try:
        if path is None or path.stat().st_size > MAX_FILE:
            return None
        return [_entry(e) for e in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError, LayoutError):
        return None


def write(key: str, shapes: list[ParamShape]) -> None:
    """Store ``shapes`` under ``key`` (atomically: a reader sees the whole file or none)."""
    folder = cache_dir()
    if folder is None:
        return
    text = json.dumps([[n, list(s), dtype_name(d)] for n, s, d in shapes])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        return  # read-only home, full disk: the shapes are computed again next time


def _entry(e: object) -> ParamShape:
    if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], list)):
        raise ValueError(f"not a shape entry: {e!r}")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e[1]):
        raise ValueError(f"not a shape: {e[1]!r}")
    return e[0], tuple(e[1]), dtype_from_name(e[2])


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"
