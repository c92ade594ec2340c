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
gains a stage, below 0.8δ loses one, within ``[1, ⌈log δ / log 0.5⌉]``. The count is per bucket and
held on the host; the density measured at one adaptation step sets the count from the next one on
(``adapt_every`` steps later), so that the count of selected entries reaches host memory without
the host waiting for it (:class:`~gc_strategy.bucket.HostCopy`).

The payload holds ``C = ⌈capacity · k⌉`` slots (:class:`~gc_strategy.algos.capacity.CapacitySparsifier`).
Off the host the fit runs on the device end to end, on masks rather than new tensors of the
exceedances, so their sizes are never read. The host never reads the device, except for the gamma
estimator's first stage, whose inverse incomplete gamma function comes from scipy.
"""

from __future__ import annotations

import math

import torch
from scipy.special import gammaincinv
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, HostCopy
from ..communicators import Payload
from ..registry import Option
from .base import COMPRESSORS
from .capacity import CAPACITY_OF_K, CapacitySparsifier
from .sparse import DENSITY, keep_count


def exceedances(magnitudes: Tensor, threshold: float | Tensor) -> Tensor:
    """``a − t`` for the elements ``a > t`` (NaN is not above), as a new tensor (for the number
    ``t = 0``, the positive elements, without a pass subtracting it)."""
    tail = kernels.exceedances(magnitudes, threshold)
    return tail if isinstance(threshold, float) and threshold == 0 else tail.sub_(threshold)


def _mean(y: Tensor, mask: Tensor | None) -> Tensor:
    """The mean of ``y`` where ``mask`` (all of it where None), with no host read of the count."""
    if mask is None:
        return y.mean()
    return torch.where(mask, y, 0).sum() / mask.sum().clamp_min(1)


def _log_inverse(q: float | Tensor) -> float | Tensor:
    """``ln(1/q)`` of a number, or of a device scalar without reading it."""
    return torch.log(1 / q) if isinstance(q, Tensor) else math.log(1 / q)


def exponential_threshold(y: Tensor, q: float | Tensor, mask: Tensor | None = None) -> Tensor:
    return _mean(y, mask) * _log_inverse(q)


def gpareto_threshold(y: Tensor, q: float | Tensor, mask: Tensor | None = None) -> Tensor:
    mean = _mean(y, mask)
    var = _mean((y - mean).square(), mask)
    ratio = mean.square() / var.clamp_min(torch.finfo(y.dtype).tiny)
    xi = 0.5 * (1 - ratio)
    beta = 0.5 * mean * (ratio + 1)
    general = beta / xi * (q ** (-xi) - 1)
    return torch.where(xi.abs() < 1e-6, beta * _log_inverse(q), general)


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
class SIDCo(CapacitySparsifier):
    __doc__ = __doc__

    OPTIONS = {
        "density": DENSITY,
        "estimator": Option("exponential", str, choices=ESTIMATORS),
        "stages": Option(1, int, low=1, help="initial number of fitting stages"),
        "first_ratio": Option(0.25, float, low=0.0, high=1.0, low_open=True, help="δ₁"),
        "adapt_every": Option(5, int, low=0, help="steps between stage adjustments (0: fixed)"),
        "capacity": CAPACITY_OF_K,
    }
    strict = True

    def __init__(self, **options) -> None:
        super().__init__(**options)
        #: the stage count per bucket (by its first parameter)
        self.stage_counts: dict[str, int] = {}
        #: per bucket, its count of entries above the threshold at its last adaptation step, and its size
        self._measured: dict[str, tuple[HostCopy, int]] = {}

    def max_stages(self) -> int:
        return max(1, math.ceil(math.log(self.options["density"]) / math.log(0.5)))

    def stage_ratios(self, stages: int) -> list[float]:
        density, first = self.options["density"], self.options["first_ratio"]
        if stages == 1 or density >= first:
            return [density]
        return [first] + [(density / first) ** (1 / (stages - 1))] * (stages - 1)

    def capacity(self, n: int) -> int:
        return min(n, math.ceil(self.options["capacity"] * keep_count(self.options["density"], n)))

    def fitted_threshold(self, magnitudes: Tensor, stages: int) -> Tensor:
        """The sum of the stages' estimates: the first fits ``a`` itself, each later one the
        exceedances ``a − t`` over the threshold so far (``a > t``, a subset of the previous
        stage's: ``a > t + η`` exactly where ``a − t > η``), and an empty one adds nothing. In host
        memory the exceedances are new, small tensors; elsewhere masks, whose counts stay on the
        device."""
        ratios = self.stage_ratios(stages)
        if kernels.in_host_memory(magnitudes):
            return self._fit_tails(magnitudes, ratios)
        return self._fit_masks(magnitudes, ratios)

    def _first_fit(self, magnitudes: Tensor, q: float | Tensor) -> Tensor:
        if self.options["estimator"] == "gamma":
            return gamma_threshold(magnitudes, float(q))
        return self._later_fit()(magnitudes, q)

    def _later_fit(self):
        """The estimator of the later stages (the gamma fit is the first stage's only)."""
        return exponential_threshold if self.options["estimator"] == "exponential" else gpareto_threshold

    def _fit_tails(self, magnitudes: Tensor, ratios: list[float]) -> Tensor:
        threshold = estimate = self._first_fit(magnitudes, ratios[0])
        tail = magnitudes
        for q in ratios[1:]:
            tail = exceedances(tail, estimate)
            if tail.numel() == 0:
                break
            estimate = self._later_fit()(tail, q)
            threshold = threshold + estimate
        return threshold

    def _fit_masks(self, magnitudes: Tensor, ratios: list[float]) -> Tensor:
        threshold = self._first_fit(magnitudes, ratios[0])
        for q in ratios[1:]:  # an empty mask's estimate is 0: the threshold stays
            threshold = threshold + self._later_fit()(magnitudes - threshold, q, magnitudes > threshold)
        return threshold

    def threshold(self, magnitudes: Tensor, bucket: Bucket) -> Tensor:
        return self.fitted_threshold(magnitudes, self._stages(bucket.names[0]))

    def _stages(self, key: str) -> int:
        return self.stage_counts.setdefault(key, min(self.options["stages"], self.max_stages()))

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        every, key = self.options["adapt_every"], bucket.names[0]
        adapting = every and (self.step + 1) % every == 0
        if adapting and key in self._measured:
            self.stage_counts[key] = self._adapted(key)
        payload = super().encode(flat, bucket)
        if adapting:
            self._measured[key] = (HostCopy(self.above), flat.numel())
        return payload

    def _adapted(self, key: str) -> int:
        """The bucket's stage count after its last measurement: one more where it selected over
        1.2δ, one fewer under 0.8δ."""
        count, n = self._measured.pop(key)
        achieved, density = int(count.value()) / n, self.options["density"]
        change = int(achieved > 1.2 * density) - int(achieved < 0.8 * density)
        return min(max(self._stages(key) + change, 1), self.max_stages())

    def extra_state(self) -> dict:
        measured = {key: [int(count.value()), n] for key, (count, n) in self._measured.items()}
        return {"stage_counts": dict(self.stage_counts), "measured": measured}

    def load_extra_state(self, state: dict) -> None:
        self.stage_counts = dict(state.get("stage_counts", {}))
        self._measured = {
            key: (HostCopy(torch.tensor(count)), n) for key, (count, n) in state.get("measured", {}).items()
        }
