"""refit: weight refit between trainer and inference-engine layouts."""

from refit.config import TransferConfig
from refit.layout import Box, LayoutError, Mesh, ModelLayout, TensorLayout
from refit.layout.rules import layout_from_spec
from refit.layout.spec import ParallelSpec, SpecError, parse_spec
from refit.plan import Plan, PlanError, ProcessMap, build_plan
from refit.transfer import Peer, Receiver, Sender

__all__ = [
    "Box",
    "LayoutError",
    "Mesh",
    "ModelLayout",
    "TensorLayout",
    "Plan",
    "PlanError",
    "ProcessMap",
    "build_plan",
    "layout_from_spec",
    "ParallelSpec",
    "SpecError",
    "parse_spec",
    "Peer",
    "Receiver",
    "Sender",
    "TransferConfig",
]
