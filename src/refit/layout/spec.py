"""Parallelism specs as strings: ``"tp=2,pp=2"`` for a trainer, ``"tp=1,dp=4"`` for an engine.

A spec names the degree of each parallel dimension of one side. Its mesh puts
the dims in a fixed order, the last varying fastest (tensor parallel ranks are
neighbours, as in Megatron and torchtitan):

* source (trainer): ``pp, dp, fsdp, ep, etp, tp``
* destination (engine): ``dp, ep, tp``

``ep`` splits the experts of MoE layers (dense tensors are replicated over
it, as in Megatron where expert parallelism folds over data parallelism);
``etp`` is tensor parallelism inside experts (without it, ``tp`` splits the
experts too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from refit.errors import SpecError

Side = Literal["src", "dst"]

SIDE_DIMS: dict[str, tuple[str, ...]] = {
    "src": ("pp", "dp", "fsdp", "ep", "etp", "tp"),
    "dst": ("dp", "ep", "tp"),
}
_SIDE_NAMES = {"src": "source (trainer)", "dst": "destination (engine)"}


@dataclass(frozen=True)
class ParallelSpec:
    """The degree of every parallel dim of one side, in mesh order (``SIDE_DIMS[side]``, the
    last varying fastest).

    Built by ``parse_spec``, the one validator: known keys, each once, integer degrees >= 1,
    every dim of the side listed (1 where not given); ``SpecError`` quotes the spec and names
    the offending key or value. Constructing one directly is not checked. Derived, never
    stored: ``world_size`` (the product of the degrees), ``mesh_shape``, ``dim_names``,
    ``degree(dim)`` (1 for a dim not listed), ``replica()`` and ``replica_ranks()``. ``str()``
    lists the degrees other than 1 (``"tp=1"`` when all are 1). ``layout_from_spec`` builds the
    mesh from it.

    ``check_world_size(n)`` raises ``SpecError`` naming each factor and both counts ("source
    (trainer) spec pp=2,tp=2 needs pp=2 x tp=2 = 4 ranks, but 3 are given").
    """

    side: Side
    degrees: tuple[tuple[str, int], ...]  # (dim, degree) in mesh order, all dims of the side

    def degree(self, dim: str) -> int:
        """The degree of ``dim``; 1 for a dim this spec does not list."""
        return dict(self.degrees).get(dim, 1)

    @property
    def world_size(self) -> int:
        return math.prod(d for _, d in self.degrees)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(d for _, d in self.degrees)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.degrees)

    def __str__(self) -> str:
        parts = [f"{n}={d}" for n, d in self.degrees if d != 1]
        return ",".join(parts) or "tp=1"

    def replica(self) -> ParallelSpec:
        """The spec of one data-parallel replica (``dp`` set to 1)."""
        return ParallelSpec(self.side, tuple((n, 1 if n == "dp" else d) for n, d in self.degrees))

    def replica_ranks(self) -> list[list[int]]:
        """Side-local ranks of each ``dp`` replica: consecutive blocks of ``world_size // dp``.
        Needs ``dp`` outermost, as on the destination side; a source spec with ``dp`` > 1 (where
        ``pp`` comes first) raises ``SpecError``."""
        if self.dim_names[:1] != ("dp",) and self.degree("dp") > 1:
            raise SpecError(f"spec {self}: dp is not the outermost dim")
        per = self.world_size // self.degree("dp")
        return [list(range(j * per, (j + 1) * per)) for j in range(self.degree("dp"))]

    def check_world_size(self, world_size: int) -> None:
        """``SpecError`` naming each factor and both counts unless ``self.world_size == world_size``."""
        if self.world_size != world_size:
            detail = " x ".join(f"{n}={d}" for n, d in self.degrees if d != 1) or "1"
            raise SpecError(
                f"{_SIDE_NAMES[self.side]} spec {self} needs {detail} = {self.world_size} ranks, "
                f"but {world_size} are given"
            )


def parse_spec(text: str, side: Side) -> ParallelSpec:
    """Parse ``"tp=2,pp=2"``; unknown keys, repeats and non-positive degrees are errors."""
    if side not in SIDE_DIMS:
        raise SpecError(f"side must be 'src' or 'dst', got {side!r}")
    allowed = SIDE_DIMS[side]
    given: dict[str, int] = {}
    if not text or not text.strip():
        raise SpecError(f"empty {_SIDE_NAMES[side]} spec; expected e.g. 'tp=2' (keys: {', '.join(allowed)})")
    for part in text.split(","):
        part = part.strip()
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise SpecError(f"bad item {part!r} in {_SIDE_NAMES[side]} spec {text!r}: expected key=degree")
        if key not in allowed:
            raise SpecError(
                f"unknown key {key!r} in {_SIDE_NAMES[side]} spec {text!r}; allowed keys: {', '.join(allowed)}"
            )
        if key in given:
            raise SpecError(f"key {key!r} given twice in {_SIDE_NAMES[side]} spec {text!r}")
        try:
            deg = int(value.strip())
        except ValueError:
            raise SpecError(f"degree of {key!r} in spec {text!r} must be an integer, got {value.strip()!r}") from None
        if deg < 1:
            raise SpecError(f"degree of {key!r} in spec {text!r} must be >= 1, got {deg}")
        given[key] = deg
    return ParallelSpec(side, tuple((d, given.get(d, 1)) for d in allowed))
