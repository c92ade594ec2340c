"""Fusion plans: how the gradient-ready sequence of tensors is cut into buckets."""

from .plans import (
    AutoPlanner,
    FilePlanner,
    FusionPlanner,
    GroupsPlanner,
    LayerwisePlanner,
    SinglePlanner,
    SizeCapPlanner,
    parse_fusion,
)
from .timeline import Cost, CostModel, best_plan, simulate

__all__ = [
    "AutoPlanner",
    "Cost",
    "CostModel",
    "FilePlanner",
    "FusionPlanner",
    "GroupsPlanner",
    "LayerwisePlanner",
    "SinglePlanner",
    "SizeCapPlanner",
    "best_plan",
    "parse_fusion",
    "simulate",
]
