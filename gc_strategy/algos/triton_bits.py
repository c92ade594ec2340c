"""Triton kernels of the packed bit formats (:mod:`~gc_strategy.algos.packing`) for CUDA tensors.

Triton is optional: :func:`usable` is False without it (or for CPU tensors), and the pure-torch
code in ``packing.py`` runs instead. Each kernel does in one pass what the torch code does in
several (compare, shift, sum, with their temporaries):

- :func:`pack_bits`: ``8 / bits`` codes per byte, the first in the lowest bits;
- :func:`pack_signs`: bit ``i`` = ``x_i >= 0`` straight from the float input (no bool tensor);
- :func:`unpack_bits`: the codes back, one per element;
- :func:`mean_of_signs`: the average over ranks of sign bits decoded with per-tensor levels
  (``onebit``, ``efsignsgd``), without unpacking or decoding each rank's payload to a float vector.

The results are bit-identical to the torch code's (tests run the kernels on the CPU under
``TRITON_INTERPRET=1`` and compare).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the pure-torch code is used
    triton = None

#: bytes (or codes) handled by one Triton program
BLOCK = 1024


#: the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` when this module was
#: imported), which runs them on CPU tensors: how the tests check them without a GPU
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)


def usable(tensor: Tensor) -> bool:
    """Whether the kernels run on ``tensor``: Triton is installed and the tensor is on CUDA, or the
    kernels were built for the interpreter."""
    return triton is not None and (tensor.is_cuda or INTERPRETED)


if triton is not None:

    @triton.jit
    def _pack_kernel(codes_ptr, out_ptr, n, BITS: tl.constexpr, SIGNS: tl.constexpr, BLOCK: tl.constexpr):
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        packed = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(per_byte):
            index = byte * per_byte + j
            value = tl.load(codes_ptr + index, mask=index < n, other=0)
            code = (value >= 0).to(tl.int32) if SIGNS else value.to(tl.int32)
            code = tl.where(index < n, code, 0)
            packed = packed | (code << (j * BITS))
        tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < (n + per_byte - 1) // per_byte)

    @triton.jit
    def _unpack_kernel(packed_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
        per_byte: tl.constexpr = 8 // BITS
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        byte = tl.load(packed_ptr + index // per_byte, mask=index < n, other=0).to(tl.int32)
        code = (byte >> ((index % per_byte) * BITS)) & ((1 << BITS) - 1)
        tl.store(out_ptr + index, code.to(tl.uint8), mask=index < n)


    @triton.jit
    def _mean_of_signs_kernel(bits_ptr, positive_ptr, negative_ptr, ids_ptr, out_ptr, n, nbytes, tensors, ranks,
                              BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = index < n
        tensor = tl.load(ids_ptr + index, mask=inside, other=0)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for rank in range(ranks):  # the same order as the torch code's sum of decodes
            byte = tl.load(bits_ptr + rank * nbytes + index // 8, mask=inside, other=0).to(tl.int32)
            positive = tl.load(positive_ptr + rank * tensors + tensor, mask=inside, other=0.0)
            negative = tl.load(negative_ptr + rank * tensors + tensor, mask=inside, other=0.0)
            total += tl.where(((byte >> (index % 8)) & 1) == 1, positive, negative)
        tl.store(out_ptr + index, total / ranks, mask=inside)


def _pack(values: Tensor, bits: int, signs: bool) -> Tensor:
    values = values.reshape(-1).contiguous()
    n, per_byte = values.numel(), 8 // bits
    out = torch.empty((n + per_byte - 1) // per_byte, dtype=torch.uint8, device=values.device)
    if out.numel():
        _pack_kernel[(triton.cdiv(out.numel(), BLOCK),)](values, out, n, BITS=bits, SIGNS=signs, BLOCK=BLOCK)
    return out


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """``packing.pack_bits`` for ``bits`` in 1, 2, 4 (codes: integers or bools)."""
    return _pack(codes.to(torch.uint8) if codes.dtype == torch.bool else codes, bits, signs=False)


def pack_signs(values: Tensor) -> Tensor:
    """``packing.pack_bits(values >= 0, 1)`` in one pass over float ``values``."""
    return _pack(values, 1, signs=True)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """``packing.unpack_bits`` for ``bits`` in 1, 2, 4."""
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if n:
        _unpack_kernel[(triton.cdiv(n, BLOCK),)](packed.contiguous(), out, n, BITS=bits, BLOCK=BLOCK)
    return out


def mean_of_signs(bits: Tensor, positive: Tensor, negative: Tensor, tensor_ids: Tensor, n: int) -> Tensor:
    """``(1/W) Σ_r (bit_r(i) ? positive[r, t(i)] : negative[r, t(i)])`` for ``bits`` ``[W, ceil(n/8)]``
    (packed sign bits of W ranks), per-tensor levels ``[W, tensors]`` and ``tensor_ids`` ``t(i)``."""
    out = torch.empty(n, dtype=torch.float32, device=bits.device)
    if n:
        ranks, nbytes = bits.shape
        _mean_of_signs_kernel[(triton.cdiv(n, BLOCK),)](
            bits.contiguous(), positive.float().contiguous(), negative.float().contiguous(), tensor_ids.contiguous(),
            out, n, nbytes, positive.shape[1], ranks, BLOCK=BLOCK)
    return out
