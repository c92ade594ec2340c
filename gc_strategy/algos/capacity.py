"""Selections by a threshold in a fixed number of slots (docs/algorithms.md §3): ``threshold``,
``dgc``, and the base of ``sidco`` (:mod:`gc_strategy.algos.sidco`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, HostCopy
from ..communicators import Communicator, Payload
from ..registry import Option
from .base import COMPRESSORS
from .sparse import DENSITY, SEED, Sparsifier, keep_count

#: a sampled threshold's sample holds at least this many entries above it
#: (:meth:`CapacitySparsifier.sampled_threshold`)
SAMPLED_ABOVE = 100

CAPACITY_OF_K = Option(1.3, float, low=1.0, help="payload slots C as a multiple of k (DGC's upper bound 1.3k)")


class CapacitySparsifier(Sparsifier):
    """Entries of ``|g|`` at or above a threshold (``above`` it where ``strict``), in a payload of
    fixed capacity ``C``: all of them where they fit, else the ``C`` largest of the first ``2C``
    of them in bucket order (:func:`~gc_strategy.kernels.select_above`). Slots left over carry
    distinct positions (possibly ones also sent) with the value 0; entries above the threshold
    that are not sent stay in the error-feedback memory, counted as ``overflow``.

    Why: the size of a threshold's selection is known only on the device. Reading it on the host
    (``nonzero``, then a length exchange) makes the host wait for the device in every bucket of
    every step; a fixed capacity keeps the payload's size on the host, and a fixed size travels by
    allgather without a length exchange. The math is DGC's hierarchical selection (Lin et al. 2018:
    a top-k over what a sampled threshold selects when it selects too many).
    """

    strict = False

    #: encodes whose counts are kept apart before they are summed
    KEPT_COUNTS = 64

    def __init__(self, **options) -> None:
        super().__init__(**options)
        #: per encode since the last metrics: the entries it selects without a capacity, the entries
        #: above its threshold (0-d tensors), and its capacity
        self._counts: list[tuple[Tensor, Tensor, int]] = []
        #: ``[selected without a capacity, sent]`` summed over encodes before those in ``_counts``
        self._folded: Tensor | None = None
        self._bounds: dict[tuple[int, torch.device], Tensor] = {}
        #: the capacities of the last tally's encodes and their device, and their bounds stacked
        self._stacked_bounds: tuple[tuple, Tensor | None] = ((), None)
        #: per bucket, the slots of its last encode that carry a selected entry
        self._flags: dict[int, Tensor] = {}

    def threshold(self, magnitudes: Tensor, bucket: Bucket) -> float | Tensor:
        raise NotImplementedError

    def sampled_threshold(
        self, magnitudes: Tensor, bucket: Bucket, fraction: float, least: int, ratio: float = 0.0
    ) -> Tensor:
        """A magnitude that about ``fraction`` of the bucket reaches: the ``k_s = ⌊fraction · m⌋``-th
        largest of ``m`` entries drawn at random (``ratio`` of the bucket, at least ``least`` and
        ``SAMPLED_ABOVE / fraction``; all of a small bucket), so that about ``SAMPLED_ABOVE``
        sampled entries lie above it and the count above it has a relative spread of about
        ``1/√SAMPLED_ABOVE`` (DGC's sampled threshold, Lin et al. 2018). For a selection of what
        lies strictly above it (``strict``) the ``(k_s + 1)``-th largest, so that ``k_s`` exceed
        it (the ``k_s``-th itself would leave ``k_s − 1``, none where ``k_s = 1``), or 0 where the
        sample has no more entries."""
        n = magnitudes.numel()
        least = max(least, math.ceil(SAMPLED_ABOVE / fraction))
        samples = min(n, max(least, math.ceil(ratio * n)))
        if samples >= n:
            sample = magnitudes
        else:
            generator = self.generator(bucket, magnitudes.device, shared=False)
            positions = torch.randint(n, (samples,), device=magnitudes.device, generator=generator)
            sample = magnitudes.index_select(0, positions)
        # the last of its sorted top k_s (a view: no reduction after the selection; CUDA's
        # kthvalue would select in one block)
        k = keep_count(fraction, samples) + int(self.strict)
        if k > samples:
            return sample.new_zeros(())
        return torch.topk(sample, k).values[-1]

    def capacity(self, n: int) -> int:
        """``C``, the slots of a bucket of ``n`` elements."""
        raise NotImplementedError

    def slots(self, bucket: Bucket) -> int:
        """``C`` for ``bucket``: its :meth:`capacity`, unless a subclass sizes it per bucket."""
        return self.capacity(bucket.numel)

    def demand(self, magnitudes: Tensor) -> Tensor | None:
        """The count of entries the method selects without a capacity (a 0-d tensor), where that
        is not the count above the threshold the selection uses; None where it is."""
        return None

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        magnitudes = self.magnitudes(flat, bucket)
        threshold = self.threshold(magnitudes, bucket)
        capacity = self.slots(bucket)
        demand = self.demand(magnitudes)
        indices, sent, above = kernels.select_above(magnitudes, threshold, capacity, self.strict)
        #: this encode's count of entries above the threshold (a 0-d tensor)
        self.above = above
        self._flags[bucket.index] = sent
        self._counts.append((above if demand is None else demand, above, capacity))
        if len(self._counts) > self.KEPT_COUNTS:  # metrics not read for a while
            self._folded = self._tally()
        self._elements += flat.numel()
        # a slot left over sends its position's entry times False: 0, or NaN where that entry is
        # inf or NaN, which lies above the threshold and is sent as well (the bucket is not finite)
        return kernels.sparse_payload(flat, indices, sent)

    def sent_positions(self, payload: Payload, bucket: Bucket) -> tuple[Tensor, Tensor]:
        """The slots' positions, each flagged where this bucket's last encode put a selected entry
        (the selection's mask, as DGC's masking reads it: also where the entry sent is 0)."""
        return self.positions(payload[-1], bucket), self._flags[bucket.index]

    def _tally(self) -> Tensor:
        """``[Σ demand, Σ min(above, C)]`` over the encodes counted (``C`` each one's capacity):
        three launches when the metrics are read (the bounds are stacked again only where the
        capacities changed), none in an encode. At least one encode is counted."""
        total = self._folded
        if self._counts:  # none where the last encode folded them
            rows = torch.stack([count for demand, above, _ in self._counts for count in (demand, above)]).view(-1, 2)
            key = (tuple(capacity for *_, capacity in self._counts), rows.device)
            if self._stacked_bounds[0] != key:
                bounds = torch.stack([self._bounds_of(capacity, rows.device) for capacity in key[0]])
                self._stacked_bounds = (key, bounds)
            counted = torch.minimum(rows, self._stacked_bounds[1]).sum(0)
            total = counted if total is None else total + counted
        self._counts, self._folded = [], None
        return total

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
        demand, selected = self._tally()
        self._selected = selected  # what fits is sent
        metrics = super().pop_metrics()
        # entries above the threshold that were not sent (the NaN that Threshold's demand leaves
        # out are sent)
        metrics["overflow"] = (demand - selected).clamp_min_(0)
        return metrics


@COMPRESSORS.register("threshold")
class Threshold(CapacitySparsifier):
    """Hard threshold, as in GRACE except for the boundary: send the entries with ``|g| > τ`` (GRACE
    keeps ``|g| ≥ τ``; the two differ only on ties), at most ``C`` of them, the largest
    (:class:`CapacitySparsifier`).

    ``C`` is ``⌈capacity · n⌉`` where ``capacity`` is given: a bound on the bytes sent. By default
    it follows what the bucket needs, so that what exceeds ``τ`` goes: it starts at
    ``⌈0.1 n⌉``, and every ``adapt_every`` steps it is set from the largest count any rank sent
    at the previous adaptation step, ``m``: ``⌈1.25 m⌉`` where every rank's selection fitted,
    ``2C`` where one filled its slots (within ``[1, n]``). ``m`` is read from the gathered
    payloads, the same on every rank (so every rank keeps the same ``C``, which a fixed-size
    allgather needs), and reaches host memory an adaptation period after it is made, without
    the host waiting (:class:`~gc_strategy.bucket.HostCopy`, as SIDCo's stage counts). With counts
    above ``τ`` that vary by a few standard deviations from step to step, the 25% headroom leaves
    under 1% of them unsent in steady state (``tests/algos/test_threshold_capacity.py``).

    A fixed ``τ`` may let far more than ``C`` entries through (early in training, or a small
    ``τ``), and the selection ranks only the first ``2C`` of them. So the threshold used is
    ``max(τ, t)``, ``t`` a sampled estimate of the magnitude that ``1.5C`` entries exceed
    (:meth:`~CapacitySparsifier.sampled_threshold`): where more than ``1.5C`` exceed ``τ``, about
    ``1.5C`` exceed ``t``, within the ``2C`` candidates and at least ``C`` with high probability,
    so the ``C`` sent are the ``C`` largest of all."""

    OPTIONS = {
        "threshold": Option(0.01, float, low=0.0, low_open=True, help="τ"),
        "capacity": Option(
            None,
            float,
            low=0.0,
            high=1.0,
            low_open=True,
            optional=True,
            help="payload slots as a fraction of n (None: sized from what earlier steps sent)",
        ),
        "adapt_every": Option(5, int, low=1, help="steps between adaptations of the slots (capacity=None)"),
        "seed": SEED,
    }
    strict = True
    #: the sampled floor aims at this many entries per slot
    FLOOR_PER_SLOT = 1.5
    #: entries sampled for the floor at least
    MIN_SAMPLE = 4096
    #: the slots of a bucket before its first adaptation, as a fraction of its elements
    INITIAL_CAPACITY = 0.1
    #: slots per entry sent at the last adaptation step, where every selection fitted
    HEADROOM = 1.25

    def __init__(self, **options) -> None:
        super().__init__(**options)
        #: per bucket index: its size and its slots (capacity=None)
        self._slots: dict[int, tuple[int, int]] = {}
        #: per bucket index: the largest count sent by a rank at the last adaptation step, and the
        #: slots it had then
        self._measured: dict[int, tuple[HostCopy, int]] = {}

    def threshold(self, magnitudes: Tensor, bucket: Bucket) -> Tensor:
        fraction = min(1.0, self.FLOOR_PER_SLOT * self.slots(bucket) / magnitudes.numel())
        floor = self.sampled_threshold(magnitudes, bucket, fraction, self.MIN_SAMPLE)
        return floor.clamp_min(self.options["threshold"])

    def demand(self, magnitudes: Tensor) -> Tensor:
        """The finite entries above ``τ``: what overflow counts against (a NaN is always sent)."""
        return (magnitudes > self.options["threshold"]).sum()

    def capacity(self, n: int) -> int:
        fraction = self.options["capacity"]
        return max(1, math.ceil((self.INITIAL_CAPACITY if fraction is None else fraction) * n))

    def _adapting(self) -> bool:
        return self.options["capacity"] is None and (self.step + 1) % self.options["adapt_every"] == 0

    def slots(self, bucket: Bucket) -> int:
        if self.options["capacity"] is not None:
            return self.capacity(bucket.numel)
        n, slots = self._slots.get(bucket.index, (None, None))
        if n != bucket.numel:  # a new bucket (or a new cut of the buckets)
            slots = self.capacity(bucket.numel)
            self._measured.pop(bucket.index, None)
        if self._adapting() and bucket.index in self._measured:
            count, measured_slots = self._measured.pop(bucket.index)
            sent = int(count.value())
            slots = 2 * measured_slots if sent >= measured_slots else math.ceil(self.HEADROOM * sent)
            slots = min(bucket.numel, max(1, slots))
        self._slots[bucket.index] = (bucket.numel, slots)
        return slots

    def combine(
        self, received: list[Payload], bucket: Bucket, communicator: Communicator, out: Tensor | None = None
    ) -> Tensor:
        """The average, and at an adaptation step the largest count a rank sent (its nonzero
        values: a sent value exceeds ``τ > 0``, a slot left over carries 0)."""
        if self._adapting() and bucket.index not in self._measured:
            counts = torch.stack([torch.count_nonzero(self.values_of(payload, bucket)) for payload in received])
            self._measured[bucket.index] = (HostCopy(counts.max()), self._slots[bucket.index][1])
        return super().combine(received, bucket, communicator, out)

    def extra_state(self) -> dict:
        measured = {b: [int(count.value()), slots] for b, (count, slots) in self._measured.items()}
        return {"slots": {b: list(v) for b, v in self._slots.items()}, "measured": measured}

    def load_extra_state(self, state: dict) -> None:
        self._slots = {int(b): tuple(v) for b, v in state.get("slots", {}).items()}
        self._measured = {
            int(b): (HostCopy(torch.tensor(count)), slots) for b, (count, slots) in state.get("measured", {}).items()
        }

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
        threshold = self.sampled_threshold(
            magnitudes, bucket, density, self.options["min_sample"], self.options["sample_ratio"]
        )
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
