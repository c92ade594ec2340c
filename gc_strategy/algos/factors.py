"""The batched linear algebra of PowerSGD and ACP-SGD (:mod:`gc_strategy.algos.powersgd`):
orthonormalising a batch of factors, and the products that make one factor from the other."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from .. import kernels


def orthogonalize(matrices: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormalise the columns of a batch ``[b, n, r]`` in place, by classical Gram–Schmidt with
    each column projected off the previous ones twice (CGS2: "twice is enough", Giraud, Langou &
    Rozložník 2005): orthogonal to working precision like Householder QR, also for (nearly)
    dependent columns, e.g. a rank-r factor of a matrix of lower rank, where a single pass is not.
    A column is divided by ``‖col‖ + ε`` (torch's ``powerSGD_hook``'s ε, which keeps vanishing
    columns finite); with ``ε = 0`` an exactly zero column stays zero (zero-padded batches too).

    All of it is batched: ``4(r − 1)`` small ``bmm`` and ``r`` norms for the whole batch, however
    many matrices, where a QR per batch runs one solver call per matrix.
    """
    for i in range(matrices.shape[2]):
        col = matrices[:, :, i : i + 1]
        if i:
            done = matrices[:, :, :i]
            for _ in range(2):  # col ← col − D (Dᵀ col): two launches
                col.baddbmm_(done, torch.bmm(done.transpose(1, 2), col), alpha=-1)
        col /= _column_divisors(col, epsilon)
    return matrices


def _column_divisors(matrices: Tensor, epsilon: float) -> Tensor:
    """``‖col‖ + ε`` of each column of a batch ``[b, n, r]``; with ``ε = 0`` the norm, at least the
    dtype's smallest normal number, so that a zero column divided by it stays zero."""
    norms = torch.linalg.vector_norm(matrices, dim=1, keepdim=True)
    return norms + epsilon if epsilon > 0 else norms.clamp_min(torch.finfo(matrices.dtype).tiny)


def normalize_columns(matrices: Tensor, epsilon: float = 0.0) -> Tensor:
    """Each column of a batch ``[b, n, r]`` divided by its norm (``‖col‖ + ε``; with ``ε = 0`` a
    zero column stays zero), as a new batch: three launches where :func:`orthogonalize` takes
    ``7r − 4``.

    Why it may stand in for an orthonormalisation of the factor a power iteration multiplies:
    ``P = orth(M Q)`` is the Q factor of ``M Q``'s thin QR, and for any upper-triangular ``R``
    with a positive diagonal ``M Q R⁻¹`` has the same one, so ``orth(M · orth(Q)) = orth(M Q)`` in
    exact arithmetic. What ``orth(Q)`` adds in floating point is conditioning: columns of equal
    scale. A warm-started ``Q = Mᵀ P`` with ``P`` orthonormal has nearly orthogonal columns of
    scales ``σ_i``; normalised, they condition ``M Q`` as well as orthonormal ones would.
    """
    return matrices / _column_divisors(matrices, epsilon)


#: CPU only: per (factor, batch shape, rank), whether the product is faster with the factor on the left
_FACTOR_FIRST: dict[tuple[str, tuple[int, ...], int], bool] = {}


def product(kind: str, m: Tensor, factor: Tensor, factor_first: bool | None = None) -> Tensor:
    """``P = M Q`` (``kind`` "p", ``factor`` = Q) or ``Q = Mᵀ P`` ("q") for batches ``[b, rows,
    cols]``, directly or as ``(Qᵀ Mᵀ)ᵀ`` / ``(Pᵀ M)ᵀ`` (``factor_first``; the same product, other
    rounding). Which BLAS call is faster for a skinny product depends on the CPU, by several times
    either way; so on the CPU each shape's form is timed once (best of 3 each) and kept for the
    process; on a GPU the direct form."""
    if factor_first is None:
        key = (kind, tuple(m.shape), factor.shape[-1])
        if not kernels.in_host_memory(m):
            factor_first = False
        elif key in _FACTOR_FIRST:
            factor_first = _FACTOR_FIRST[key]
        else:
            factor_first = _FACTOR_FIRST[key] = _faster(lambda first: product(kind, m, factor, first))
    if factor_first:
        return torch.bmm(factor.transpose(1, 2), m.transpose(1, 2) if kind == "p" else m).transpose(1, 2)
    return torch.bmm(m if kind == "p" else m.transpose(1, 2), factor)


def _faster(run) -> bool:
    """Whether ``run(True)`` beats ``run(False)``: best of 3 timings each, after one call each."""
    best = {}
    for option in (False, True):
        run(option)
        best[option] = min(_seconds(run, option) for _ in range(3))
    return best[True] < best[False]


def _seconds(run, option: bool) -> float:
    start = time.perf_counter()
    run(option)
    return time.perf_counter() - start
