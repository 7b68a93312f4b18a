"""torch's own CUDA runtime, reached through ctypes, for what torch does not expose: raw copies (IPC pulls),
peer access, and CUDA streams that refit owns alone (``private_stream``, freed by ``free_stream``;
``OwnedStreams`` makes and frees a component's set of them; ``joined`` runs work on one, ordered both ways
with the caller's stream).

torch hands out ``torch.cuda.Stream()`` round-robin from a pool of 32 streams per device, so an engine's
stream and one of refit's could be the same stream: each would then wait for the other's work. Every
stream refit keeps (the executor's, IPC lanes, checksum and delta side streams, P2P pack/unpack) is
private."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable

import torch

_CUDART: ctypes.CDLL | None = None


def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch itself loaded (for memcpy / memcpy2D / peer access), or None.

    It must be torch's own instance: a second runtime keeps its own notion of
    the current device, so peer access enabled through it lands on the wrong
    device. If torch's cannot be found, callers fall back to torch copies.
    """
    global _CUDART  # a process-wide handle to an already loaded shared library
    if _CUDART is not None or not torch.cuda.is_available():
        return _CUDART
    torch.cuda.init()
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcudart.so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        return None
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.cudaMemcpy2DAsync.restype = ctypes.c_int
        lib.cudaMemcpy2DAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.cudaDeviceEnablePeerAccess.restype = ctypes.c_int
        lib.cudaDeviceEnablePeerAccess.argtypes = [ctypes.c_int, ctypes.c_uint]
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaStreamCreateWithFlags.restype = ctypes.c_int
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaStreamCreateWithPriority.restype = ctypes.c_int
        lib.cudaStreamCreateWithPriority.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
        lib.cudaDeviceGetStreamPriorityRange.restype = ctypes.c_int
        lib.cudaDeviceGetStreamPriorityRange.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.cudaStreamDestroy.restype = ctypes.c_int
        lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.cudaGraphLaunch.restype = ctypes.c_int
        lib.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaStreamQuery.restype = ctypes.c_int
        lib.cudaStreamQuery.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    _CUDART = lib
    return lib


_STREAM_NON_BLOCKING = 1
_NOT_READY = 600  # cudaErrorNotReady: work is still queued
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def device_index(device: torch.device) -> int:
    """A CUDA device's index (the current device for ``cuda`` without one); -1 for any other device."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` without a new ``Stream`` object per call (cached by stream id: a
    ``Stream`` only names a stream). Once caches are cold (a refit between training steps) torch's call costs
    30-40 us of host time, this a few."""
    sid, index, kind = torch._C._cuda_getCurrentStream(index)
    stream = _STREAMS.get((index, sid))
    if stream is None:
        if len(_STREAMS) > 256:  # streams come and go (private ones are freed): the names of old ones
            _STREAMS.clear()
        stream = _STREAMS[(index, sid)] = torch.cuda.Stream(stream_id=sid, device_index=index, device_type=kind)
    return stream


def idle(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` has no work queued: one ``cudaStreamQuery`` through torch's runtime (``Stream.query``
    is 2-3 times its host time on cold caches); ``Stream.query`` where that runtime was not found or the
    query reports an error (torch raises it)."""
    lib = cuda_runtime()
    if lib is not None:
        rc = lib.cudaStreamQuery(stream.cuda_stream)
        if rc in (0, _NOT_READY):
            return rc == 0
    return stream.query()


def launch(graph: torch.cuda.CUDAGraph, stream: int) -> bool:
    """Launch ``graph``'s instantiated executable on the raw stream ``stream`` (``Stream.cuda_stream``) in one
    runtime call: what ``replay`` does, without its device guard and generator bookkeeping, for graphs of
    copies and kernels that draw no random numbers. False where this torch does not expose the executable or
    torch's runtime was not found (the caller replays)."""
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None or cuda_runtime() is None:
        return False
    rc = _CUDART.cudaGraphLaunch(raw(), stream)
    if rc != 0:
        raise RuntimeError(f"cudaGraphLaunch failed with CUDA error {rc}")
    return True


def launch_on(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """``launch`` on ``stream``, or where that is not available ``graph.replay()`` with ``stream`` current."""
    if not launch(graph, stream.cuda_stream):
        with torch.cuda.stream(stream):
            graph.replay()


def private_stream(device: torch.device, high: bool = False) -> torch.cuda.Stream:
    """A CUDA stream of ``device`` that no one else in the process holds: created through the runtime
    (non-blocking), not taken from torch's pool, whose 32 streams per device are handed out round-robin
    (an engine's ``torch.cuda.Stream()`` could be the same stream). ``high``: of the device's greatest
    priority (its blocks are scheduled before those of default-priority streams' kernels already queued,
    e.g. a large find's). Free it with ``free_stream``. Without torch's runtime found, a pool stream (the
    only other way)."""
    lib = cuda_runtime()
    if lib is None:
        return torch.cuda.Stream(device, priority=-1 if high else 0)
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        if high:
            least, greatest = ctypes.c_int(), ctypes.c_int()
            rc = lib.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))
            if rc == 0:
                rc = lib.cudaStreamCreateWithPriority(ctypes.byref(handle), _STREAM_NON_BLOCKING, greatest.value)
        else:
            rc = lib.cudaStreamCreateWithFlags(ctypes.byref(handle), _STREAM_NON_BLOCKING)
    if rc != 0:
        raise RuntimeError(f"creating a private CUDA stream on {device} failed with CUDA error {rc}")
    return torch.cuda.ExternalStream(handle.value, device=device)


def free_stream(stream: torch.cuda.Stream | None) -> None:
    """Destroy ``stream`` if ``private_stream`` created it through the runtime, without waiting: CUDA
    releases it once its queued work is done (a refit that failed may have left work that never ends)."""
    lib = cuda_runtime()
    if stream is None or lib is None or not isinstance(stream, torch.cuda.ExternalStream):
        return
    lib.cudaStreamDestroy(ctypes.c_void_p(stream.cuda_stream))


class OwnedStreams:
    """The private streams one component made (``new``), freed together by ``free`` (idempotent)."""

    def __init__(self) -> None:
        self.streams: list[torch.cuda.Stream] = []

    def new(self, device: torch.device) -> torch.cuda.Stream:
        stream = private_stream(device)
        self.streams.append(stream)
        return stream

    def free(self) -> None:
        streams, self.streams = self.streams, []
        for stream in streams:
            free_stream(stream)


@contextlib.contextmanager
def joined(
    stream: torch.cuda.Stream,
    device: torch.device,
    events: tuple | None = None,
    settled: Callable[[], bool] | None = None,
):
    """Device work inside runs on ``stream`` (of ``device``): it first waits for what the caller's current stream
    of ``device`` has queued (nothing to wait for when that is all done already: one query instead of an event
    recorded and waited for), and the caller's stream waits for it on the way out (also after an error; a sticky
    CUDA error there does not hide the original one), unless ``settled()`` says on the way out that everything
    queued on ``stream`` inside has finished (the block waited for it: nothing is left to order). ``events``: two
    ``torch.cuda.Event`` made once (``join_events``) for a join that runs every refit, instead of two new ones
    each time. Once caches are cold (a refit between training steps) each CUDA call here is 10-50 us of host
    time, so it makes few."""
    into, out = events if events is not None else (torch.cuda.Event(), torch.cuda.Event())
    caller = current_stream(device_index(device))
    if not idle(caller):
        into.record(caller)
        stream.wait_event(into)
    # what ``torch.cuda.stream(stream)`` does for a stream of ``device`` (that device's current stream is swapped,
    # the current device stays), in one call
    torch.cuda.set_stream(stream)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            out.record(stream)
            caller.wait_event(out)
        raise
    finally:
        torch.cuda.set_stream(caller)
    if settled is None or not settled():
        out.record(stream)
        caller.wait_event(out)


def join_events() -> tuple:
    """The two events a ``joined`` that runs every refit reuses."""
    return torch.cuda.Event(), torch.cuda.Event()
