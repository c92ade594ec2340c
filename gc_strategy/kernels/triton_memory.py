"""Triton kernels of DGC's error-feedback memory (:class:`gc_strategy.algos.memory.DGCMemory`) for
CUDA tensors.

Off the host, where a bucket's finiteness is known only on the device, the torch code forms the new
``u`` and ``v`` in a new ``[2, n]`` tensor, zeroes what was sent there, and copies them back where the
bucket is finite: two additions, a gather, a multiply and a scatter, and two ``where`` passes over
``2n`` elements in torch's generic (unvectorised) elementwise kernel, which a 0-d condition
selects: the kernel that took the most of ``dgc``'s side stream in the H200 trace
(docs/benchmarks/gpu_h200.md). Here it takes two launches per bucket, and half the memory traffic
(six reads and writes of ``n`` elements where the torch code makes twelve):

- :func:`momentum_step`: one pass that reads ``g``, ``u``, ``v`` and the finite flag, writes
  ``u ← m·u + g`` and ``v ← v + u`` in place where the bucket is finite, and the compressor's
  input ``v + (m·u + g)`` whether it is or not (so a gradient's inf or NaN still reaches the
  average);
- :func:`zero_sent`: ``u`` and ``v`` zeroed at the positions sent (slots of a sparse payload, or a
  bool mask of the bucket), nothing stored where the bucket is not finite.

Tests run the kernels on the CPU under ``TRITON_INTERPRET=1`` against the memory's torch code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_bits import triton
from .triton_select import BLOCK

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _momentum_kernel(grad_ptr, u_ptr, v_ptr, finite_ptr, out_ptr, momentum, n, BLOCK: tl.constexpr):
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = index < n
        g = tl.load(grad_ptr + index, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + index, mask=inside, other=0.0) * momentum + g
        v = tl.load(v_ptr + index, mask=inside, other=0.0) + u
        kept = inside & tl.load(finite_ptr).to(tl.int1)
        tl.store(u_ptr + index, u, mask=kept)
        tl.store(v_ptr + index, v, mask=kept)
        tl.store(out_ptr + index, v, mask=inside)

    @triton.jit
    def _zero_sent_kernel(
        u_ptr,
        v_ptr,
        indices_ptr,
        flags_ptr,
        finite_ptr,
        slots,
        INDICES: tl.constexpr,
        FLAGS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        slot = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        sent = (slot < slots) & tl.load(finite_ptr).to(tl.int1)
        if FLAGS:
            sent = sent & tl.load(flags_ptr + slot, mask=sent, other=0).to(tl.int1)
        position = slot
        if INDICES:
            position = tl.load(indices_ptr + slot, mask=sent, other=0).to(tl.int64)
        tl.store(u_ptr + position, 0.0, mask=sent)
        tl.store(v_ptr + position, 0.0, mask=sent)


def momentum_step(grad: Tensor, u: Tensor, v: Tensor, momentum: float, finite: Tensor) -> Tensor:
    """DGC's momentum correction and accumulation in one pass: ``u ← m·u + g`` and ``v ← v + u`` in
    place where the 0-d bool ``finite`` is True (else both stay as they were), and a new tensor
    holding ``v + (m·u + g)``, the compressor's input, either way. ``grad`` of any float dtype;
    ``u`` and ``v`` fp32, contiguous."""
    out = torch.empty_like(v)
    n = v.numel()
    if n:
        _momentum_kernel[(triton.cdiv(n, BLOCK),)](grad, u, v, finite, out, momentum, n, BLOCK=BLOCK)
    return out


def zero_sent(u: Tensor, v: Tensor, positions: Tensor | tuple[Tensor, Tensor], finite: Tensor) -> None:
    """``u`` and ``v`` zeroed at the positions sent, where the 0-d bool ``finite`` is True (nothing
    changes where it is False). ``positions`` as the memory receives them: integer indices, a bool
    mask of the bucket, or ``(indices, flags)``: the indices whose bool flag is set (those are
    distinct; the others may repeat any index and are left alone)."""
    if isinstance(positions, tuple):
        indices, flags = positions
    elif positions.dtype == torch.bool:
        indices, flags = None, positions
    else:
        indices, flags = positions, None
    slots = (flags if indices is None else indices).numel()
    if slots:
        _zero_sent_kernel[(triton.cdiv(slots, BLOCK),)](
            u,
            v,
            indices if indices is not None else flags,
            flags if flags is not None else indices,
            finite,
            slots,
            INDICES=indices is not None,
            FLAGS=flags is not None,
            BLOCK=BLOCK,
        )
