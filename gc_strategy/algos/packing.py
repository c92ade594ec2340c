"""Bit widths of packed codes (real wire formats, docs/algorithms.md §4): the packing itself is
:func:`gc_strategy.kernels.pack_bits` / :func:`~gc_strategy.kernels.unpack_bits`."""

from __future__ import annotations

WIDTHS = (1, 2, 4, 8)


def bits_for(values: int) -> int:
    """The fewest bits in ``WIDTHS`` that hold ``values`` distinct codes."""
    for bits in WIDTHS:
        if values <= 1 << bits:
            return bits
    raise ValueError(f"{values} distinct codes do not fit in one byte")
