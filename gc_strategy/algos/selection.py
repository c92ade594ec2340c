"""Positions of a flat vector chosen by magnitude: above a threshold, or the ``k`` largest.

On a GPU torch's own ``nonzero`` and ``topk``. On the CPU ``torch.topk`` of 1% of a large bucket
is many times slower than a selection among few candidates (docs/benchmarks/cpu_paths_cpu.md),
so the exact top-k there is a threshold from a strided sample that leaves a little over ``k``
candidates, then an exact ``argpartition`` among the candidates, with a quickselect of the k-th
largest as the fallback when the sample's threshold keeps too few; positions are compacted with
numpy's ``flatnonzero``.

NaN counts as larger than every threshold, as ``torch.topk`` orders it: a gradient holding NaN
keeps it visible in the average (for a loss scaler to see) instead of silently dropping it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

#: elements of the strided sample that sets the candidates' threshold (all of smaller vectors)
SAMPLE = 1 << 16


def at_least(magnitudes: Tensor, threshold: float | Tensor, strict: bool = False) -> Tensor:
    """int64 positions ``j`` (increasing) with ``magnitudes[j] >= threshold`` (``>`` when
    ``strict``), and those holding NaN."""
    if magnitudes.device.type != "cpu":
        below = magnitudes <= threshold if strict else magnitudes < threshold
        return torch.nonzero(~below).view(-1)
    values = magnitudes.numpy()
    below = np.less_equal(values, float(threshold)) if strict else np.less(values, float(threshold))
    return torch.from_numpy(np.flatnonzero(np.logical_not(below, out=below)))


def top_k(magnitudes: Tensor, k: int) -> Tensor:
    """int64 positions of the ``k`` largest ``magnitudes`` (NaN largest; among equal values any),
    in no particular order."""
    n = magnitudes.numel()
    if magnitudes.device.type != "cpu":
        return torch.topk(magnitudes, k, sorted=False).indices
    if k >= n:
        return torch.arange(n)
    if n > SAMPLE:
        candidates = at_least(magnitudes, _candidate_threshold(magnitudes, k), strict=True)
        if candidates.numel() >= k:
            values = magnitudes.numpy()[candidates.numpy()]
            return candidates[torch.from_numpy(np.argpartition(values, values.size - k)[values.size - k :])]
    return _top_k_by_kth_value(magnitudes, k)


def _candidate_threshold(magnitudes: Tensor, k: int) -> float:
    """A magnitude that about ``1.2 k + 3 sd`` elements exceed, from a strided sample of
    ``SAMPLE``: with high probability below the k-th largest, so every top-k element is a candidate.
    (Strictly above it: a gradient whose zeros fill most of a bucket, such as a 3x3 convolution
    on 1x1 maps, then leaves its nonzeros, not all of it.)"""
    n = magnitudes.numel()
    sample = magnitudes[:: n // SAMPLE]
    expected = sample.numel() * k / n
    rank = min(sample.numel(), math.ceil(1.2 * expected + 3 * math.sqrt(expected) + 1))
    return float(torch.topk(sample, rank, sorted=False).values.min())


def _top_k_by_kth_value(magnitudes: Tensor, k: int) -> Tensor:
    """The fallback: the k-th largest value by quickselect (``kthvalue``), everything above it and
    as many of the elements equal to it as are missing (``argpartition`` slows down ~20x on a
    vector that is mostly equal values)."""
    kth = torch.kthvalue(magnitudes, magnitudes.numel() - k + 1).values
    if kth.isnan():  # at least k NaN
        return torch.nonzero(magnitudes.isnan()).view(-1)[:k]
    above = at_least(magnitudes, kth, strict=True)
    ties = torch.from_numpy(np.flatnonzero(magnitudes.numpy() == kth.item())[: k - above.numel()])
    return torch.cat([above, ties])
