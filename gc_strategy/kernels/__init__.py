"""One kernel layer: the compressors' hot operations, each behind one dispatch on its tensor.

Every operation has a plain-torch variant (:mod:`.torch_ops`: every device, the reference), and
where it pays a CPU variant through numpy (:mod:`.numpy_ops`), a one-pass Triton kernel on CUDA
(:mod:`.triton_bits`, :mod:`.triton_select`, :mod:`.triton_memory`) or CuPy's kernel where that was
the fastest measured (:mod:`.cupy_ops`). :func:`~.dispatch.variant_for` picks one, and :func:`~.dispatch.forced`
makes every operation take one, so that the accelerator's code runs on the CPU in CI
(``tests/kernels/test_kernels.py`` checks every variant against the torch one). The algorithm files call
these functions and read as their math.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from . import cupy_ops, numpy_ops, torch_ops, triton_bits, triton_memory, triton_select
from .dispatch import VARIANTS, forced, in_host_memory, uses_triton, variant_for

__all__ = [
    "VARIANTS",
    "all_finite",
    "assign_if_finite",
    "chunk_top_k",
    "exceedances",
    "fill_where_zero",
    "forced",
    "frexp_into",
    "in_host_memory",
    "nonzero_positions",
    "pack_bits",
    "pack_signs",
    "positions_at_least",
    "row_max_magnitudes",
    "select_above",
    "select_per_tensor",
    "sparse_payload",
    "sum_per_tensor",
    "top_k",
    "triton_bits",
    "triton_memory",
    "triton_select",
    "uniform_",
    "unpack_bits",
    "uses_triton",
    "variant_for",
]


def _module(tensor: Tensor):
    return numpy_ops if variant_for(tensor) == "numpy" else torch_ops


def nonzero_positions(dense: Tensor) -> Tensor:
    """Where the 1-d ``dense`` is nonzero (or NaN): int64 positions on the host, a bool mask on an
    accelerator (counting positions would make the host wait). :func:`zero_at` takes either."""
    return _module(dense).nonzero_positions(dense)


def positions_at_least(magnitudes: Tensor, threshold: float | Tensor, strict: bool = False) -> Tensor:
    """int64 positions ``j`` (increasing) with ``magnitudes[j] >= threshold`` (``>`` when
    ``strict``), and those holding NaN."""
    return _module(magnitudes).positions_at_least(magnitudes, threshold, strict)


def select_above(
    magnitudes: Tensor, threshold: float | Tensor, capacity: int, strict: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """A fixed-capacity selection of the entries ``>= threshold`` (``>`` when ``strict``) or NaN:
    ``capacity`` int64 positions, all such entries where they fit, else the largest of the first
    ``CANDIDATES · capacity`` of them in bucket order; a bool per slot, True where it holds such
    an entry (those positions are distinct; the slots left over hold other distinct positions,
    which may also be among the flagged ones); and their count, a 0-d tensor (never read on the
    host off the host). ``magnitudes`` may be overwritten."""
    if variant_for(magnitudes, triton=torch_ops.compacts(magnitudes)) == "triton":
        return triton_select.select_above(magnitudes, threshold, capacity, strict)
    return _module(magnitudes).select_above(magnitudes, threshold, capacity, strict)


def top_k(magnitudes: Tensor, k: int) -> Tensor:
    """int64 positions of the ``k`` largest ``magnitudes`` (NaN largest, as ``torch.topk`` orders
    it; among equal values any), in no particular order."""
    return _module(magnitudes).top_k(magnitudes, k)


def chunk_top_k(magnitudes: Tensor, k: int) -> Tensor:
    """int64 columns ``[rows, k]`` of the ``k`` largest of each row of the 2-d, non-negative
    ``magnitudes`` (NaN largest), distinct, in no particular order: a top-k per chunk. One variant
    on the host and without Triton: torch's batched top-k."""
    if variant_for(magnitudes, triton=triton_select.fits(magnitudes.shape[1], k)) == "triton":
        return triton_select.chunk_top_k(magnitudes, k)
    return torch_ops.chunk_top_k(magnitudes, k)


def sparse_payload(flat: Tensor, indices: Tensor, sent: Tensor | None = None) -> list[Tensor]:
    """A sparsifier's payload: ``[flat[indices] · sent, int32 indices]`` (``sent``: a bool per
    index, where given), in one launch with Triton."""
    if variant_for(flat, triton=True) == "triton":
        return triton_select.sparse_payload(flat, indices, sent)
    return torch_ops.sparse_payload(flat, indices, sent)


def exceedances(magnitudes: Tensor, threshold: float | Tensor) -> Tensor:
    """The elements ``> threshold`` (NaN is not above), as a new tensor."""
    return _module(magnitudes).exceedances(magnitudes, threshold)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Codes (integers in ``[0, 2**bits)``, ``bits`` in 1, 2, 4, 8) packed ``8 // bits`` to a byte,
    the first code in the lowest bits: ``ceil(n * bits / 8)`` bytes."""
    if variant_for(codes, triton=bits != 8) == "triton":
        return triton_bits.pack_bits(codes, bits)
    return _module(codes).pack_bits(codes, bits)


def pack_signs(values: Tensor) -> Tensor:
    """``pack_bits(values >= 0, 1)``: one bit per element, set for ``values_i >= 0``."""
    variant = variant_for(values, triton=True, cupy=True)
    if variant == "cupy":
        return cupy_ops.pack_signs(values)
    if variant == "triton":
        return triton_bits.pack_signs(values)
    return pack_bits(values >= 0, 1)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as uint8."""
    if bits == 8:
        return packed[:n]
    if variant_for(packed, triton=True) == "triton":
        return triton_bits.unpack_bits(packed, bits, n)
    return _module(packed).unpack_bits(packed, bits, n)


def frexp_into(a: Tensor, mantissa: Tensor, exponent: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.frexp(a)`` written into ``mantissa`` (fp32) and ``exponent`` (int32)."""
    return _module(a).frexp_into(a, mantissa, exponent)


def fill_where_zero(target: Tensor, a: Tensor, value: int) -> None:
    """``target[a == 0] = value``."""
    _module(a).fill_where_zero(target, a, value)


def uniform_(out: Tensor, seed: int) -> Tensor:
    """``out`` (fp32) filled with U[0, 1) draws reproducible from ``seed`` (each variant its own
    generator: the same distribution, not the same numbers)."""
    return _module(out).uniform_(out, seed)


def sum_per_tensor(values: Tensor, offsets: list[int], numels: list[int], lengths: Tensor, magnitudes: bool) -> Tensor:
    """``out[t] = Σ_{j in tensor t} values[j]`` (of ``|values[j]|`` with ``magnitudes``) for the
    consecutive tensors of a flat vector, or of rows ``values[j, :]`` side by side (``lengths``:
    ``numels`` on the values' device)."""
    if variant_for(values) == "numpy":
        return numpy_ops.sum_per_tensor(values, offsets, numels, magnitudes)
    return torch_ops.sum_per_tensor(values, lengths, magnitudes)


def select_per_tensor(
    mask: Tensor,
    if_true: Tensor,
    if_false: Tensor,
    offsets: list[int],
    numels: list[int],
    tensor_ids: Callable[[], Tensor],
    out: Tensor | None = None,
) -> Tensor:
    """``out[j] = if_true[t(j)] if mask[j] else if_false[t(j)]`` for per-tensor values (``t(j)``:
    the tensor of element ``j``, ``tensor_ids()``: asked for only by the variant that gathers, so the
    host never holds the bucket-sized index), written into ``out`` when given."""
    if variant_for(mask) == "numpy":
        return numpy_ops.select_per_tensor(mask, if_true, if_false, offsets, numels, out)
    return torch_ops.select_per_tensor(mask, if_true, if_false, tensor_ids(), out)


def row_max_magnitudes(rows: Tensor, out: Tensor) -> Tensor:
    """``max_j |rows[i, j]|`` of each row of a 2-d tensor, written into ``out``, without a new
    ``|rows|``."""
    return _module(rows).row_max_magnitudes(rows, out)


def all_finite(flat: Tensor) -> Tensor:
    """0-d bool: no inf or NaN in the non-empty ``flat``, in one reduction pass."""
    return _module(flat).all_finite(flat)


def assign_if_finite(target: Tensor, value: Tensor, finite: Tensor) -> None:
    """``target ← value`` where the 0-d bool ``finite`` is True; else ``target`` stays as it was (how
    error-feedback state skips a bucket holding inf/NaN), without the host waiting for a device."""
    _module(finite).assign_if_finite(target, value, finite)
