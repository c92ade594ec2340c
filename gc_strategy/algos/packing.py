"""Bit packing of small unsigned codes into bytes (real wire formats, docs/algorithms.md §4).

``pack_bits(codes, bits)`` stores ``8 // bits`` codes per byte (``bits`` in 1, 2, 4, 8), the first
code in the lowest bits, so ``n`` codes take ``ceil(n * bits / 8)`` bytes. On CUDA with Triton the
one-pass kernels of :mod:`~gc_strategy.algos.triton_bits` do the work; 1-bit codes on the CPU go
through numpy's ``packbits``/``unpackbits`` (``bitorder="little"`` is this layout; faster than the
torch code there, docs/benchmarks/cpu_paths_cpu.md); this torch code everywhere else.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import triton_bits

WIDTHS = (1, 2, 4, 8)


def bits_for(values: int) -> int:
    """The fewest bits in ``WIDTHS`` that hold ``values`` distinct codes."""
    for bits in WIDTHS:
        if values <= 1 << bits:
            return bits
    raise ValueError(f"{values} distinct codes do not fit in one byte")


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack codes (integers in ``[0, 2**bits)``) into a uint8 vector of ``ceil(n*bits/8)`` bytes."""
    if bits != 8 and triton_bits.usable(codes):
        return triton_bits.pack_bits(codes, bits)
    if bits == 1 and codes.device.type == "cpu":
        return torch.from_numpy(np.packbits(codes.reshape(-1).contiguous().numpy(), bitorder="little"))
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


def pack_signs(values: Tensor) -> Tensor:
    """``pack_bits(values >= 0, 1)``: one bit per element, set for ``values_i >= 0``."""
    if triton_bits.usable(values):
        return triton_bits.pack_signs(values)
    return pack_bits(values >= 0, 1)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as uint8."""
    if bits == 8:
        return packed[:n]
    if triton_bits.usable(packed):
        return triton_bits.unpack_bits(packed, bits, n)
    if bits == 1 and packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), count=n, bitorder="little"))
    per_byte = 8 // bits
    codes = torch.empty(packed.numel(), per_byte, dtype=torch.uint8, device=packed.device)
    for j in range(per_byte):
        torch.bitwise_and(packed >> (j * bits), (1 << bits) - 1, out=codes[:, j])
    return codes.view(-1)[:n]
