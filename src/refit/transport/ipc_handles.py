"""CUDA IPC handles: a source process exports one per tensor a receiver pulls, through the signed store; the
receiver checks every field before it maps one (``check_handle_fields``: known keys, types, ranges, the view
inside its storage) and rebuilds it with torch's own function. Plain data only: nothing from the store is
unpickled.
"""

from __future__ import annotations

import base64
import json

import torch

from refit.binding import LocalTensors
from refit.errors import PlanError
from refit.plan import Plan
from refit.plan.schedule import part_key
from refit.transport.store import SignedStore

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


_HANDLE_FIELDS = {
    "size": list, "stride": list, "offset": int, "dtype": str, "device": int, "handle": str,
    "storage_bytes": int, "storage_offset": int, "ref_handle": str, "ref_offset": int,
    "event_handle": (str, type(None)), "event_sync": bool,
}  # fmt: skip


_MAX_HANDLE_BYTES = 1024


def handle_fields(t: torch.Tensor) -> dict:
    """Plain data for another process to map CUDA tensor ``t`` (torch's own IPC export, field by field)."""
    (device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle, event_sync) = (
        t.untyped_storage()._share_cuda_()
    )
    from torch.multiprocessing.reductions import StorageWeakRef, shared_cache

    shared_cache[handle] = StorageWeakRef(t.untyped_storage())  # as torch's reduce_tensor: keep it exported
    b64 = lambda b: None if b is None else base64.b64encode(b).decode()  # noqa: E731
    return {
        "size": list(t.shape), "stride": list(t.stride()), "offset": t.storage_offset(),
        "dtype": str(t.dtype).removeprefix("torch."), "device": int(device), "handle": b64(handle),
        "storage_bytes": int(storage_bytes), "storage_offset": int(storage_offset), "ref_handle": b64(ref_handle),
        "ref_offset": int(ref_offset), "event_handle": b64(event_handle), "event_sync": bool(event_sync),
    }  # fmt: skip


def _bytes_field(name: str, value: str) -> bytes:
    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, TypeError):
        raise PlanError(f"CUDA IPC handle field {name!r} is not base64") from None
    if not 0 < len(raw) <= _MAX_HANDLE_BYTES:
        raise PlanError(f"CUDA IPC handle field {name!r} has {len(raw)} bytes (1..{_MAX_HANDLE_BYTES} allowed)")
    return raw


def check_handle_fields(f: object) -> dict:
    """``f`` if it is a well-formed ``handle_fields`` record (known keys, types, ranges, the view inside
    its storage), else ``PlanError`` naming the field."""
    if not isinstance(f, dict) or set(f) != set(_HANDLE_FIELDS):
        keys = sorted(f) if isinstance(f, dict) else type(f).__name__
        raise PlanError(f"CUDA IPC handle record has keys {keys}, expected {sorted(_HANDLE_FIELDS)}")
    for k, typ in _HANDLE_FIELDS.items():
        if not isinstance(f[k], typ) or (typ is int and isinstance(f[k], bool)):
            raise PlanError(f"CUDA IPC handle field {k!r} has type {type(f[k]).__name__}")
    dims = f["size"] + f["stride"]
    if len(f["size"]) != len(f["stride"]) or len(f["size"]) > 8 or not all(_nonneg_int(x) for x in dims):
        raise PlanError(f"CUDA IPC handle has size {f['size']} and stride {f['stride']}")
    if f["dtype"] not in _DTYPES:
        raise PlanError(f"CUDA IPC handle dtype {f['dtype']!r} is not one of {sorted(_DTYPES)}")
    if min(f["offset"], f["storage_bytes"], f["storage_offset"], f["ref_offset"], f["device"]) < 0:
        raise PlanError("CUDA IPC handle has a negative offset, size or device")
    item = _DTYPES[f["dtype"]].itemsize
    last = f["offset"] + sum((n - 1) * st for n, st in zip(f["size"], f["stride"])) + 1
    if all(f["size"]) and last * item > f["storage_bytes"]:
        raise PlanError(f"CUDA IPC handle view ends at byte {last * item}, past its {f['storage_bytes']}-byte storage")
    return f


def _nonneg_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def rebuild_handle(f: dict) -> torch.Tensor:
    """Map the tensor a validated ``handle_fields`` record describes, with torch's own rebuild function."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    f = check_handle_fields(f)
    event = None if f["event_handle"] is None else _bytes_field("event_handle", f["event_handle"])
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(f["size"]), tuple(f["stride"]), f["offset"], torch.storage.TypedStorage,
        _DTYPES[f["dtype"]], f["device"], _bytes_field("handle", f["handle"]), f["storage_bytes"],
        f["storage_offset"], False, _bytes_field("ref_handle", f["ref_handle"]), f["ref_offset"], event,
        f["event_sync"],
    )  # fmt: skip


def export_handles(store: SignedStore, key: str, tensors: dict[str, torch.Tensor]) -> None:
    """Publish IPC handles of ``tensors`` (CUDA) under ``key``: plain data, sealed with the job secret."""
    handles = {}
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"CUDA IPC needs CUDA tensors; {name!r} is on {t.device}")
        handles[name] = handle_fields(t)
    store.put_sealed(key, json.dumps(handles).encode())


def import_handles(store: SignedStore, key: str, timeout_s: float) -> dict[str, torch.Tensor]:
    """Map the tensors another process published under ``key`` (each record validated before use)."""
    handles = json.loads(store.get_sealed(key, timeout_s))
    if not isinstance(handles, dict) or not all(isinstance(n, str) for n in handles):
        raise PlanError(f"the CUDA IPC handles under {key!r} are not a mapping of tensor names")
    return {name: rebuild_handle(f) for name, f in handles.items()}


def export_per_receiver(plan: Plan, proc: int, local: LocalTensors, store: SignedStore, name: str, ipc: list) -> None:
    """Publish, for each receiver that pulls from this process, the handles of exactly the tensors it
    pulls (``<name>/ipc/<proc>/<receiver>``). One export per receiver: torch counts one release per
    export, so a handle mapped by two receivers would leave its count wrong (and the producer warning
    at exit that its memory is still shared); and no receiver learns handles it does not need."""
    wanted: dict[int, dict[str, torch.Tensor]] = {}
    for m in ipc:
        if plan.procs.src[m.src] == proc:
            for p in m.pieces:
                i, (_, t) = local.src_part(p.tensor, p.box)
                wanted.setdefault(plan.procs.dst[m.dst], {})[part_key(p.tensor, i)] = t
    for receiver, tensors in sorted(wanted.items()):
        export_handles(store, f"{name}/ipc/{proc}/{receiver}", dict(sorted(tensors.items())))
