"""Fixed fusion plans (docs/algorithms.md §8).

A planner receives the byte sizes of the gradient tensors in gradient-ready order and returns the
sizes of the contiguous groups it cuts them into (each group becomes one bucket). In Python a plan is
given as a string: ``"layerwise"``, ``"single"``, ``"groups:N"``, ``"bucket_mb:X"``, ``"auto"``
(``"auto:S"``: profile ``S`` steps), ``"file:PATH"``, or an object.
"""

from __future__ import annotations

import bisect
import json
from itertools import accumulate
from typing import Any

FUSION_FORMS = (
    "'layerwise', 'single', 'groups:N' (N >= 1 integer), 'bucket_mb:X' (X > 0 megabytes), "
    "'auto' or 'auto:S' (S >= 1 profiled steps), 'file:PATH' (a plan exported by fusion=auto)"
)
PLAN_FILE_FORMAT = 1


class FusionPlanner:
    """Cuts tensors (byte sizes in gradient-ready order) into contiguous groups. What a planner is
    it declares, for the synchronisers and the checks before any work to ask."""

    #: the plan is chosen by measuring the running synchroniser's own steps and collectives
    measured = False
    #: the plan names the model's tensors and their gradient-ready order (it fits one model only)
    fixes_tensors = False

    def plan(self, sizes: list[int]) -> list[int]:
        """Return the number of tensors in each group; they sum to ``len(sizes)``."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class LayerwisePlanner(FusionPlanner):
    """One tensor per bucket: the research frameworks' layer-wise compression."""

    def plan(self, sizes: list[int]) -> list[int]:
        return [1] * len(sizes)

    def describe(self) -> str:
        return "layerwise"


class SinglePlanner(FusionPlanner):
    """All tensors in one bucket: least fixed cost, no overlap with backward."""

    def plan(self, sizes: list[int]) -> list[int]:
        return [len(sizes)] if sizes else []

    def describe(self) -> str:
        return "single"


class GroupsPlanner(FusionPlanner):
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


class SizeCapPlanner(FusionPlanner):
    """DDP's bucketing (``bucket_cap_mb``): close a bucket once it holds at least ``cap_mb``
    megabytes, except the first, which closes at ``min(1 MiB, cap_mb)`` as in DDP
    (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``) so that communication starts early in backward."""

    FIRST_BUCKET_BYTES = 1024 * 1024

    def __init__(self, cap_mb: float) -> None:
        if isinstance(cap_mb, bool) or not isinstance(cap_mb, (int, float)) or not cap_mb > 0:
            raise ValueError(f"X = {cap_mb!r} must be a number > 0")
        self.cap_mb = float(cap_mb)

    def plan(self, sizes: list[int]) -> list[int]:
        cap = self.cap_mb * 1024 * 1024
        limit = min(self.FIRST_BUCKET_BYTES, cap)
        cut, count, held = [], 0, 0
        for size in sizes:
            count += 1
            held += size
            if held >= limit:
                cut.append(count)
                count, held, limit = 0, 0, cap
        if count:
            cut.append(count)
        return cut

    def describe(self) -> str:
        return f"bucket_mb:{self.cap_mb:g}"


class AutoPlanner(FusionPlanner):
    """Chosen by measurement (the Cupcake idea, solved exactly): the synchroniser runs the ``default``
    plan for ``profile_steps`` steps to settle and ``profile_steps`` steps of profiling, then searches
    the plan with the smallest simulated step time (:mod:`gc_strategy.fusion.timeline`) and rebuilds
    its buckets on every rank at the same step. Until then this planner answers with ``default``."""

    measured = True

    def __init__(self, profile_steps: int = 5, default: FusionPlanner | None = None) -> None:
        if isinstance(profile_steps, bool) or not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"S = {profile_steps!r} must be an integer >= 1")
        self.profile_steps = profile_steps
        self.default = default or SizeCapPlanner(25)

    def plan(self, sizes: list[int]) -> list[int]:
        return self.default.plan(sizes)

    def describe(self) -> str:
        return "auto" if self.profile_steps == 5 else f"auto:{self.profile_steps}"


def write_plan_file(
    path: str, order: list[str], numels: list[int], groups: list[int], chosen_by: str, report: Any = None
) -> None:
    """Write a plan as :class:`FilePlanner` reads it (JSON): the gradient-ready order of the
    parameters, their element counts, the number of tensors in each bucket, which planner chose it
    and, for ``fusion=auto``, its report."""
    plan = {
        "format": PLAN_FILE_FORMAT,
        "order": order,
        "numels": numels,
        "groups": groups,
        "chosen_by": chosen_by,
        "report": report,
    }
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)


class FilePlanner(FusionPlanner):
    """A plan written by :func:`write_plan_file` (``GradientSynchronizer.export_plan``): the
    gradient-ready order of the parameters and the number of tensors in each bucket. It must
    describe this model exactly."""

    fixes_tensors = True

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("format") != PLAN_FILE_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {PLAN_FILE_FORMAT}")
            self.order = [str(name) for name in data["order"]]
            self.numels = [int(n) for n in data["numels"]]
            self.cut = [int(g) for g in data["groups"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"fusion = 'file:{path}': not a readable plan file ({error})") from None
        if len(self.numels) != len(self.order) or sum(self.cut) != len(self.order) or min(self.cut, default=1) < 1:
            raise ValueError(
                f"fusion = 'file:{path}': its tensors per bucket {self.cut} do not cover its {len(self.order)} tensors"
            )

    def check(self, numels: dict[str, int]) -> None:
        """Refuse a plan that does not describe the model whose parameter sizes are ``numels``."""
        missing = sorted(set(numels) - set(self.order))
        extra = sorted(set(self.order) - set(numels))
        wrong = [n for n, size in zip(self.order, self.numels) if n in numels and numels[n] != size]
        if missing or extra or wrong:
            raise ValueError(
                f"fusion = 'file:{self.path}' does not match this model: parameters missing from the plan "
                f"{missing[:5]}, in the plan but not the model {extra[:5]}, with other sizes {wrong[:5]}"
            )

    def plan(self, sizes: list[int]) -> list[int]:
        if len(sizes) != len(self.order):
            raise ValueError(f"fusion = 'file:{self.path}' plans {len(self.order)} tensors, not {len(sizes)}")
        return list(self.cut)

    def describe(self) -> str:
        return f"file:{self.path}"


def parse_fusion(spec: str | FusionPlanner) -> FusionPlanner:
    """Build a planner from its string form (or pass a planner object through)."""
    if isinstance(spec, FusionPlanner):
        return spec
    refuse = ValueError(f"fusion = {spec!r} is invalid; allowed: {FUSION_FORMS}, or a FusionPlanner object")
    if not isinstance(spec, str):
        raise refuse
    kind, _, arg = spec.partition(":")
    if kind == "layerwise" and not arg:
        return LayerwisePlanner()
    if kind == "single" and not arg:
        return SinglePlanner()
    if kind == "auto" and not arg:
        return AutoPlanner()
    if kind == "file" and arg:
        return FilePlanner(arg)
    try:
        if kind == "auto":
            return AutoPlanner(int(arg))
        if kind == "groups":
            return GroupsPlanner(int(arg))
        if kind == "bucket_mb":
            return SizeCapPlanner(float(arg))
    except ValueError:
        pass
    raise refuse
