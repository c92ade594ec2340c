"""Fusion plans: how the gradient-ready sequence of tensors is cut into buckets."""

from .plans import (
    AutoPlan,
    FilePlan,
    FusionPlanner,
    GroupsPlan,
    LayerwisePlan,
    SinglePlan,
    SizeCapPlan,
    parse_fusion,
)
from .timeline import Cost, CostModel, best_plan, simulate

__all__ = [
    "AutoPlan",
    "Cost",
    "CostModel",
    "FilePlan",
    "FusionPlanner",
    "GroupsPlan",
    "LayerwisePlan",
    "SinglePlan",
    "SizeCapPlan",
    "best_plan",
    "parse_fusion",
    "simulate",
]
