"""Which bytes go where: the process map (``procs``), the source choice among replicas (``sources``), the
planner (``planner``: messages, buckets, steps, digest), the per-process schedule facts (``schedule``) and the
cost model that predicts a plan's time on a cluster (``cost``, imported from its module).
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
