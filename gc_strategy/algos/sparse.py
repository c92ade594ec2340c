"""Sparsifiers (docs/algorithms.md §3): ``topk``, ``randk``, ``dgc``, ``threshold``.

Index-based sparsifiers send ``[values, int32 indices]`` and are aggregated by scatter-add: the
sum over ranks of each rank's sparse vector (overlapping indices add up), divided by ``W``.
``randk`` draws the same positions on every rank, so it sends values only and is summed by allreduce.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, assign_if_finite, finite_on_host
from ..communicators import Payload
from ..registry import Option
from .base import COMPRESSORS, Compressor

DENSITY = Option(0.01, float, low=0.0, high=1.0, low_open=True, help="fraction of elements kept")
SEED = Option(0, int, low=0, help="seed of the random draws (mixed with step, bucket and rank)")


def scatter(bucket: Bucket, positions: Tensor, values: Tensor, out: Tensor | None = None) -> Tensor:
    """The dense vector with ``values`` at the (distinct) ``positions``, zeros elsewhere (written
    into ``out`` when given)."""
    dense = zeros(bucket, values, out)
    return dense.scatter_(0, positions, values.to(dense.dtype))


def zeros(bucket: Bucket, values: Tensor, out: Tensor | None) -> Tensor:
    """``out`` zeroed, or a new zero vector of the bucket's length in the dtype of ``values``."""
    return out.zero_() if out is not None else torch.zeros(bucket.numel, dtype=values.dtype, device=values.device)


def keep_count(density: float, n: int) -> int:
    """``k = max(1, floor(δ n))``."""
    return max(1, int(density * n))


class _Positional(Compressor):
    """A payload that decodes to values at a few positions, zeros elsewhere (topk, randk, ...)."""

    def sent(self, payload: Payload, bucket: Bucket) -> tuple[Tensor, Tensor]:
        """The positions and the decoded values there (what error feedback subtracts)."""
        raise NotImplementedError

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        return scatter(bucket, *self.sent(payload, bucket))

    def sent_positions(self, payload: Payload, bucket: Bucket) -> Tensor:
        return self.sent(payload, bucket)[0]  # no dense decode to search

    def decode_into(self, payload: Payload, bucket: Bucket, scratch: Tensor) -> Tensor:
        return scatter(bucket, *self.sent(payload, bucket), out=scratch)

    def encode_with_residual(self, grad: Tensor, residual: Tensor, finite: Tensor, bucket: Bucket) -> Payload:
        """Residual error feedback without a dense decode: ``x = g + e`` is encoded, then ``e ← x``
        except at the sent positions, where ``e ← x − sent`` (0 where the values travel exactly);
        ``e`` is left as it was when the bucket is not finite. No new bucket-sized tensor. Where the
        flag is known on the host to be True (CPU) ``x`` is formed in ``e`` itself, one dense pass
        (``e += g``); otherwise in the gradient buffer when it is fp32, then copied to ``e`` if
        finite (two passes)."""
        if finite_on_host(finite):
            x = residual.add_(grad)
        else:
            x = grad.add_(residual) if grad.dtype == residual.dtype else torch.add(residual, grad.float())
        payload = self.encode(x, bucket)
        positions, sent = self.sent(payload, bucket)
        at_positions = torch.where(finite, x.index_select(0, positions) - sent, residual.index_select(0, positions))
        if x is not residual:
            assign_if_finite(residual, x, finite)
        residual.scatter_(0, positions, at_positions)
        return payload


class Sparsifier(_Positional):
    """Values + int32 indices, aggregated by scatter-add; tracks achieved vs target density."""

    summable = False

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._selected = 0
        self._elements = 0

    def select(self, flat: Tensor, bucket: Bucket) -> Tensor:
        """Indices (int64) of the elements to send."""
        raise NotImplementedError

    def target_density(self) -> float:
        return self.options["density"]

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        indices = self.select(flat, bucket)
        self._selected += indices.numel()
        self._elements += flat.numel()
        return [flat.index_select(0, indices), indices.to(torch.int32)]

    def sent(self, payload: Payload, bucket: Bucket) -> tuple[Tensor, Tensor]:
        values, indices = payload
        return indices.long(), values

    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        values = torch.cat([p[0] for p in gathered])
        indices = torch.cat([p[1] for p in gathered]).long()
        total = zeros(bucket, values, out)
        return total.index_add_(0, indices, values.div_(len(gathered)).to(total.dtype))

    def pop_metrics(self) -> dict[str, float]:
        if not self._elements:
            return {}
        achieved = self._selected / self._elements
        self._selected = self._elements = 0
        return {"density_achieved": achieved, "density_target": self.target_density()}


@COMPRESSORS.register("topk")
class TopK(Sparsifier):
    """Top-k (Aji & Heafield, EMNLP 2017; Stich et al., NeurIPS 2018): the ``k = max(1, ⌊δn⌋)``
    entries of largest ``|g|``, exactly. Fixed size: every rank sends ``k`` values + ``k`` indices."""

    OPTIONS = {"density": DENSITY}

    def select(self, flat: Tensor, bucket: Bucket) -> Tensor:
        return kernels.top_k(self.magnitudes(flat, bucket), keep_count(self.options["density"], flat.numel()))


@COMPRESSORS.register("threshold")
class Threshold(Sparsifier):
    """Hard threshold, as in GRACE except for the boundary: send every entry with ``|g| > τ`` (GRACE
    keeps ``|g| ≥ τ``; the two differ only on ties). Variable size."""

    OPTIONS = {"threshold": Option(0.01, float, low=0.0, low_open=True, help="τ")}
    variable_size = True

    def select(self, flat: Tensor, bucket: Bucket) -> Tensor:
        return kernels.positions_at_least(self.magnitudes(flat, bucket), self.options["threshold"], strict=True)

    def target_density(self) -> float:
        return float("nan")  # no target: the density follows the gradients


@COMPRESSORS.register("dgc")
class DGC(Sparsifier):
    """Deep Gradient Compression's selection (Lin et al., ICLR 2018): estimate the top-δ threshold
    from a random sample of ``|g|`` (``sample_ratio`` of the bucket, at least ``min_sample``
    elements, all of them for small buckets), select ``|g| ≥ thr``; while the count is outside
    ``[0.7k, 1.3k]`` scale ``thr`` by 1.3 or 0.7 (``adjust_rounds`` times), then fall back to exact
    top-k. Variable size. Pair it with ``memory='dgc'`` (momentum correction, masking).

    Density warm-up (the paper's exponential schedule from 25% to δ): with ``warmup_steps`` > 0 the
    density at step ``s`` is ``0.25 · (δ/0.25)^(s/warmup_steps)`` until ``warmup_steps``.
    """

    OPTIONS = {
        "density": DENSITY,
        "sample_ratio": Option(0.01, float, low=0.0, high=1.0, low_open=True),
        "min_sample": Option(4096, int, low=1),
        "adjust_rounds": Option(3, int, low=0),
        "warmup_steps": Option(0, int, low=0, help="steps of exponential density warm-up (0: off)"),
        "seed": SEED,
    }
    variable_size = True

    def density_now(self) -> float:
        density, warmup = self.options["density"], self.options["warmup_steps"]
        if warmup and self.step < warmup and density < 0.25:
            return 0.25 * (density / 0.25) ** (self.step / warmup)
        return density

    def target_density(self) -> float:
        return self.density_now()

    def select(self, flat: Tensor, bucket: Bucket) -> Tensor:
        magnitudes = self.magnitudes(flat, bucket)
        n = flat.numel()
        density = self.density_now()
        k = keep_count(density, n)
        samples = min(n, max(self.options["min_sample"], math.ceil(self.options["sample_ratio"] * n)))
        if samples >= n:
            sample = magnitudes
        else:
            positions = torch.randint(
                n, (samples,), device=flat.device, generator=self.generator(bucket, flat.device, shared=False)
            )
            sample = magnitudes.index_select(0, positions)
        threshold = torch.topk(sample, keep_count(density, samples), sorted=False).values.min()
        for _ in range(self.options["adjust_rounds"] + 1):
            selected = kernels.positions_at_least(magnitudes, threshold)
            count = selected.numel()
            if 0.7 * k <= count <= 1.3 * k:
                return selected
            threshold = threshold * (1.3 if count > 1.3 * k else 0.7)
        return kernels.top_k(magnitudes, k)


def sample_without_replacement(n: int, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct positions of ``range(n)`` in increasing order, every k-subset equally likely,
    in O(k log k) rather than ``randperm(n)``'s O(n): draw iid positions until at least ``k``
    distinct ones are known (the set of distinct values of iid uniform draws, given its size ``m``,
    is a uniform m-subset), then drop a uniform ``m − k`` of them, chosen the same way. Sorted
    positions make the gathers and scatters at them sweep memory forwards."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    draws = k + 2 * k * k // n + 64  # about k²/2n collisions expected
    if draws >= n:  # as many draws as positions: a permutation costs no more
        return torch.randperm(n, generator=generator)[:k].sort().values
    dtype = torch.int32 if n < 2**31 else torch.int64  # unique (a sort) is ~2x faster on int32
    distinct = torch.empty(0, dtype=dtype)
    while distinct.numel() < k:
        distinct = torch.unique(torch.cat([distinct, torch.randint(n, (draws,), generator=generator, dtype=dtype)]))
    keep = torch.ones(distinct.numel(), dtype=torch.bool)
    keep[sample_without_replacement(distinct.numel(), distinct.numel() - k, generator)] = False
    return distinct[keep].long()


@COMPRESSORS.register("randk")
class RandK(_Positional):
    """Random-k: ``k = max(1, ⌊δn⌋)`` positions drawn uniformly without replacement from a seed
    shared by all ranks (global seed, step, bucket), so only the values travel and they are summed
    by allreduce. With ``unbiased`` the values are scaled by ``n/k`` (then ``E[ĝ] = g``)."""

    OPTIONS = {"density": DENSITY, "unbiased": Option(False, bool), "seed": SEED}
    summable = True

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._drawn: dict[int, tuple[tuple[int, int], Tensor]] = {}  # index -> ((step, numel), positions)

    def _positions(self, bucket: Bucket, device: torch.device) -> Tensor:
        """This step's positions for ``bucket``, drawn once per bucket and step and reused by encode
        and decode (several buckets are in flight at once)."""
        drawn_for, positions = self._drawn.get(bucket.index, (None, None))
        if drawn_for != (self.step, bucket.numel):
            k = keep_count(self.options["density"], bucket.numel)
            generator = self.generator(bucket, torch.device("cpu"), shared=True)
            positions = sample_without_replacement(bucket.numel, k, generator).to(device)
            self._drawn[bucket.index] = ((self.step, bucket.numel), positions)
        return positions

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        return [flat.index_select(0, self._positions(bucket, flat.device))]

    def average(self, summed: Payload, bucket: Bucket, world_size: int, out: Tensor | None = None) -> Tensor:
        """The summed values divided by ``W`` before the scatter (k divisions, not n)."""
        positions, values = self.sent(summed, bucket)
        return scatter(bucket, positions, values / world_size, out)

    def sent(self, payload: Payload, bucket: Bucket) -> tuple[Tensor, Tensor]:
        (values,) = payload
        scale = bucket.numel / values.numel() if self.options["unbiased"] else 1.0
        return self._positions(bucket, values.device), values * scale
