"""A source process's base: the copy of the bytes it last sent over P2P, which its next deltas diff against."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.delta.elements import apply_changes
from refit.delta.words import Scatter, scatter_words_many, side_stream
from refit.layout import box_intersect
from refit.plan import Plan


class SourceBase:
    """A source process's copy of the bytes it last sent over P2P (or, ``transport="nixl"``, that its NIXL
    receivers last read; ``"ipc"``: its CUDA IPC receivers on other GPUs, the messages ``sent``): every source
    tensor some such message of this process reads, whole (``where``:
    ``"device"``, beside the tensor, or ``"host"``, pinned when CUDA is present). ``version`` is the version it
    holds (``None``: nothing sent yet, or a refit failed after part of it was updated). ``nbytes``: the extra
    memory.

    Per run, each message's base is brought to what it sent (``update``): when no other message of this
    process reads any of its elements (the common case), dense copies at once, word changes found per piece
    once the chunk's payload is posted (``flush``), words by address from their packed payloads after the
    run's last find is queued (``defer_packed``); else at ``commit`` (another message to another receiver
    still has to diff against the old bytes).
    ``commit(v)`` after the run succeeded; ``fail()`` after it failed (the base is part old, part new:
    ``None``, so the next refit is dense and rebuilds it)."""

    def __init__(
        self,
        plan: Plan,
        proc: int,
        local: LocalTensors,
        where: str,
        budget: int,
        transport: str = "p2p",
        sent: list[int] | None = None,
    ) -> None:
        sent = _sent(plan, proc, transport) if sent is None else sent
        names = {p.tensor for i in sent for p in plan.messages[i].pieces}
        parts = {n: tuple((box, _copy_of(t, where)) for box, t in local.src[n]) for n in names}
        self.local = replace(local, src=parts)
        self.nbytes = sum(t.numel() * t.element_size() for ps in parts.values() for _, t in ps)
        self.shared = _shared_messages(plan, sent)
        self.version: int | None = None
        self.pending: list = []  # (base view, indices or None, values or the live view, words)
        self.queued: list = []  # word updates of the current step-chunk (``flush``)
        self.packed: list = []  # words by address: (scatter rows, payload buffer) per packed buffer (``defer_packed``)
        self.packed_bytes = 0  # their buffers' bytes, held until they are applied (``_apply_packed``)
        self.budget = budget  # the packed payload bytes held at most (one buffer over it is applied alone)
        self.updating: torch.device | None = None  # a CUDA device with packed updates on its "update" stream
        self.later: list | None = None  # ``hold``: the updates of unshared messages, applied by ``settle``

    def update(self, message: int, updates: list, words: bool = False) -> None:
        """``(base view, indices or None, values or the live view)`` of message ``message``'s pieces; ``words``:
        the indices and values are changed 64-bit words (``refit.delta.words``). The changes may be views
        of the find's slots: a deferred update keeps copies."""
        updates = [(b, i, x, words) for b, i, x in updates]
        if message in self.shared:
            self.pending += [(b, i, x, w) if i is None else (b, i.clone(), x.clone(), w) for b, i, x, w in updates]
        elif self.later is not None:
            self.later += updates
        elif words:
            self.queued += updates  # one scatter for a find batch's word updates (``flush``)
        else:
            apply_updates(updates)

    def hold(self) -> None:
        """From now until ``settle``, ``update`` keeps the updates of unshared messages instead of applying them
        (their changes are kept alive, not copied: host memory, where the find's results are arrays of their
        own). A NIXL source holds them while it stages and applies them once it has announced, while its
        receivers read: the base is read again only by the next refit's find."""
        self.later = []

    def settle(self) -> None:
        """Apply the updates ``hold`` kept (one scatter for the word changes); ``update`` applies again."""
        apply_updates(self.take_held())

    def take_held(self) -> list:
        """The updates ``hold`` kept, handed over (``apply_updates`` applies them, on any thread; nothing may read
        the base until it returns); ``update`` applies again. Whole copies from the live tensors (a message sent
        dense) are applied here, before the refit returns and its caller may change its tensors: what is handed
        over holds arrays of its own (the finds' changes)."""
        later, self.later = self.later or [], None
        apply_updates([u for u in later if u[1] is None])
        return [u for u in later if u[1] is not None]

    def defer_found(self, found: tuple, bases: list) -> None:
        """The base update of a shared message sent as words by address (``found`` = ``(Found, a, b)``, its
        pieces there; ``bases`` its base views): copied and deferred to ``commit``."""
        f, a, b = found
        pieces = [f.piece(j) for j in range(a, b)]
        self.pending += [(v, i.clone(), w.clone(), True) for v, (i, w) in zip(bases, pieces)]

    def defer_packed(self, rows: tuple, buf: torch.Tensor) -> None:
        """The base update of messages sent as words by address, read from their packed payload ``buf``: per piece
        ``rows`` = (base address, index address, word address, changes, words) (``_pack_spans``); applied by
        ``flush(final=True)`` once the refit's last find is queued, so it runs behind the finds, not between them.
        The buffers held stay within ``budget``: those held before are applied first where ``buf`` would pass it
        (then at most ``buf`` alone is held)."""
        if not len(rows[3]):
            return  # nothing of this buffer updates a base (shared messages' wait for ``commit``)
        if self.packed and self.packed_bytes + buf.nbytes > self.budget:
            self._apply_packed()
        self.packed.append((rows, buf))
        self.packed_bytes += buf.nbytes

    def flush(self, final: bool = False) -> None:
        """Apply the queued word updates (one launch, while the finds' slots are held) and, when ``final``, the
        packed ones (``_apply_packed``)."""
        apply_updates(self.queued)
        self.queued = []
        if final:
            self._apply_packed()

    def _apply_packed(self) -> None:
        """The packed updates held, in one launch (on CUDA on the ``"update"`` stream, behind the current one;
        ``join`` makes the current stream wait for it); then their buffers are let go."""
        if not self.packed:
            return
        rows = [np.concatenate(c) for c in zip(*(r for r, _ in self.packed))]
        dev = self.packed[0][1].device
        self.updating = dev if dev.type == "cuda" else self.updating
        stream = side_stream(dev, "update") if dev.type == "cuda" else None
        Scatter.of(*rows, dev).apply(stream, tuple(buf for _, buf in self.packed))
        self.packed, self.packed_bytes = [], 0

    def join(self) -> None:
        """The current stream waits for the packed updates ``flush`` queued on the ``"update"`` stream, if any."""
        if self.updating is not None:
            dev, self.updating = self.updating, None
            torch.cuda.current_stream(dev).wait_stream(side_stream(dev, "update"))

    def commit(self, version: int) -> None:
        """The run of ``version`` succeeded: the deferred updates, then the base holds ``version``."""
        self.settle()
        self.flush(final=True)
        self.join()
        apply_updates(self.pending)
        self.pending, self.version = [], version

    def fail(self) -> None:
        """The run failed: the base may be part new; the next refit sends dense and rebuilds it."""
        self.pending, self.queued, self.packed, self.packed_bytes, self.version = [], [], [], 0, None
        self.later = None


def apply_updates(updates: list) -> None:
    """Bring base views up to date: whole copies, element changes, and the word changes in one scatter (also the
    updates ``SourceBase.take_held`` hands over, on any thread: on the CPU numpy's scatters let go of the GIL)."""
    words = []
    for base, idx, values, by_words in updates:
        if idx is None:
            base.copy_(values, non_blocking=True)
        elif by_words:
            words.append((base, idx, values))
        else:
            apply_changes(base, idx.to(base.device), values.to(base.device))
    if words:
        scatter_words_many(words)


def shared_of(plan: Plan, proc: int, transport: str = "p2p") -> set[int]:
    """``SourceBase.shared`` of process ``proc``'s messages over ``transport``, without building a base."""
    return _shared_messages(plan, _sent(plan, proc, transport))


def _shared_messages(plan: Plan, sent: list[int]) -> set[int]:
    """The messages among ``sent`` whose pieces overlap a piece of another of them (one source box sent
    to several receivers)."""
    by_tensor: dict[str, list[tuple[int, tuple]]] = {}
    for i in sent:
        for p in plan.messages[i].pieces:
            by_tensor.setdefault(p.tensor, []).append((i, p.box))
    shared: set[int] = set()
    for items in by_tensor.values():
        for a in range(len(items)):
            for b in range(a + 1, len(items)):
                if items[a][0] != items[b][0] and box_intersect(items[a][1], items[b][1]) is not None:
                    shared.update((items[a][0], items[b][0]))
    return shared


def _copy_of(t: torch.Tensor, where: str) -> torch.Tensor:
    if where == "host" and t.device.type == "cuda":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.detach().clone()


def _sent(plan: Plan, proc: int, transport: str = "p2p") -> list[int]:
    return [i for i, m in enumerate(plan.messages) if m.transport == transport and plan.procs.src[m.src] == proc]
