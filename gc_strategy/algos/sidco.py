"""SIDCo (Abdelmoniem et al., MLSys 2021, "An Efficient Statistical-based Gradient Compression
Technique for Distributed Training Systems"): the top-δ threshold of ``a = |g|`` from a fitted
distribution instead of a sort (docs/algorithms.md §3).

Estimators of the threshold ``η`` for a tail probability ``q`` on exceedances ``y`` (``y = a`` in the
first stage, ``y = a - t`` above the previous stage's threshold ``t`` later):

- exponential: ``η = mean(y) · ln(1/q)``;
- generalized Pareto (method of moments, mean ``μ``, variance ``σ²``): shape
  ``ξ = ½(1 - μ²/σ²)``, scale ``β = ½ μ (μ²/σ² + 1)``, ``η = (β/ξ)(q^(-ξ) - 1)``
  (``β ln(1/q)`` as ``ξ → 0``);
- gamma (first stage only, later stages GP): ``s = ln(mean a) - mean(ln a)``, shape
  ``k ≈ (3 - s + sqrt((s-3)² + 24 s)) / (12 s)`` (Minka), scale ``mean/k``,
  ``η = scale · P⁻¹(k, 1 - q)`` with the inverse regularised incomplete gamma.

Multi-stage: stage 1 targets ``δ₁`` (``first_ratio``, default 0.25) and each of the ``S-1`` later
stages keeps the ratio ``(δ/δ₁)^(1/(S-1))`` of the previous stage's exceedances, so the final density
is ``δ``. Adaptive stages: every ``adapt_every`` steps a bucket whose achieved density is above 1.2δ
gains a stage, below 0.8δ loses one, within ``[1, ⌈log δ / log 0.5⌉]``. The count is per bucket.
"""

from __future__ import annotations

import math

import torch
from scipy.special import gammaincinv
from torch import Tensor

from .. import kernels
from ..bucket import Bucket
from ..registry import Option
from .base import COMPRESSORS
from .sparse import DENSITY, Sparsifier


def exceedances(magnitudes: Tensor, threshold: float | Tensor) -> Tensor:
    """``a − t`` for the elements ``a > t`` (NaN is not above), as a new tensor (for the number
    ``t = 0``, the positive elements, without a pass subtracting it)."""
    tail = kernels.exceedances(magnitudes, threshold)
    return tail if isinstance(threshold, float) and threshold == 0 else tail.sub_(threshold)


def exponential_threshold(y: Tensor, q: float) -> Tensor:
    return y.mean() * math.log(1 / q)


def gpareto_threshold(y: Tensor, q: float) -> Tensor:
    mean, var = y.mean(), y.var(unbiased=False)
    ratio = mean.square() / var.clamp_min(torch.finfo(y.dtype).tiny)
    xi = 0.5 * (1 - ratio)
    beta = 0.5 * mean * (ratio + 1)
    general = beta / xi * (q ** (-xi) - 1)
    return torch.where(xi.abs() < 1e-6, beta * math.log(1 / q), general)


def gamma_threshold(y: Tensor, q: float) -> Tensor:
    positive = exceedances(y, 0.0)
    if positive.numel() < 2:
        return exponential_threshold(y, q)
    mean = positive.mean()
    s = float(mean.log() - positive.log_().mean())
    if s <= 0:  # all values equal: no spread to fit
        return mean
    shape = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    scale = mean / shape
    return scale * float(gammaincinv(shape, 1 - q))


ESTIMATORS = ("exponential", "gpareto", "gamma")


@COMPRESSORS.register("sidco")
class SIDCo(Sparsifier):
    __doc__ = __doc__

    OPTIONS = {
        "density": DENSITY,
        "estimator": Option("exponential", str, choices=ESTIMATORS),
        "stages": Option(1, int, low=1, help="initial number of fitting stages"),
        "first_ratio": Option(0.25, float, low=0.0, high=1.0, low_open=True, help="δ₁"),
        "adapt_every": Option(5, int, low=0, help="steps between stage adjustments (0: fixed)"),
    }
    variable_size = True

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.stage_counts: dict[str, int] = {}

    def max_stages(self) -> int:
        return max(1, math.ceil(math.log(self.options["density"]) / math.log(0.5)))

    def stage_ratios(self, stages: int) -> list[float]:
        density, first = self.options["density"], self.options["first_ratio"]
        if stages == 1 or density >= first:
            return [density]
        return [first] + [(density / first) ** (1 / (stages - 1))] * (stages - 1)

    def threshold(self, magnitudes: Tensor, stages: int) -> Tensor:
        """The sum of the stages' estimates: the first fits ``a`` itself, each later one the
        exceedances over the threshold so far, taken from the previous stage's (a subset: ``a > t +
        η`` exactly where ``a − t > η``), and none is formed after the last stage."""
        estimator = self.options["estimator"]
        threshold = estimate = None
        tail = magnitudes
        for stage, q in enumerate(self.stage_ratios(stages)):
            if stage:
                tail = exceedances(tail, estimate)
                if tail.numel() == 0:
                    break
            if stage == 0 and estimator == "gamma":
                fit = gamma_threshold
            elif estimator == "exponential":
                fit = exponential_threshold
            else:
                fit = gpareto_threshold
            estimate = fit(tail, q)
            threshold = estimate if stage == 0 else threshold + estimate
        return threshold

    def select(self, flat: Tensor, bucket: Bucket) -> Tensor:
        key = bucket.names[0]
        stages = self.stage_counts.setdefault(key, min(self.options["stages"], self.max_stages()))
        magnitudes = self.magnitudes(flat, bucket)
        selected = kernels.positions_at_least(magnitudes, self.threshold(magnitudes, stages), strict=True)
        every = self.options["adapt_every"]
        if every and (self.step + 1) % every == 0:
            achieved, density = selected.numel() / flat.numel(), self.options["density"]
            if achieved > 1.2 * density:
                self.stage_counts[key] = min(stages + 1, self.max_stages())
            elif achieved < 0.8 * density:
                self.stage_counts[key] = max(stages - 1, 1)
        return selected

    def extra_state(self) -> dict:
        return {"stage_counts": dict(self.stage_counts)}

    def load_extra_state(self, state: dict) -> None:
        self.stage_counts = dict(state.get("stage_counts", {}))
