"""Fusion plans: how the gradient-ready sequence of tensors is cut into buckets."""

from .plans import FusionPlanner, GroupsPlan, LayerwisePlan, SinglePlan, SizeCapPlan, parse_fusion

__all__ = ["FusionPlanner", "GroupsPlan", "LayerwisePlan", "SinglePlan", "SizeCapPlan", "parse_fusion"]
