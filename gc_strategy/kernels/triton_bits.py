"""Triton kernels of the packed bit formats (:func:`gc_strategy.kernels.pack_bits`) for CUDA tensors.

Triton is optional: :func:`usable` is False without it (or for CPU tensors), and the pure-torch
code in ``packing.py`` runs instead. Each kernel does in one pass what the torch code does in
several (compare, shift, sum, with their temporaries):

- :func:`pack_bits`: ``8 / bits`` codes per byte, the first in the lowest bits;
- :func:`pack_signs`: bit ``i`` = ``x_i >= 0`` straight from the float input (no bool tensor);
- :func:`unpack_bits`: the codes back, one per element;
- :func:`mean_of_signs`: the average over ranks of sign bits decoded with per-tensor levels
  (``onebit``, ``efsignsgd``), without unpacking or decoding each rank's payload to a float vector;
- :func:`sign_sums` and :func:`sign_encode`: the encode of those methods with error feedback in two
  passes over ``g`` and ``e`` (per-tensor sums of ``x = g + e``; then the bits and
  ``e ← x − decode(bits)``), where the torch code makes ~10 (compensate, abs, sums, pack, unpack,
  spread the levels, select, subtract, guard).

- :func:`level_codes` and :func:`mean_of_levels`: QSGD's and TernGrad's stochastic quantisation
  and packing in one pass, and the average of all ranks' decodes in one pass.

A kernel finds the tensor of an element by binary search over the bucket's few offsets (in cache),
so no per-element index vector is read.

The results are bit-identical to the torch code's, except the per-tensor sums of
:func:`sign_sums`, whose additions run in another order, and :func:`mean_of_levels`, where the
compiler may fuse a decode's multiply with the addition over ranks (equal to fp32 rounding; bit
for bit under the interpreter, and on the H100 measured for 1 rank and for one level). Tests run
the kernels on the CPU under ``TRITON_INTERPRET=1`` and compare.
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
#: elements per program of the per-tensor sums (fewer atomic adds), bytes per program of the encode
SUM_BLOCK = 4096
ENCODE_BYTES = 256
LEVEL_BYTES = 1024


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
        """A ``[BLOCK, 8 / BITS]`` tile of codes, contiguous in memory (one coalesced load, where a
        load per code of each byte strides by ``8 / BITS`` elements), summed into bytes along its
        rows after the shifts (the codes' bits are disjoint: the sum is their OR)."""
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        slot = tl.arange(0, per_byte)
        index = byte[:, None] * per_byte + slot[None, :]
        value = tl.load(codes_ptr + index, mask=index < n, other=0)
        code = (value >= 0).to(tl.int32) if SIGNS else value.to(tl.int32)
        packed = tl.sum(tl.where(index < n, code, 0) << (slot[None, :] * BITS), axis=1)
        tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < (n + per_byte - 1) // per_byte)

    @triton.jit
    def _unpack_kernel(packed_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
        per_byte: tl.constexpr = 8 // BITS
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        byte = tl.load(packed_ptr + index // per_byte, mask=index < n, other=0).to(tl.int32)
        code = (byte >> ((index % per_byte) * BITS)) & ((1 << BITS) - 1)
        tl.store(out_ptr + index, code.to(tl.uint8), mask=index < n)

    @triton.jit
    def _tensor_of(index, offsets_ptr, tensors, STEPS: tl.constexpr):
        """Which tensor element ``index`` belongs to: the largest ``t`` with ``offsets[t] <= index``
        (binary search over the bucket's ``tensors + 1`` offsets, which stay in cache)."""
        low = index * 0
        high = low + tensors - 1
        for _ in tl.static_range(STEPS):
            middle = (low + high + 1) // 2
            right = tl.load(offsets_ptr + middle) <= index
            low = tl.where(right, middle, low)
            high = tl.where(right, high, middle - 1)
        return low

    @triton.jit
    def _tensors_of_block(index, start, end, offsets_ptr, tensors, STEPS: tl.constexpr):
        """``_tensor_of`` for a block of elements ``[start, end)``: one scalar search when the whole
        block lies in one tensor (the usual case), else one search per element."""
        first = _tensor_of(start, offsets_ptr, tensors, STEPS)
        last = _tensor_of(end - 1, offsets_ptr, tensors, STEPS)
        if first == last:
            tensor = index * 0 + first
        else:
            tensor = _tensor_of(index, offsets_ptr, tensors, STEPS)
        return tensor

    @triton.jit
    def _mean_of_signs_kernel(
        bits_ptr,
        positive_ptr,
        negative_ptr,
        offsets_ptr,
        out_ptr,
        n,
        nbytes,
        tensors,
        RANKS: tl.constexpr,
        STEPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        index = start + tl.arange(0, BLOCK)
        inside = index < n
        tensor = _tensors_of_block(index, start, tl.minimum(start + BLOCK, n), offsets_ptr, tensors, STEPS)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for rank in range(RANKS):  # the same order as the torch code's sum of decodes
            byte = tl.load(bits_ptr + rank * nbytes + index // 8, mask=inside, other=0).to(tl.int32)
            positive = tl.load(positive_ptr + rank * tensors + tensor, mask=inside, other=0.0)
            negative = tl.load(negative_ptr + rank * tensors + tensor, mask=inside, other=0.0)
            total += tl.where(((byte >> (index % 8)) & 1) == 1, positive, negative)
        tl.store(out_ptr + index, total / RANKS, mask=inside)

    @triton.jit
    def _compensated(grad_ptr, residual_ptr, index, inside, HAS_RESIDUAL: tl.constexpr):
        """``g + e`` in fp32 (``g`` of any float dtype), as ``ResidualMemory.compensate`` with β = γ = 1."""
        x = tl.load(grad_ptr + index, mask=inside, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = tl.load(residual_ptr + index, mask=inside, other=0.0) + x
        return x

    @triton.jit
    def _add_sums(out_ptr, t, x, mine, SPLIT: tl.constexpr):
        """Add this block's sums over the elements ``mine`` to tensor ``t``'s slots."""
        if SPLIT:  # onebit: Σ and count of the non-negative entries, Σ of the rest
            positive = mine & (x >= 0)
            tl.atomic_add(out_ptr + 3 * t, tl.sum(tl.where(positive, x, 0.0)))
            tl.atomic_add(out_ptr + 3 * t + 1, tl.sum(positive.to(tl.float32)))
            tl.atomic_add(out_ptr + 3 * t + 2, tl.sum(tl.where(mine & ~(x >= 0), x, 0.0)))
        else:  # efsignsgd: Σ |x|
            tl.atomic_add(out_ptr + t, tl.sum(tl.where(mine, tl.abs(x), 0.0)))

    @triton.jit
    def _sign_sums_kernel(
        grad_ptr,
        residual_ptr,
        offsets_ptr,
        out_ptr,
        n,
        tensors,
        HAS_RESIDUAL: tl.constexpr,
        SPLIT: tl.constexpr,
        STEPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        index = start + tl.arange(0, BLOCK)
        inside = index < n
        x = _compensated(grad_ptr, residual_ptr, index, inside, HAS_RESIDUAL)
        first = _tensor_of(start, offsets_ptr, tensors, STEPS)
        last = _tensor_of(tl.minimum(start + BLOCK, n) - 1, offsets_ptr, tensors, STEPS)
        if first == last:  # the whole block in one tensor: one atomic add per sum
            _add_sums(out_ptr, first, x, inside, SPLIT)
        else:  # the few tensors this block touches: one atomic add each
            tensor = _tensor_of(index, offsets_ptr, tensors, STEPS)
            for t in range(first, last + 1):
                _add_sums(out_ptr, t, x, inside & (tensor == t), SPLIT)

    @triton.jit
    def _sign_encode_kernel(
        grad_ptr,
        residual_ptr,
        finite_ptr,
        positive_ptr,
        negative_ptr,
        offsets_ptr,
        bits_ptr,
        n,
        tensors,
        HAS_RESIDUAL: tl.constexpr,
        STEPS: tl.constexpr,
        BYTES: tl.constexpr,
    ):
        first_byte = tl.program_id(0).to(tl.int64) * BYTES
        byte = first_byte + tl.arange(0, BYTES)
        bit = tl.arange(0, 8)
        index = byte[:, None] * 8 + bit[None, :]  # a contiguous tile of 8 * BYTES elements
        inside = index < n
        x = _compensated(grad_ptr, residual_ptr, index, inside, HAS_RESIDUAL)
        sign = x >= 0
        packed = tl.sum(tl.where(inside & sign, 1 << bit[None, :], 0), axis=1)
        tl.store(bits_ptr + byte, packed.to(tl.uint8), mask=byte < (n + 7) // 8)
        if HAS_RESIDUAL:  # e <- x - decode(bit), kept as it was when the bucket is not finite
            start = first_byte * 8
            tensor = _tensors_of_block(index, start, tl.minimum(start + 8 * BYTES, n), offsets_ptr, tensors, STEPS)
            level = tl.where(
                sign,
                tl.load(positive_ptr + tensor, mask=inside, other=0.0),
                tl.load(negative_ptr + tensor, mask=inside, other=0.0),
            )
            finite = tl.load(finite_ptr).to(tl.int1)
            old = tl.load(residual_ptr + index, mask=inside, other=0.0)
            tl.store(residual_ptr + index, tl.where(finite, x - level, old), mask=inside)

    @triton.jit
    def _level_codes_kernel(
        x_ptr,
        scales_ptr,
        bound_ptr,
        codes_ptr,
        n,
        nbytes,
        chunk,
        seed,
        S: tl.constexpr,
        BITS: tl.constexpr,
        CLIP: tl.constexpr,
        BYTES: tl.constexpr,
    ):
        PER_BYTE: tl.constexpr = 8 // BITS
        byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
        slot = tl.arange(0, PER_BYTE)
        index = byte[:, None] * PER_BYTE + slot[None, :]
        inside = index < n
        g = tl.load(x_ptr + index, mask=inside, other=0.0).to(tl.float32)
        if CLIP:
            bound = tl.load(bound_ptr)
            g = tl.maximum(tl.minimum(g, bound), -bound)
        scale = tl.load(scales_ptr + index // chunk, mask=inside, other=1.0)
        scaled = tl.abs(g) * S / tl.maximum(scale, 1.1754943508222875e-38)
        low = tl.floor(scaled)
        up = tl.rand(seed, index.to(tl.int32)) < scaled - low
        level = tl.minimum(low + up.to(tl.float32), S)
        signed = tl.where(g > 0, level, tl.where(g < 0, -level, 0.0))
        code = tl.where(inside, (signed + S).to(tl.int32), 0)
        packed = tl.sum(code << (slot[None, :] * BITS), axis=1)
        tl.store(codes_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)

    @triton.jit
    def _mean_of_levels_kernel(
        codes_ptr,
        scales_ptr,
        out_ptr,
        n,
        nbytes,
        chunks,
        chunk,
        S: tl.constexpr,
        BITS: tl.constexpr,
        RANKS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        PER_BYTE: tl.constexpr = 8 // BITS
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = index < n
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for rank in range(RANKS):  # the same order as the torch code's sum of decodes
            byte = tl.load(codes_ptr + rank * nbytes + index // PER_BYTE, mask=inside, other=0).to(tl.int32)
            code = (byte >> ((index % PER_BYTE) * BITS)) & ((1 << BITS) - 1)
            scale = tl.load(scales_ptr + rank * chunks + index // chunk, mask=inside, other=0.0)
            total += (code.to(tl.float32) - S) * scale / S
        tl.store(out_ptr + index, total / RANKS, mask=inside)


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


def _steps(boundaries: Tensor) -> int:
    """Steps of the binary search over ``boundaries`` (``tensors + 1`` offsets)."""
    return max(1, (boundaries.numel() - 2).bit_length())


def _float_output(n: int, device: torch.device, out: Tensor | None) -> Tensor:
    """Where an average kernel writes: ``out`` when it is a float32 vector, else a new one."""
    return out if out is not None and out.dtype == torch.float32 else torch.empty(n, dtype=torch.float32, device=device)


def mean_of_signs(
    bits: Tensor, positive: Tensor, negative: Tensor, boundaries: Tensor, n: int, out: Tensor | None = None
) -> Tensor:
    """``(1/W) Σ_r (bit_r(i) ? positive[r, t(i)] : negative[r, t(i)])`` for ``bits`` ``[W, ceil(n/8)]``
    (packed sign bits of W ranks) and per-tensor levels ``[W, tensors]``; ``t(i)``: the tensor of
    element ``i``, from the bucket's ``boundaries`` (``[0, end of tensor 0, ...]``, on the device)."""
    out = _float_output(n, bits.device, out)
    if n:
        ranks, nbytes = bits.shape
        _mean_of_signs_kernel[(triton.cdiv(n, BLOCK),)](
            bits.contiguous(),
            positive.float().contiguous(),
            negative.float().contiguous(),
            boundaries,
            out,
            n,
            nbytes,
            boundaries.numel() - 1,
            RANKS=ranks,
            STEPS=_steps(boundaries),
            BLOCK=BLOCK,
        )
    return out


def sign_sums(grad: Tensor, residual: Tensor | None, boundaries: Tensor, split: bool) -> Tensor:
    """Per tensor of ``x = grad + residual`` (``residual`` None: ``x = grad``), in one pass: ``Σ|x|``
    (``[tensors]``), or with ``split`` ``[Σ x·[x≥0], #[x≥0], Σ x·[x<0]]`` (``[3, tensors]``). The
    partial sums of blocks are added atomically, so the order of the additions (and the last bits
    of the sums) may differ from run to run."""
    n, tensors = grad.numel(), boundaries.numel() - 1
    out = torch.zeros(tensors * (3 if split else 1), dtype=torch.float32, device=grad.device)
    if n:
        _sign_sums_kernel[(triton.cdiv(n, SUM_BLOCK),)](
            grad,
            residual if residual is not None else grad,
            boundaries,
            out,
            n,
            tensors,
            HAS_RESIDUAL=residual is not None,
            SPLIT=split,
            STEPS=_steps(boundaries),
            BLOCK=SUM_BLOCK,
        )
    return out.view(tensors, 3).T if split else out


def sign_encode(
    grad: Tensor, residual: Tensor | None, finite: Tensor | None, positive: Tensor, negative: Tensor, boundaries: Tensor
) -> Tensor:
    """Packed sign bits of ``x = grad + residual`` (bit ``i`` = ``x_i ≥ 0``) and, with a residual, in
    the same pass ``residual ← x − (bit ? positive[t] : negative[t])`` where ``finite`` (0-d bool)
    is True (else the residual is left as it was): error feedback for the scaled sign methods."""
    n = grad.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=grad.device)
    if n:
        _sign_encode_kernel[(triton.cdiv(bits.numel(), ENCODE_BYTES),)](
            grad,
            residual if residual is not None else grad,
            finite if finite is not None else grad,
            positive.float().contiguous(),
            negative.float().contiguous(),
            boundaries,
            bits,
            n,
            boundaries.numel() - 1,
            HAS_RESIDUAL=residual is not None,
            STEPS=_steps(boundaries),
            BYTES=ENCODE_BYTES,
        )
    return bits


def level_codes(
    flat: Tensor, scales: Tensor, chunk: int, levels: int, bits: int, seed: int, bound: Tensor | None = None
) -> Tensor:
    """Stochastic rounding to signed levels, quantised and packed in one pass: with ``x = flat``
    (clipped to ``±bound`` when given), ``q = sign(x) · min(⌊s|x|/scale⌋ + Bernoulli(frac), s)`` for
    the scale of each ``chunk`` elements, Philox uniforms from ``seed`` and the element index
    (``tl.rand``); codes ``q + s`` packed ``8 / bits`` per byte as :func:`pack_bits` lays them out.
    QSGD: ``scale`` = the chunk's norm; TernGrad: ``s = 1``, ``scale = max|x|``."""
    n = flat.numel()
    nbytes = (n * bits + 7) // 8
    codes = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    if n:
        scales = scales.float().contiguous()
        _level_codes_kernel[(triton.cdiv(nbytes, LEVEL_BYTES),)](
            flat.contiguous(),
            scales,
            bound if bound is not None else scales,
            codes,
            n,
            nbytes,
            chunk,
            seed % 2**31,
            S=levels,
            BITS=bits,
            CLIP=bound is not None,
            BYTES=LEVEL_BYTES,
        )
    return codes


def mean_of_levels(
    codes: Tensor, scales: Tensor, chunk: int, levels: int, bits: int, n: int, out: Tensor | None = None
) -> Tensor:
    """``(1/W) Σ_r (code_r(i) − s) · scale_r[i // chunk] / s`` for packed codes ``[W, bytes]`` and
    scales ``[W, chunks]`` of W ranks: the average of the decodes of :func:`level_codes`' payloads
    in one pass, without a float vector per rank."""
    out = _float_output(n, codes.device, out)
    if n:
        ranks, nbytes = codes.shape
        _mean_of_levels_kernel[(triton.cdiv(n, BLOCK),)](
            codes.contiguous(),
            scales.float().contiguous(),
            out,
            n,
            nbytes,
            scales.shape[1],
            chunk,
            S=levels,
            BITS=bits,
            RANKS=ranks,
            BLOCK=BLOCK,
        )
    return out
