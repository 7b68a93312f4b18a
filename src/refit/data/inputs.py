"""What the data plane accepts from its callers, checked before anything is stored or planned.

Keys are strings, given as a sequence of them (a list, a tuple, a ``BatchMeta``'s keys): a bare string
would otherwise be read as its characters, and ``1``, ``"1"`` and ``None`` would alias once turned into
text, so anything else is refused naming its position and type (one key type per store: ``str``).
Partitions and field names are non-empty strings; sequence lengths are non-negative integers (``2.7``
is refused, not truncated); a tensor must be a dense (strided) tensor: sparse and other layouts are
refused naming the field. Errors are ``TypeError`` for a wrong type and ``ValueError`` for a wrong
value, each naming the operation, the argument and the value.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

FieldData = torch.Tensor | Sequence[torch.Tensor]


def _kind(value: Any) -> str:
    return type(value).__name__


def check_keys(keys: Any, op: str) -> list[str]:
    """``keys`` as a list of str; ``TypeError`` for a bare string or bytes, a non-sequence (a set has
    no order) or a key that is not a str, naming ``op``, the position and the type."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise TypeError(f"{op}: keys must be a sequence of str (a list of keys or a BatchMeta), not one {_kind(keys)}")
    if not isinstance(keys, Sequence):
        raise TypeError(f"{op}: keys must be a sequence of str (a list or tuple), got a {_kind(keys)}")
    out = list(keys)
    bad = next((i for i, k in enumerate(out) if not isinstance(k, str)), None)
    if bad is not None:
        raise TypeError(
            f"{op}: keys[{bad}] is a {_kind(out[bad])} ({out[bad]!r:.40}), not a str: keys are strings "
            "(1, '1' and None would otherwise alias)"
        )
    return out


def check_name(value: Any, what: str, op: str) -> str:
    """``value`` if it is a non-empty str (a partition or a field name); ``TypeError`` / ``ValueError``."""
    if not isinstance(value, str):
        raise TypeError(f"{op}: {what} must be a str, got a {_kind(value)} ({value!r:.40})")
    if not value:
        raise ValueError(f"{op}: {what} must not be empty")
    return value


def check_names(values: Any, what: str, op: str) -> list[str]:
    """Every item of ``values`` (field names to select) a non-empty str."""
    return [check_name(v, what, op) for v in values]


def check_lengths(values: Any, what: str, op: str) -> list[int]:
    """``values`` (a sequence or a 1-D integer tensor) as non-negative Python ints; a float (``2.7``,
    even ``3.0``), a bool or a negative value is refused naming the sample, never truncated."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{op}: {what} must hold integers, got a tensor of {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{op}: {what} must be 1-D, got shape {list(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{op}: {what} must be a sequence of int, got a {_kind(values)}")
    out = []
    for i, n in enumerate(values):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{op}: {what}[{i}] is a {_kind(n)} ({n!r:.40}), not an int")
        if n < 0:
            raise ValueError(f"{op}: {what}[{i}] is {n}; lengths are >= 0")
        out.append(int(n))
    return out


def check_tensor(t: torch.Tensor, field: str, op: str) -> None:
    """``ValueError`` naming ``field`` unless ``t`` is a dense (strided) tensor with storage (not sparse,
    not a meta or nested tensor): the store keeps a row's raw bytes."""
    if t.layout != torch.strided or t.is_nested:
        raise ValueError(f"{op}: field {field!r} is a {t.layout} tensor; only dense (strided) tensors are stored")
    if t.device.type == "meta":
        raise ValueError(f"{op}: field {field!r} is a meta tensor (no data); put tensors holding their values")


def check_fields(fields: Any, op: str) -> Mapping[str, Any]:
    """``fields`` a mapping whose names are non-empty str (the tensors are checked by ``normalize_put``)."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"{op}: fields must be a dict of field name -> tensor, got a {_kind(fields)}")
    for name in fields:
        check_name(name, "a field name", op)
    return fields


def normalize_put(
    keys: Sequence[str],
    fields: dict[str, FieldData],
    tags: Any,
    seq_lens: Sequence[int] | None,
    partition: str = "default",
) -> tuple[list[str], dict[str, FieldData], list[dict], list[int] | None]:
    """Check a put before anything is written (``refit.data.inputs``: str keys, partition and field
    names, dense tensors, non-negative integer lengths); errors name the field and the numbers."""
    keys = check_keys(keys, "put")
    check_name(partition, "partition", "put")
    check_fields(fields, "put")
    if not keys:
        raise ValueError("put: no keys")
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})[:3]
        raise ValueError(f"put: duplicate keys {dup}")
    if not fields:
        raise ValueError("put: no fields")
    for name, data in fields.items():
        if isinstance(data, torch.Tensor):
            check_tensor(data, name, "put")
            if data.dim() == 0 or data.shape[0] != len(keys):
                raise ValueError(
                    f"put: field {name!r} has shape {list(data.shape)}; its first dimension must be "
                    f"the number of keys ({len(keys)})"
                )
        else:
            if not isinstance(data, Sequence) or isinstance(data, (str, bytes)):
                raise TypeError(f"put: field {name!r} is a {type(data).__name__}: give a tensor or a list of tensors")
            rows = list(data)
            if len(rows) != len(keys):
                raise ValueError(f"put: field {name!r} has {len(rows)} rows for {len(keys)} keys")
            bad = [i for i, r in enumerate(rows) if not isinstance(r, torch.Tensor)]
            if bad:
                raise TypeError(f"put: field {name!r} row {bad[0]} is {type(rows[bad[0]]).__name__}, not a tensor")
            for r in rows:
                check_tensor(r, name, "put")
    if tags is None:
        tag_list: list[dict] = [{} for _ in keys]
    elif isinstance(tags, dict):
        tag_list = [dict(tags) for _ in keys]
    else:
        tag_list = [dict(t) for t in tags]
        if len(tag_list) != len(keys):
            raise ValueError(f"put: {len(tag_list)} tags for {len(keys)} keys")
    lens = None
    if seq_lens is not None:
        lens = check_lengths(seq_lens, "seq_lens", "put")
        if len(lens) != len(keys):
            raise ValueError(f"put: {len(lens)} seq_lens for {len(keys)} keys")
    return keys, fields, tag_list, lens
