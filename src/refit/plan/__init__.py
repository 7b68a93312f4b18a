"""Which bytes go where: the process map (``procs``), the source choice among replicas (``sources``), the
planner (``planner``: messages, buckets, steps, digest) and the per-process schedule facts (``schedule``).
What a plan costs on a cluster is ``refit.cost``.
"""

from refit.plan.planner import Message, Piece, Plan, PlanError, build_plan, check_coverage
from refit.plan.procs import ProcessMap
from refit.plan.sources import canonical_tensor, check_compatible, link_bytes

__all__ = [
    "Message",
    "Piece",
    "Plan",
    "PlanError",
    "ProcessMap",
    "build_plan",
    "canonical_tensor",
    "check_compatible",
    "check_coverage",
    "link_bytes",
]
