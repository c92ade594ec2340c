"""Fixed fusion plans (ALGORITHMS.md §8).

A planner receives the byte sizes of the gradient tensors in gradient-ready order and returns the
sizes of the contiguous groups it cuts them into (each group becomes one bucket). In Python a plan is
given as a string: ``"layerwise"``, ``"single"``, ``"groups:N"``, ``"bucket_mb:X"``, or an object.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Union

FUSION_FORMS = "'layerwise', 'single', 'groups:N' (N >= 1 integer), 'bucket_mb:X' (X > 0 megabytes)"


class FusionPlanner:
    """Cuts tensors (byte sizes in gradient-ready order) into contiguous groups."""

    def plan(self, sizes: list[int]) -> list[int]:
        """Return the number of tensors in each group; they sum to ``len(sizes)``."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class LayerwisePlan(FusionPlanner):
    """One tensor per bucket: the research frameworks' layer-wise compression."""

    def plan(self, sizes: list[int]) -> list[int]:
        return [1] * len(sizes)

    def describe(self) -> str:
        return "layerwise"


class SinglePlan(FusionPlanner):
    """All tensors in one bucket: least fixed cost, no overlap with backward."""

    def plan(self, sizes: list[int]) -> list[int]:
        return [len(sizes)] if sizes else []

    def describe(self) -> str:
        return "single"


class GroupsPlan(FusionPlanner):
    """``n`` contiguous groups of about equal bytes (fewer if there are fewer tensors).

    Cut ``k`` goes where the running byte total is closest to ``k/n`` of the whole, keeping every
    group non-empty.
    """

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"N = {n!r} must be an integer >= 1")
        self.n = n

    def plan(self, sizes: list[int]) -> list[int]:
        n = min(self.n, len(sizes))
        if n == 0:
            return []
        prefix = list(accumulate(sizes))
        total = prefix[-1]
        cuts = [0]
        for k in range(1, n):
            target = total * k / n
            i = bisect.bisect_left(prefix, target)
            if i > 0 and target - prefix[i - 1] <= prefix[min(i, len(prefix) - 1)] - target:
                i -= 1
            # cut after tensor i, leaving room for the groups still to come
            cut = min(max(i + 1, cuts[-1] + 1), len(sizes) - (n - k))
            cuts.append(cut)
        cuts.append(len(sizes))
        return [b - a for a, b in zip(cuts, cuts[1:])]

    def describe(self) -> str:
        return f"groups:{self.n}"


class SizeCapPlan(FusionPlanner):
    """Like DDP's ``bucket_cap_mb``: close a bucket once it holds at least ``cap_mb`` megabytes."""

    def __init__(self, cap_mb: float) -> None:
        if isinstance(cap_mb, bool) or not isinstance(cap_mb, (int, float)) or not cap_mb > 0:
            raise ValueError(f"X = {cap_mb!r} must be a number > 0")
        self.cap_mb = float(cap_mb)

    def plan(self, sizes: list[int]) -> list[int]:
        cap = self.cap_mb * 1024 * 1024
        groups, count, held = [], 0, 0
        for size in sizes:
            count += 1
            held += size
            if held >= cap:
                groups.append(count)
                count, held = 0, 0
        if count:
            groups.append(count)
        return groups

    def describe(self) -> str:
        return f"bucket_mb:{self.cap_mb:g}"


def parse_fusion(spec: Union[str, FusionPlanner]) -> FusionPlanner:
    """Build a planner from its string form (or pass a planner object through)."""
    if isinstance(spec, FusionPlanner):
        return spec
    refuse = ValueError(f"fusion = {spec!r} is invalid; allowed: {FUSION_FORMS}, or a FusionPlanner object")
    if not isinstance(spec, str):
        raise refuse
    kind, _, arg = spec.partition(":")
    if kind == "layerwise" and not arg:
        return LayerwisePlan()
    if kind == "single" and not arg:
        return SinglePlan()
    try:
        if kind == "groups":
            return GroupsPlan(int(arg))
        if kind == "bucket_mb":
            return SizeCapPlan(float(arg))
    except ValueError:
        pass
    raise refuse
