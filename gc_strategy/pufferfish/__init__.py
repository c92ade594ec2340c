"""Pufferfish (Wang, Agarwal, Papailiopoulos, MLSys 2021): low-rank models trained after a
full-rank warm-up. :func:`factorize` converts a model; :class:`PufferfishWarmup` is the Lightning
callback that trains the vanilla model first, converts it on every rank at the same step and keeps
the optimizer, the learning-rate schedule and the gradient synchroniser consistent."""

from .layers import LowRankConv2d, LowRankLinear, LowRankLSTM, svd_factors
from .transform import (
    Factorization,
    count_parameters,
    enable_factorized_loading,
    factorize,
    factorize_like,
    select_layers,
)
from .warmup import PufferfishWarmup

__all__ = [
    "Factorization",
    "LowRankConv2d",
    "LowRankLSTM",
    "LowRankLinear",
    "PufferfishWarmup",
    "count_parameters",
    "enable_factorized_loading",
    "factorize",
    "factorize_like",
    "select_layers",
    "svd_factors",
]
