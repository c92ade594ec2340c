"""The CPU's variants of the kernels, through numpy where it is faster there than torch's
(each measured against the torch form in docs/benchmarks/cpu_paths_cpu.md), and plain loops
where a few slices beat per-element gathers."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from . import torch_ops

#: elements of the strided sample that sets top-k's candidate threshold (all of smaller vectors)
SAMPLE = 1 << 16

_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def nonzero_positions(dense: Tensor) -> Tensor:
    """int64 positions of the nonzero (or NaN) elements, through numpy's comparison and
    ``flatnonzero`` of its bool result (faster than ``torch.nonzero``)."""
    if dense.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.flatnonzero(np.not_equal(dense.numpy(), 0)))
    return torch.nonzero(dense).flatten()


def positions_at_least(magnitudes: Tensor, threshold: float | Tensor, strict: bool) -> Tensor:
    values = magnitudes.numpy()
    below = np.less_equal(values, float(threshold)) if strict else np.less(values, float(threshold))
    return torch.from_numpy(np.flatnonzero(np.logical_not(below, out=below)))


def top_k(magnitudes: Tensor, k: int) -> Tensor:
    """``torch.topk`` of 1% of a large bucket is many times slower on the CPU than a selection among
    few candidates: a threshold from a strided sample leaves a little over ``k`` candidates, then an
    exact ``argpartition`` among them, with a quickselect of the k-th largest as the fallback when
    the sample's threshold keeps too few."""
    n = magnitudes.numel()
    if k >= n:
        return torch.arange(n)
    if n > SAMPLE:
        candidates = positions_at_least(magnitudes, _candidate_threshold(magnitudes, k), strict=True)
        if candidates.numel() >= k:
            values = magnitudes.numpy()[candidates.numpy()]
            return candidates[torch.from_numpy(np.argpartition(values, values.size - k)[values.size - k :])]
    return _top_k_by_kth_value(magnitudes, k)


def select_above(
    magnitudes: Tensor, threshold: float | Tensor, capacity: int, strict: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One pass finds the entries above the threshold (their count is free on the host). More than
    ``capacity``: the largest of the first ``CANDIDATES · capacity`` of them, as the torch variant
    (``argpartition`` among them, NaN largest); fewer: the first positions not among them fill the
    slots left over (a full top-k would cost ten times more)."""
    selected = positions_at_least(magnitudes, threshold, strict)
    count = selected.numel()
    if count > capacity:
        candidates = selected[: torch_ops.CANDIDATES * capacity]
        values = np.nan_to_num(magnitudes.numpy()[candidates.numpy()], nan=np.inf)
        keep = np.argpartition(values, values.size - capacity)[values.size - capacity :]
        return candidates[torch.from_numpy(keep)], torch.ones(capacity, dtype=torch.bool), torch.tensor(count)
    others = np.setdiff1d(np.arange(capacity + count), selected.numpy(), assume_unique=True)[: capacity - count]
    sent = torch.zeros(capacity, dtype=torch.bool)
    sent[:count] = True
    return torch.cat([selected, torch.from_numpy(others)]), sent, torch.tensor(count)


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
    above = positions_at_least(magnitudes, kth, strict=True)
    ties = torch.from_numpy(np.flatnonzero(magnitudes.numpy() == kth.item())[: k - above.numel()])
    return torch.cat([above, ties])


def exceedances(magnitudes: Tensor, threshold: float | Tensor) -> Tensor:
    """numpy's boolean indexing, faster than torch's on the CPU."""
    values = magnitudes.numpy()
    return torch.from_numpy(values[values > float(threshold)])


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """1-bit codes through ``np.packbits`` (``bitorder="little"`` is the wire layout)."""
    if bits != 1:
        return torch_ops.pack_bits(codes, bits)
    return torch.from_numpy(np.packbits(codes.reshape(-1).contiguous().numpy(), bitorder="little"))


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    if bits != 1:
        return torch_ops.unpack_bits(packed, bits, n)
    return torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), count=n, bitorder="little"))


def frexp_into(a: Tensor, mantissa: Tensor, exponent: Tensor) -> tuple[Tensor, Tensor]:
    np.frexp(a.numpy(), mantissa.numpy(), exponent.numpy())
    return mantissa, exponent


def fill_where_zero(target: Tensor, a: Tensor, value: int) -> None:
    np.putmask(target.numpy(), a.numpy() == 0, value)


def uniform_(out: Tensor, seed: int) -> Tensor:
    """numpy's PCG64 draws faster than torch's CPU generator."""
    np.random.default_rng(seed).random(out=out.numpy(), dtype=np.float32)
    return out


def sum_per_tensor(values: Tensor, offsets: list[int], numels: list[int], magnitudes: bool) -> Tensor:
    """One sum per tensor's slice (far faster than scattered adds), magnitudes slice by slice (a
    tensor-sized temporary each, not a bucket-sized one)."""
    slices = (values[o : o + n] for o, n in zip(offsets, numels))
    return torch.stack([(piece.abs() if magnitudes else piece).sum(0) for piece in slices])


def select_per_tensor(
    mask: Tensor, if_true: Tensor, if_false: Tensor, offsets: list[int], numels: list[int], out: Tensor | None
) -> Tensor:
    """``where`` over per-element gathers is slow on the CPU; instead, per tensor's slice, the
    result's bit pattern is ``no ^ m·(yes ^ no)`` with ``m ∈ {0, 1}`` (exactly one of the two values)."""
    dtype = torch.promote_types(if_true.dtype, if_false.dtype)
    as_int = _SAME_WIDTH_INT[dtype]
    yes_bits, no_bits = (values.to(dtype).view(as_int).tolist() for values in (if_true, if_false))
    out = mask.to(as_int) if out is None else out.view(as_int).copy_(mask)
    for o, n, yes, no in zip(offsets, numels, yes_bits, no_bits):
        out[o : o + n].mul_(yes ^ no).bitwise_xor_(no)
    return out.view(dtype)


def row_max_magnitudes(rows: Tensor, out: Tensor) -> Tensor:
    """``max(−min, max)`` of each row: ``aminmax`` is the CPU's fastest pass (the infinity norm is
    far slower there)."""
    low, high = torch.aminmax(rows, dim=1)
    return torch.maximum(low.neg_(), high, out=out)


def all_finite(flat: Tensor) -> Tensor:
    """``aminmax`` propagates NaN and shows ±inf at an end: on the CPU one pass, 17x faster than
    torch's infinity norm."""
    low, high = torch.aminmax(flat)
    return torch.isfinite(low) & torch.isfinite(high)


def assign_if_finite(target: Tensor, value: Tensor, finite: Tensor) -> None:
    """A branch on the flag, read on the host for free: a copy is cheaper than ``where``
    broadcasting a 0-d condition."""
    if finite:
        target.copy_(value)
