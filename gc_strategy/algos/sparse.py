"""Sparsifiers (docs/algorithms.md §3): ``randk``, and the bases of ``topk``
(:mod:`gc_strategy.algos.topk`) and of the selections by a threshold (:mod:`gc_strategy.algos.capacity`).

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

    def encode_with_residual(
        self, grad: Tensor, residual: Tensor, finite: Tensor, bucket: Bucket, into: Tensor | None = None
    ) -> Payload:
        """Residual error feedback without a dense decode: ``x = g + e`` is encoded, the sent values
        are subtracted from ``x`` at their (distinct) positions (0 where they travel exactly), and
        ``e ← x`` unless the bucket is not finite (``e`` then stays as it was). No new bucket-sized
        tensor. Where the flag is known on the host to be True (CPU) ``x`` is formed in ``into`` (``e``
        itself, or a second vector) in one dense pass; otherwise in the gradient buffer when it is
        fp32, then copied to ``into`` if finite (two passes)."""
        into = residual if into is None else into
        if finite_on_host(finite):
            x = residual.add_(grad) if into is residual else torch.add(residual, grad, out=into)
        else:
            x = grad.add_(residual) if grad.dtype == residual.dtype else torch.add(residual, grad.float())
        payload = self.encode(x, bucket)
        positions, sent = self.sent(payload, bucket)
        x.index_add_(0, positions, sent.to(x.dtype), alpha=-1)
        if x is not into:
            if into is not residual:  # its value where the bucket is not finite
                into.copy_(residual)
            assign_if_finite(into, x, finite)
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
        return kernels.sparse_payload(flat, indices)

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
    exceed ``1 − p`` (probability under 1e-15), where the slots left over hold other positions."""
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
