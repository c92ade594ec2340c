"""Streaming DiLoCo's fragment count: how finely to cut the parameters so that each fragment's
exchange hides behind the inner steps it overlaps (Douillard et al., 2025, "Streaming DiLoCo with
overlapping communication")."""

from __future__ import annotations

import math


def fragments_to_overlap(exchange_s: float, step_s: float, overlap_steps: int, inner_steps: int) -> int:
    """The fewest fragments ``k`` whose exchange fits in ``overlap_steps`` inner steps.

    A fragment of ``1/k`` of the parameters sends ``1/k`` of the payload, so its exchange takes
    about ``exchange_s / k`` (the bandwidth term; per-collective latency is left out). It is
    hidden when ``exchange_s / k ≤ τ · step_s``: ``k = ⌈exchange_s / (τ · step_s)⌉``, within
    ``[1, inner_steps]`` (each fragment needs its own inner step of the ``H``).
    """
    if overlap_steps < 1 or step_s <= 0:
        raise ValueError(
            f"fragments_to_overlap: overlap_steps = {overlap_steps} and step_s = {step_s}; both must be > 0"
        )
    needed = math.ceil(exchange_s / (overlap_steps * step_s))
    return max(1, min(inner_steps, needed))
