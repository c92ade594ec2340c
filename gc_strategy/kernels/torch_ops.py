"""The plain-torch variant of each kernel: it runs on every device, is what accelerators run where
there is no Triton kernel, and is the reference the other variants are tested against."""

from __future__ import annotations

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


def select_above(
    magnitudes: Tensor, threshold: float | Tensor, capacity: int, strict: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The top ``capacity`` of the magnitudes with those not above the threshold keyed −1: one
    top-k, no size read back."""
    above = (magnitudes > threshold if strict else magnitudes >= threshold) | magnitudes.isnan()
    positions = torch.topk(magnitudes.masked_fill_(~above, -1.0), capacity, sorted=False).indices
    return positions, above.index_select(0, positions), above.sum()


def exceedances(magnitudes: Tensor, threshold: float | Tensor) -> Tensor:
    return magnitudes[magnitudes > threshold]


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.view(-1, per_byte)  # code j of each byte: a strided column, not a shift-and-sum per row
    packed = groups[:, 0].clone()
    for j in range(1, per_byte):
        packed.bitwise_or_(groups[:, j] << (j * bits))
    return packed


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    per_byte = 8 // bits
    codes = torch.empty(packed.numel(), per_byte, dtype=torch.uint8, device=packed.device)
    for j in range(per_byte):
        torch.bitwise_and(packed >> (j * bits), (1 << bits) - 1, out=codes[:, j])
    return codes.view(-1)[:n]


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
    return torch.where(mask.bool(), if_true[tensor_ids], if_false[tensor_ids], out=out)


def assign_if_finite(target: Tensor, value: Tensor, finite: Tensor) -> None:
    """``where`` on the 0-d flag: the host never waits for the device."""
    torch.where(finite, value, target, out=target)
