"""The plain-torch variant of each kernel: it runs on every device, is what accelerators run where
there is no Triton kernel, and is the reference the other variants are tested against."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor


def nonzero_positions(dense: Tensor) -> Tensor:
    """Where ``dense`` is nonzero (or NaN), as a bool mask: counting the positions would make the
    host wait for the device."""
    return dense != 0


def positions_at_least(magnitudes: Tensor, threshold: float | Tensor, strict: bool) -> Tensor:
    below = magnitudes <= threshold if strict else magnitudes < threshold
    return torch.nonzero(~below).view(-1)


def top_k(magnitudes: Tensor, k: int) -> Tensor:
    return torch.topk(magnitudes, min(k, magnitudes.numel()), sorted=False).indices


def chunk_top_k(magnitudes: Tensor, k: int) -> Tensor:
    return torch.topk(magnitudes, k, dim=1, sorted=False).indices


#: a capacity selection looks at the first ``CANDIDATES · capacity`` entries above the threshold
CANDIDATES = 2
#: ``torch.nonzero_static`` runs on CUDA from torch 2.6 (on the CPU from 2.1)
STATIC_COMPACTION_ON_CUDA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 6)


def compacts(magnitudes: Tensor) -> bool:
    """Whether ``torch.nonzero_static`` compacts ``magnitudes`` with this torch (on CUDA it takes
    fewer than 2³¹ elements)."""
    device = magnitudes.device
    return device.type == "cpu" or (device.type == "cuda" and STATIC_COMPACTION_ON_CUDA and magnitudes.numel() < 2**31)


def select_above(
    magnitudes: Tensor, threshold: float | Tensor, capacity: int, strict: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The entries not below the threshold (NaN is never below), compacted in bucket order into
    ``S = min(n, CANDIDATES · capacity)`` candidates by ``nonzero_static`` (a scan of the mask,
    no size read back), then the top ``capacity`` of the candidates' magnitudes, those past the
    count keyed −1: a top-k over ``S`` entries, not over the bucket. The slots whose key is −1
    (unflagged) hold distinct positions. Where ``nonzero_static`` does not run (torch < 2.6 on
    CUDA, or 2³¹ elements there), one top-k over the whole bucket, its entries below keyed −1."""
    below = magnitudes <= threshold if strict else magnitudes < threshold
    if not compacts(magnitudes):
        keys, positions = torch.topk(magnitudes.masked_fill_(below, -1.0), capacity, sorted=False)
        return positions, keys != -1.0, magnitudes.numel() - below.sum()
    size = min(magnitudes.numel(), CANDIDATES * capacity)
    candidates, keys, chosen, count = top_k_of_compacted(magnitudes, below.logical_not_(), capacity, size)
    return candidates.index_select(0, chosen), keys != -1.0, count


def top_k_of_compacted(values: Tensor, where: Tensor, k: int, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Of the positions where the bool ``where`` holds, the first ``size`` in increasing order
    (compacted by ``nonzero_static``, ``size >= k``), and among them the ``k`` with the largest
    ``values`` (those past the count keyed −1): the compacted positions, the top k's keys, their
    slots among the positions, and the count of positions where ``where`` holds (a 0-d tensor).
    No size is read back. A slot past the count holds its own number as its position, so the
    positions left over are distinct: a decode's ``index_add_`` into one repeated position would
    serialise on its atomics (up to 2.5 M of them for ``threshold`` on ResNet-50: 7 ms a step on
    an H200)."""
    count = where.sum()
    slots = _slots(size, values.device)
    past = slots >= count
    candidates = torch.where(past, slots, torch.nonzero_static(where, size=size).view(-1))
    keys, chosen = torch.topk(values.index_select(0, candidates).masked_fill_(past, -1.0), k, sorted=False)
    return candidates, keys, chosen, count


@functools.cache
def _slots(size: int, device: torch.device) -> Tensor:
    """``0, 1, …, size − 1`` (made once per size and device)."""
    return torch.arange(size, device=device)


def sparse_payload(flat: Tensor, indices: Tensor, sent: Tensor | None) -> list[Tensor]:
    """A sparse payload: the values at ``indices`` (times the bool ``sent`` where given: 0 at a slot
    not sent, or NaN where its entry is inf or NaN) and the indices as int32, the wire's type."""
    values = flat.index_select(0, indices)
    return [values if sent is None else values.mul_(sent), indices.to(torch.int32)]


def exceedances(magnitudes: Tensor, threshold: float | Tensor) -> Tensor:
    return magnitudes[magnitudes > threshold]


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Code ``j`` of each byte shifted to bits ``j·bits`` and the byte's codes summed (their bits
    are disjoint, so the sum is their OR): a shift and a sum per bucket, whatever ``bits``."""
    codes = codes.reshape(-1)
    codes = codes.view(torch.uint8) if codes.dtype == torch.bool else codes.to(torch.uint8)  # bools are bytes
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    return (codes.view(-1, per_byte) << _shifts(bits, codes.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)).bitwise_and_((1 << bits) - 1)
    return codes.view(-1)[:n]


@functools.cache
def _shifts(bits: int, device: torch.device) -> Tensor:
    """The shift of each code in its byte: ``0, bits, 2·bits, …`` (made once per device: a launch
    saved in every pack and unpack)."""
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def frexp_into(a: Tensor, mantissa: Tensor, exponent: Tensor) -> tuple[Tensor, Tensor]:
    return torch.frexp(a, out=(mantissa, exponent))


def fill_where_zero(target: Tensor, a: Tensor, value: int) -> None:
    target.masked_fill_(a == 0, value)


def uniform_(out: Tensor, seed: int) -> Tensor:
    return out.uniform_(generator=torch.Generator(device=out.device).manual_seed(seed))


def sum_per_tensor(values: Tensor, lengths: Tensor, magnitudes: bool) -> Tensor:
    """One segmented reduction (``index_add`` would serialise on the atomics of each tensor's one
    slot on a GPU)."""
    return torch.segment_reduce(values.abs() if magnitudes else values, "sum", lengths=lengths)


def select_per_tensor(
    mask: Tensor, if_true: Tensor, if_false: Tensor, tensor_ids: Tensor, out: Tensor | None
) -> Tensor:
    """One gather from the pairs ``(if_false[t], if_true[t])`` laid side by side, at ``2·t(j) +
    mask[j]``: two bucket-sized passes where two gathers and a ``where`` take four."""
    pairs = torch.stack([if_false, if_true], dim=1).view(-1)
    at = torch.add(mask, tensor_ids, alpha=2)
    return torch.take(pairs, at) if out is None else torch.take(pairs, at, out=out)


def row_max_magnitudes(rows: Tensor, out: Tensor) -> Tensor:
    """The infinity norm of each row: one launch."""
    return torch.linalg.vector_norm(rows, ord=math.inf, dim=1, out=out)


def all_finite(flat: Tensor) -> Tensor:
    """``max |x| < inf``: the infinity norm propagates NaN, and with the comparison it is two
    launches where ``aminmax`` and two ``isfinite`` take ten."""
    return torch.linalg.vector_norm(flat, ord=math.inf) < math.inf


def assign_if_finite(target: Tensor, value: Tensor, finite: Tensor) -> None:
    """``where`` on the 0-d flag: the host never waits for the device."""
    torch.where(finite, value, target, out=target)
