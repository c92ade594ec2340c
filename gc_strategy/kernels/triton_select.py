"""Triton kernels of the selections for CUDA tensors: the chunked top-k
(:func:`gc_strategy.kernels.chunk_top_k`), the fixed-capacity selection above a threshold
(:func:`gc_strategy.kernels.select_above`) and the sparse payload
(:func:`gc_strategy.kernels.sparse_payload`).

``torch.topk`` over the rows of a ``[rows, C]`` view runs one selection per row, several passes
over it (on an H200, 1.2 ms a step for ResNet-50's gradients in chunks of 256, where one read of
them takes 0.03 ms). Where a chunk keeps few entries (SparseLoCo's: 2 of 256 at 1%), each program
here loads a tile of whole rows once into registers and takes its ``k`` largest by ``k`` argmaxes
along the rows, each chosen entry then keyed below every magnitude: one pass over the bucket.
Ties go to the lowest column (``torch.topk`` takes any of them); NaN ranks with +inf, above every
finite magnitude (``torch.topk`` ranks NaN above +inf).

The selection above a threshold is the torch variant's math (:func:`.torch_ops.select_above`:
compaction by ``nonzero_static``, a top-k over the candidates) in six launches where the torch code
makes eleven: one kernel writes the mask of the entries not below the threshold (a comparison and
its negation in torch), one forms the candidates and their keys from the compacted positions (a
comparison with the count, a ``where``, a gather and a fill), one reads the chosen slots' positions
and flags (a gather and a comparison). ``dgc``, ``threshold`` and ``sidco`` run it in every bucket;
their host time per step was more than twice their device time in the H200 trace
(docs/benchmarks/gpu_h200.md), so launches saved are the host's time saved. A sparsifier's payload
(the values at the indices sent, times their flags, and the indices as int32) is one more kernel,
where torch takes a gather, a multiply and a cast.

Tests run the kernels on the CPU under ``TRITON_INTERPRET=1`` against the torch code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import torch_ops
from .triton_bits import triton

#: the most entries a chunk keeps here (an argmax over its row each)
MOST_KEPT = 16
#: the longest chunk (its row, padded to a power of two, lies in one program's registers)
LONGEST = 4096
#: elements of a program's tile: whole rows, padded
TILE = 4096
#: elements (or slots) of a program's block in the one-dimensional kernels here and in
#: :mod:`.triton_memory`
BLOCK = 1024


def fits(chunk: int, k: int) -> bool:
    """Whether chunks of ``chunk`` elements keeping ``k`` each take the kernel (where Triton runs:
    the dispatch asks)."""
    return chunk <= LONGEST and k <= MOST_KEPT


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _chunk_top_k_kernel(
        magnitudes_ptr, out_ptr, rows, chunk, K: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, WIDTH)
        inside = (row[:, None] < rows) & (column[None, :] < chunk)
        keys = tl.load(magnitudes_ptr + row[:, None] * chunk + column[None, :], mask=inside, other=-1.0)
        keys = tl.where(keys != keys, float("inf"), keys)  # NaN among the largest
        for j in tl.static_range(K):
            best = tl.argmax(keys, axis=1, tie_break_left=True)
            tl.store(out_ptr + row * K + j, best.to(tl.int64), mask=row < rows)
            keys = tl.where(column[None, :] == best[:, None], -2.0, keys)  # below the padding's −1

    @triton.jit
    def _not_below_kernel(
        magnitudes_ptr,
        threshold_ptr,
        threshold,
        mask_ptr,
        n,
        STRICT: tl.constexpr,
        ON_DEVICE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = index < n
        x = tl.load(magnitudes_ptr + index, mask=inside, other=0.0)
        if ON_DEVICE:
            threshold = tl.load(threshold_ptr)
        below = x <= threshold if STRICT else x < threshold  # False for NaN: never below
        tl.store(mask_ptr + index, (below == 0).to(tl.int1), mask=inside)

    @triton.jit
    def _candidates_kernel(compacted_ptr, values_ptr, candidates_ptr, keys_ptr, size, BLOCK: tl.constexpr):
        slot = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = slot < size
        position = tl.load(compacted_ptr + slot, mask=inside, other=-1)
        past = position < 0  # nonzero_static's fill: a slot past the count
        candidate = tl.where(past, slot, position)
        key = tl.load(values_ptr + candidate, mask=inside & ~past, other=-1.0)  # −1 past the count
        tl.store(candidates_ptr + slot, candidate, mask=inside)
        tl.store(keys_ptr + slot, key, mask=inside)

    @triton.jit
    def _chosen_kernel(chosen_ptr, keys_ptr, candidates_ptr, positions_ptr, sent_ptr, k, BLOCK: tl.constexpr):
        slot = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = slot < k
        chosen = tl.load(chosen_ptr + slot, mask=inside, other=0)
        tl.store(positions_ptr + slot, tl.load(candidates_ptr + chosen, mask=inside, other=0), mask=inside)
        sent = tl.load(keys_ptr + slot, mask=inside, other=-1.0) != -1.0
        tl.store(sent_ptr + slot, sent.to(tl.int1), mask=inside)

    @triton.jit
    def _payload_kernel(
        flat_ptr, indices_ptr, sent_ptr, values_ptr, wire_ptr, k, SENT: tl.constexpr, BLOCK: tl.constexpr
    ):
        slot = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = slot < k
        index = tl.load(indices_ptr + slot, mask=inside, other=0)
        value = tl.load(flat_ptr + index, mask=inside, other=0.0)
        if SENT:  # times the flag in fp32, as torch's mul_: ±0, or NaN for an inf or NaN (exact in any dtype)
            value = value.to(tl.float32) * tl.load(sent_ptr + slot, mask=inside, other=0).to(tl.float32)
        tl.store(values_ptr + slot, value.to(values_ptr.dtype.element_ty), mask=inside)
        tl.store(wire_ptr + slot, index.to(tl.int32), mask=inside)


def chunk_top_k(magnitudes: Tensor, k: int) -> Tensor:
    """int64 columns ``[rows, k]`` of the ``k`` largest of each row of the 2-d, non-negative
    ``magnitudes`` (``fits(columns, k)``), distinct, in decreasing order of magnitude."""
    magnitudes = magnitudes.contiguous()
    rows, chunk = magnitudes.shape
    out = torch.empty(rows, k, dtype=torch.int64, device=magnitudes.device)
    if rows:
        width = triton.next_power_of_2(chunk)
        per_program = max(1, TILE // width)
        grid = (triton.cdiv(rows, per_program),)
        _chunk_top_k_kernel[grid](magnitudes, out, rows, chunk, K=k, ROWS=per_program, WIDTH=width)
    return out


def select_above(
    magnitudes: Tensor, threshold: float | Tensor, capacity: int, strict: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`.torch_ops.select_above` where ``nonzero_static`` compacts (:func:`.torch_ops.compacts`),
    the same results in six launches: ``capacity`` int64 positions, their bool flags, the count."""
    n, device = magnitudes.numel(), magnitudes.device
    size = min(n, torch_ops.CANDIDATES * capacity)
    on_device = isinstance(threshold, Tensor)
    not_below = torch.empty(n, dtype=torch.bool, device=device)
    _not_below_kernel[(triton.cdiv(n, BLOCK),)](
        magnitudes,
        threshold if on_device else magnitudes,
        0.0 if on_device else threshold,
        not_below,
        n,
        STRICT=strict,
        ON_DEVICE=on_device,
        BLOCK=BLOCK,
    )
    compacted = torch.nonzero_static(not_below, size=size).view(-1)
    candidates = torch.empty(size, dtype=torch.int64, device=device)
    keys = torch.empty(size, dtype=magnitudes.dtype, device=device)
    _candidates_kernel[(triton.cdiv(size, BLOCK),)](compacted, magnitudes, candidates, keys, size, BLOCK=BLOCK)
    top_keys, chosen = torch.topk(keys, capacity, sorted=False)
    positions = torch.empty(capacity, dtype=torch.int64, device=device)
    sent = torch.empty(capacity, dtype=torch.bool, device=device)
    _chosen_kernel[(triton.cdiv(capacity, BLOCK),)](
        chosen, top_keys, candidates, positions, sent, capacity, BLOCK=BLOCK
    )
    return positions, sent, not_below.sum()


def sparse_payload(flat: Tensor, indices: Tensor, sent: Tensor | None) -> list[Tensor]:
    """:func:`.torch_ops.sparse_payload` in one launch: the values at the int64 ``indices`` (times
    the bool ``sent`` where given) and the indices as int32."""
    k = indices.numel()
    values = torch.empty(k, dtype=flat.dtype, device=flat.device)
    wire = torch.empty(k, dtype=torch.int32, device=flat.device)
    if k:
        _payload_kernel[(triton.cdiv(k, BLOCK),)](
            flat, indices, sent if sent is not None else indices, values, wire, k, SENT=sent is not None, BLOCK=BLOCK
        )
    return [values, wire]
