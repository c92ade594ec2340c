"""Sparsifiers (docs/algorithms.md §3): ``randk``, ``dgc``, ``threshold``, and the base of ``topk``
(:mod:`gc_strategy.algos.topk`).

Index-based sparsifiers send ``[values, int32 indices]`` and are aggregated by scatter-add: the
sum over ranks of each rank's sparse vector (overlapping indices add up), divided by ``W``.
``randk`` draws the same positions on every rank, so it sends values only and is summed by allreduce.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, assign_if_finite, finite_on_host
from ..communicators import Payload
from ..kernels import torch_ops
from ..registry import Option
from .base import COMPRESSORS, Compressor

DENSITY = Option(0.01, float, low=0.0, high=1.0, low_open=True, help="fraction of elements kept")
SEED = Option(0, int, low=0, help="seed of the random draws (mixed with step, bucket and rank)")


def scatter(bucket: Bucket, positions: Tensor, values: Tensor, out: Tensor | None = None) -> Tensor:
    """The dense vector with ``values`` at ``positions``, zeros elsewhere (written into ``out`` when
    given). A position may repeat where all but one of its values are 0 (a capacity payload's
    slots left over): the values are added, so those zeros change nothing."""
    dense = zeros(bucket, values, out)
    return dense.index_add_(0, positions, values.to(dense.dtype))


def zeros(bucket: Bucket, values: Tensor, out: Tensor | None) -> Tensor:
    """``out`` zeroed, or a new zero vector of the bucket's length in the dtype of ``values``."""
    return out.zero_() if out is not None else torch.zeros(bucket.numel, dtype=values.dtype, device=values.device)


def joined(tensors: list[Tensor]) -> Tensor:
    """The tensors concatenated; a single one as it is (no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


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
        """Residual error feedback without a dense decode: ``x = g + e`` is encoded, the sent values
        are subtracted from ``x`` at their (distinct) positions (0 where they travel exactly), and
        ``e ← x`` unless the bucket is not finite (``e`` then stays as it was). No new bucket-sized
        tensor. Where the flag is known on the host to be True (CPU) ``x`` is formed in ``e`` itself,
        one dense pass (``e += g``); otherwise in the gradient buffer when it is fp32, then copied to
        ``e`` if finite (two passes)."""
        if finite_on_host(finite):
            x = residual.add_(grad)
        else:
            x = grad.add_(residual) if grad.dtype == residual.dtype else torch.add(residual, grad.float())
        payload = self.encode(x, bucket)
        positions, sent = self.sent(payload, bucket)
        x.index_add_(0, positions, sent.to(x.dtype), alpha=-1)
        if x is not residual:
            assign_if_finite(residual, x, finite)
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

    def positions(self, indices: Tensor, bucket: Bucket) -> Tensor:
        """The bucket's positions of the payload's ``indices`` (of one or more ranks' payloads,
        concatenated), int32 or int64: gathers and ``index_add_`` take either, so the wire's int32
        indices are used as they are."""
        return indices

    def values_of(self, payload: Payload, bucket: Bucket) -> Tensor:
        """The sent values of a payload whose last tensor holds the indices."""
        return payload[0]

    def sent(self, payload: Payload, bucket: Bucket) -> tuple[Tensor, Tensor]:
        return self.positions(payload[-1], bucket), self.values_of(payload, bucket)

    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        values = joined([self.values_of(p, bucket) for p in gathered])
        indices = self.positions(joined([p[-1] for p in gathered]), bucket)
        total = zeros(bucket, values, out)
        return total.index_add_(0, indices, values.to(total.dtype), alpha=1 / len(gathered))

    def pop_metrics(self) -> dict[str, float | Tensor]:
        if not self._elements:
            return {}
        achieved = self._selected / self._elements
        self._selected = self._elements = 0
        return {"density_achieved": achieved, "density_target": self.target_density()}


class CapacitySparsifier(Sparsifier):
    """Entries of ``|g|`` at or above a threshold (``above`` it where ``strict``), in a payload of
    fixed capacity ``C``: all of them where they fit, else the ``C`` largest of the first ``2C``
    of them in bucket order (:func:`~gc_strategy.kernels.select_above`). Slots left over carry a
    position (possibly repeated) with the value 0; entries above the threshold that are not sent
    stay in the error-feedback memory, counted as ``overflow``.

    Why: the size of a threshold's selection is known only on the device. Reading it on the host
    (``nonzero``, then a length exchange) makes the host wait for the device in every bucket of
    every step; a fixed capacity keeps the payload's size on the host, and a fixed size travels by
    allgather without a length exchange. The math is DGC's hierarchical selection (Lin et al. 2018:
    a top-k over what a sampled threshold selects when it selects too many).
    """

    strict = False

    #: encodes whose counts are kept apart before they are summed into one
    KEPT_COUNTS = 64

    def __init__(self, **options) -> None:
        super().__init__(**options)
        #: per encode since the last metrics: the entries above the threshold, and of them those that fit
        self._counts: list[Tensor] = []
        self._bounds: dict[tuple[int, torch.device], Tensor] = {}
        #: per bucket, the slots of its last encode that carry a selected entry
        self._flags: dict[int, Tensor] = {}

    def threshold(self, magnitudes: Tensor, bucket: Bucket) -> float | Tensor:
        raise NotImplementedError

    def sampled_threshold(self, magnitudes: Tensor, bucket: Bucket, fraction: float, least: int) -> Tensor:
        """A magnitude that about ``fraction`` of the bucket reaches: the ``⌊fraction · m⌋``-th
        largest of ``m`` entries drawn at random (``sample_ratio`` of the bucket where the options
        have one, at least ``least`` and ``SAMPLED_ABOVE / fraction``; all of a small bucket),
        so that about ``SAMPLED_ABOVE`` sampled entries lie above it and the count above it has a
        relative spread of about ``1/√SAMPLED_ABOVE`` (DGC's sampled threshold, Lin et al. 2018)."""
        n = magnitudes.numel()
        least = max(least, math.ceil(SAMPLED_ABOVE / fraction))
        samples = min(n, max(least, math.ceil(self.options.get("sample_ratio", 0.0) * n)))
        if samples >= n:
            sample = magnitudes
        else:
            generator = self.generator(bucket, magnitudes.device, shared=False)
            positions = torch.randint(n, (samples,), device=magnitudes.device, generator=generator)
            sample = magnitudes.index_select(0, positions)
        # the last of its sorted top k_s (a view: no reduction after the selection; CUDA's
        # kthvalue would select in one block)
        return torch.topk(sample, keep_count(fraction, samples)).values[-1]

    def capacity(self, n: int) -> int:
        """``C``, the slots of a bucket of ``n`` elements."""
        raise NotImplementedError

    def demand(self, magnitudes: Tensor) -> Tensor | None:
        """The count of entries the method selects without a capacity (a 0-d tensor), where that
        is not the count above the threshold the selection uses; None where it is."""
        return None

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        magnitudes = self.magnitudes(flat, bucket)
        threshold = self.threshold(magnitudes, bucket)
        capacity = self.capacity(flat.numel())
        demand = self.demand(magnitudes)
        indices, sent, above = kernels.select_above(magnitudes, threshold, capacity, self.strict)
        #: this encode's count of entries above the threshold (a 0-d tensor)
        self.above = above
        self._flags[bucket.index] = sent
        counts = above if demand is None else torch.stack([demand, above])  # clamped: [demand, sent]
        self._counts.append(counts.clamp_max(self._bounds_of(capacity, above.device)))
        if len(self._counts) > self.KEPT_COUNTS:  # metrics not read for a while
            self._counts = [torch.stack(self._counts).sum(0)]
        self._elements += flat.numel()
        # a slot left over sends 0 (its position's entry times False; NaN where that entry is not
        # finite, and the bucket's entries above the threshold then hold it too)
        return [flat.index_select(0, indices).mul_(sent), indices.to(torch.int32)]

    def sent_positions(self, payload: Payload, bucket: Bucket) -> tuple[Tensor, Tensor]:
        """The slots' positions, each flagged where this bucket's last encode put a selected entry
        (the selection's mask, as DGC's masking reads it: also where the entry sent is 0)."""
        return self.positions(payload[-1], bucket), self._flags[bucket.index]

    def _bounds_of(self, capacity: int, device: torch.device) -> Tensor:
        """``[no bound, C]``: clamped by it, a count becomes itself and the part of it that fits
        (made once per capacity)."""
        key = (capacity, device)
        if key not in self._bounds:
            bounds = self._bounds[key] = torch.full((2,), capacity, dtype=torch.int64, device=device)
            bounds[:1].fill_(torch.iinfo(torch.int64).max)  # a fill: an item assignment would copy from the host
        return self._bounds[key]

    def pop_metrics(self) -> dict[str, float | Tensor]:
        if not self._elements:
            return {}
        above, selected = torch.stack(self._counts).sum(0)
        self._selected = selected  # what fits is sent
        metrics = super().pop_metrics()
        # entries above the threshold that were not sent (the NaN that Threshold's demand leaves
        # out are sent)
        metrics["overflow"] = (above - selected).clamp_min_(0)
        self._counts = []
        return metrics


#: DGC's sample holds at least this many entries above its threshold (see :class:`DGC`)
SAMPLED_ABOVE = 100

CAPACITY_OF_K = Option(1.3, float, low=1.0, help="payload slots C as a multiple of k (DGC's upper bound 1.3k)")


@COMPRESSORS.register("threshold")
class Threshold(CapacitySparsifier):
    """Hard threshold, as in GRACE except for the boundary: send the entries with ``|g| > τ`` (GRACE
    keeps ``|g| ≥ τ``; the two differ only on ties), at most ``C = ⌈capacity · n⌉`` of them, the
    largest (:class:`CapacitySparsifier`).

    A fixed ``τ`` may let far more than ``C`` entries through (early in training, or a small
    ``τ``), and the selection ranks only the first ``2C`` of them. So the threshold used is
    ``max(τ, t)``, ``t`` a sampled estimate of the ``1.5C``-th largest magnitude
    (:meth:`~CapacitySparsifier.sampled_threshold`): where more than ``1.5C`` exceed ``τ``, about
    ``1.5C`` exceed ``t``, within the ``2C`` candidates and at least ``C`` with high probability,
    so the ``C`` sent are the ``C`` largest of all."""

    OPTIONS = {
        "threshold": Option(0.01, float, low=0.0, low_open=True, help="τ"),
        "capacity": Option(0.1, float, low=0.0, high=1.0, low_open=True, help="payload slots as a fraction of n"),
        "seed": SEED,
    }
    strict = True
    #: the sampled floor aims at this many entries per slot
    FLOOR_PER_SLOT = 1.5
    #: entries sampled for the floor at least
    MIN_SAMPLE = 4096

    def threshold(self, magnitudes: Tensor, bucket: Bucket) -> Tensor:
        fraction = min(1.0, self.FLOOR_PER_SLOT * self.capacity(magnitudes.numel()) / magnitudes.numel())
        floor = self.sampled_threshold(magnitudes, bucket, fraction, self.MIN_SAMPLE)
        return floor.clamp_min(self.options["threshold"])

    def demand(self, magnitudes: Tensor) -> Tensor:
        """The finite entries above ``τ``: what overflow counts against (a NaN is always sent)."""
        return (magnitudes > self.options["threshold"]).sum()

    def capacity(self, n: int) -> int:
        return max(1, math.ceil(self.options["capacity"] * n))

    def target_density(self) -> float:
        return float("nan")  # no target: the density follows the gradients


@COMPRESSORS.register("dgc")
class DGC(CapacitySparsifier):
    """Deep Gradient Compression's selection (Lin et al., ICLR 2018): estimate the top-δ threshold
    from a random sample of ``|g|`` (``sample_ratio`` of the bucket, at least ``min_sample``
    elements and at least ``SAMPLED_ABOVE / δ``, all of them for small buckets) and send what it
    selects, at most ``C = ⌈capacity · k⌉`` entries, the largest (:class:`CapacitySparsifier`):
    the paper's hierarchical selection, a top-k over what the sampled threshold selects when it
    selects too many. Pair it with ``memory='dgc'`` (momentum correction, masking).

    The count above the threshold is ``k`` within sampling error: the fraction of the bucket above
    the ``m``-th largest of a random sample has relative spread ``1/√m``, so with ``m ≥ 100`` sampled
    entries above it the count falls in ``[0.7k, 1.3k]`` with probability about 0.997. GRACE's
    implementation instead corrects the threshold afterwards, scaling it by 1.3 or 0.7 while the
    count lies outside that window; ``adjust_rounds`` (default 0) runs that many such rounds, each
    a pass over the bucket and seven small launches (the counts stay on the device).

    Density warm-up (the paper's exponential schedule from 25% to δ): with ``warmup_steps`` > 0 the
    density at step ``s`` is ``0.25 · (δ/0.25)^(s/warmup_steps)`` until ``warmup_steps``.
    """

    OPTIONS = {
        "density": DENSITY,
        "sample_ratio": Option(0.01, float, low=0.0, high=1.0, low_open=True),
        "min_sample": Option(4096, int, low=1),
        "adjust_rounds": Option(0, int, low=0, help="GRACE's threshold adjustment rounds"),
        "capacity": CAPACITY_OF_K,
        "warmup_steps": Option(0, int, low=0, help="steps of exponential density warm-up (0: off)"),
        "seed": SEED,
    }

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._adjust: dict[torch.device, tuple[Tensor, ...]] = {}

    def density_now(self) -> float:
        density, warmup = self.options["density"], self.options["warmup_steps"]
        if warmup and self.step < warmup and density < 0.25:
            return 0.25 * (density / 0.25) ** (self.step / warmup)
        return density

    def target_density(self) -> float:
        return self.density_now()

    def capacity(self, n: int) -> int:
        return min(n, math.ceil(self.options["capacity"] * keep_count(self.density_now(), n)))

    def threshold(self, magnitudes: Tensor, bucket: Bucket) -> Tensor:
        n = magnitudes.numel()
        density = self.density_now()
        k = keep_count(density, n)
        threshold = self.sampled_threshold(magnitudes, bucket, density, self.options["min_sample"])
        rounds = self.options["adjust_rounds"]
        if kernels.in_host_memory(magnitudes.device):  # a count costs no device wait: stop at the first fit
            for round_ in range(rounds + 1):
                count = kernels.positions_at_least(magnitudes, threshold).numel()
                if 0.7 * k <= count <= 1.3 * k or round_ == rounds:
                    return threshold
                threshold = threshold * (1.3 if count > 1.3 * k else 0.7)
        up, down, keep = self._factors(magnitudes.device)
        for _ in range(rounds):  # a threshold in the window is kept: its count stays in the window
            count = (magnitudes >= threshold).sum()
            threshold = threshold * torch.where(count > 1.3 * k, up, torch.where(count < 0.7 * k, down, keep))
        return threshold

    def _factors(self, device: torch.device) -> tuple[Tensor, ...]:
        """0-d tensors 1.3, 0.7 and 1 on ``device``, made once: a Python number in ``where`` would
        launch a fill on every use."""
        if device not in self._adjust:
            self._adjust[device] = tuple(torch.full((), f, device=device) for f in (1.3, 0.7, 1.0))
        return self._adjust[device]


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


#: the device draw's keys above ``1 − p`` number ``p·n = k + KEYS_MARGIN(k)`` on average
def keys_margin(k: float) -> float:
    """Eight standard deviations of a count of about ``k`` and 40 more: a binomial count falls
    that far below its mean with probability under 1e-15 (Poisson-like small counts included)."""
    return 8 * math.sqrt(k) + 40


def sample_on_device(n: int, k: int, generator: torch.Generator, keys: Tensor) -> tuple[Tensor, Tensor]:
    """``k`` positions of ``range(n)`` in increasing order, every k-subset equally likely, with no
    host wait: the positions of the ``k`` largest of ``n`` iid uniform keys (drawn into ``keys``,
    ``n`` floats) form a uniform k-subset. They are found among the keys above ``1 − p``, where
    ``p·n = k + keys_margin(k)``: compacted in order into ``size = p·n + keys_margin(p·n)``
    candidates, a top-k among them, a sort of ``k`` (one random pass, one comparison and a scan
    over the bucket; a top-k over it would take several passes). With torch < 2.6 on CUDA, a top-k
    over all the keys. Returns the positions and a flag each: True unless fewer than ``k`` keys
    exceed ``1 − p`` (probability under 1e-15), where the slots left over hold position 0."""
    keys.uniform_(generator=generator)
    expected = min(n, k + keys_margin(k))
    size = min(n, math.ceil(expected + keys_margin(expected)))
    if not torch_ops.compacts(keys):
        every = torch.ones(k, dtype=torch.bool, device=keys.device)
        return torch.topk(keys, k, sorted=False).indices.sort().values, every
    drawn = keys >= 1.0 - expected / n
    candidates, _, chosen, count = torch_ops.top_k_of_compacted(keys, drawn, k, size)
    chosen = chosen.sort().values  # increasing slots: increasing positions
    return candidates.index_select(0, chosen), chosen < count


@COMPRESSORS.register("randk")
class RandK(_Positional):
    """Random-k: ``k = max(1, ⌊δn⌋)`` positions drawn uniformly without replacement from a seed
    shared by all ranks (global seed, step, bucket), so only the values travel and they are summed
    by allreduce. With ``unbiased`` the values are scaled by ``n/k`` (then ``E[ĝ] = g``).

    The positions are drawn where the bucket lives, with nothing sent or copied: in host memory by
    :func:`sample_without_replacement`, on an accelerator by :func:`sample_on_device` from a device
    generator, whose draws agree across ranks on the same device model (the random kernels' launch
    grid follows the number of multiprocessors) and torch version. :meth:`check_group` verifies at
    start-up that every rank draws the same.
    """

    OPTIONS = {"density": DENSITY, "unbiased": Option(False, bool), "seed": SEED}
    summable = True

    def __init__(self, **options) -> None:
        super().__init__(**options)
        #: index -> ((step, numel), positions, their flags on an accelerator)
        self._drawn: dict[int, tuple[tuple[int, int], Tensor, Tensor | None]] = {}

    def _draw(self, bucket: Bucket, device: torch.device) -> tuple[Tensor, Tensor | None]:
        """This step's positions for ``bucket`` and, on an accelerator, their flags (see
        :func:`sample_on_device`), drawn once per bucket and step and reused by encode and decode
        (several buckets are in flight at once)."""
        drawn_for, positions, flags = self._drawn.get(bucket.index, (None, None, None))
        if drawn_for != (self.step, bucket.numel):
            k = keep_count(self.options["density"], bucket.numel)
            generator = self.generator(bucket, device, shared=True)
            if kernels.in_host_memory(device):
                positions, flags = sample_without_replacement(bucket.numel, k, generator), None
            else:
                positions, flags = sample_on_device(bucket.numel, k, generator, self.workspace("keys", bucket))
            self._drawn[bucket.index] = ((self.step, bucket.numel), positions, flags)
        return positions, flags

    def check_group(self, group: Any, buckets: list[Bucket]) -> None:
        """Refuse, before any step, ranks whose accelerators draw other positions from the same seed."""
        if not buckets or self.world_size == 1 or kernels.in_host_memory(buckets[0].device):
            return
        largest = max(buckets, key=lambda b: b.numel)
        drawn = self._draw(largest, largest.device)[0].double()
        fingerprint = torch.stack([drawn.sum(), drawn.square().sum()])
        every = [torch.empty_like(fingerprint) for _ in range(self.world_size)]
        dist.all_gather(every, fingerprint, group=group)
        differing = [rank for rank, other in enumerate(every) if not torch.equal(other, every[0])]
        if differing:
            raise ValueError(
                f"compressor 'randk': rank(s) {differing} drew other positions than rank 0 from the same seed. "
                "Draws on accelerators agree only between devices of one model and one torch version; use the "
                "same on every rank, or compressor='topk'"
            )

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        positions, flags = self._draw(bucket, flat.device)
        values = flat.index_select(0, positions)
        return [values if flags is None else values.mul_(flags)]  # a slot left over sends 0

    def average(self, summed: Payload, bucket: Bucket, world_size: int, out: Tensor | None = None) -> Tensor:
        """The summed values divided by ``W`` before the scatter (k divisions, not n)."""
        positions, values = self.sent(summed, bucket)
        return scatter(bucket, positions, values / world_size, out)

    def sent(self, payload: Payload, bucket: Bucket) -> tuple[Tensor, Tensor]:
        (values,) = payload
        scale = bucket.numel / values.numel() if self.options["unbiased"] else 1.0
        return self._draw(bucket, values.device)[0], values * scale
