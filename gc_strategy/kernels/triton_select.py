"""Triton kernel of the chunked top-k (:func:`gc_strategy.kernels.chunk_top_k`) for CUDA tensors.

``torch.topk`` over the rows of a ``[rows, C]`` view runs one selection per row, several passes
over it (on an H200, 1.2 ms a step for ResNet-50's gradients in chunks of 256, where one read of
them takes 0.03 ms). Where a chunk keeps few entries (SparseLoCo's: 2 of 256 at 1%), each program
here loads a tile of whole rows once into registers and takes its ``k`` largest by ``k`` argmaxes
along the rows, each chosen entry then keyed below every magnitude: one pass over the bucket.

Ties go to the lowest column (``torch.topk`` takes any of them); NaN ranks with +inf, above every
finite magnitude (``torch.topk`` ranks NaN above +inf). Tests run the kernel on the CPU under
``TRITON_INTERPRET=1`` against ``torch.topk``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_bits import triton

#: the most entries a chunk keeps here (an argmax over its row each)
MOST_KEPT = 16
#: the longest chunk (its row, padded to a power of two, lies in one program's registers)
LONGEST = 4096
#: elements of a program's tile: whole rows, padded
TILE = 4096


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
