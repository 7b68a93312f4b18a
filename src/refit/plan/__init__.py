"""Which bytes go where: the planner (``planner``: source choice, messages, schedule, digest) and the
cost model that predicts a plan's time on a cluster (``cost``, imported from its module).
"""

from refit.plan.planner import (
    Message,
    Piece,
    Plan,
    PlanError,
    ProcessMap,
    build_plan,
    canonical_tensor,
    check_compatible,
    check_coverage,
    link_bytes,
)

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
