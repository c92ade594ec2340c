"""``fusion="auto"``: profile the first steps of training, fit the timeline model, search the best plan.

The :class:`AutoTuner` serves a :class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer` whose
planner is an :class:`~gc_strategy.fusion.plans.AutoPlanner` (``auto:S``), through the synchroniser's
public API only (:class:`~gc_strategy.sync.paths.profiler.TunedSynchronizer`: its roles, process group, bucket
order and sizes, and ``rebucket``); the planning itself (plans, timeline model, search) is
:mod:`gc_strategy.fusion`, which knows no synchroniser. Once the gradient-ready order is known:

1. **Settle**: ``S`` steps pass (the first steps of a process are slower than the rest: the
   allocator and caches are still cold).
2. **Profile**, ``S`` steps with the default plan: each tensor's ready time within backward, on a
   clock that leaves out the synchroniser's own work in the gradient hooks (a monotonic host clock on
   the CPU; CUDA events on the compute stream on GPU), and the iteration period, hence ``other`` =
   period - (first gradient ready -> end of synchronisation). At the end of that step, on every rank,
   the compressor's encode and decode and the communicator's exchange are timed with real
   collectives on buckets cut from the model's own tensors (real shapes, and the raw local gradients
   of the last settling step: what the compressor sees in training, not the averages that ``.grad``
   holds after a synchronised step) at sizes spread geometrically from one tensor to the whole model:
   the *shape* of the cost curves. With ``hierarchy="node"`` each sample runs the whole node
   exchange (:func:`~gc_strategy.sync.paths.profiler.measure_costs`).
3. **Trials**, ``S`` steps each with a few fixed plans of different granularity (:data:`TRIAL_PLANS`):
   real step times of real plans in this training run.
4. **Fit and search**: the compression and communication curves are scaled by the two factors under
   which the timeline model best reproduces every measured step time (least squares on log times);
   the exact search (:func:`~gc_strategy.fusion.timeline.best_plan`) then picks the plan.
5. **Verify**, ``S`` steps with that plan. The plan kept is the fastest *measured* one: the searched
   plan unless a trial plan was measured faster (the model is a model; the measurement decides).

Every measurement is reduced across ranks with ``max`` before it is used, so all ranks fit the same
model, and rank 0's plan is broadcast; the synchroniser rebuilds its buckets on every rank at the
same step (error-feedback state carries over by parameter name). :attr:`AutoTuner.report` holds the
plan, its predicted and measured step time, the trials with their measured and fitted times, and the
cost model. Re-planning later when conditions drift is not done: a plan is chosen once per
synchroniser (a resumed run keeps the plan stored in its checkpoint).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ...communicators import EAGER_AFTER_BYTES
from ...fusion.plans import AutoPlanner, GroupsPlanner, LayerwisePlanner, SinglePlanner, SizeCapPlanner
from ...fusion.timeline import Cost, CostModel, best_plan, simulate
from ..paths.profiler import TunedSynchronizer, measure_costs

#: fixed plans whose predicted times the report lists next to the chosen one
REFERENCE_PLANS = [LayerwisePlanner(), SinglePlanner(), GroupsPlanner(4), GroupsPlanner(16), SizeCapPlanner(25)]
#: plans run for S steps each after the profile: measured step times over a spread of bucket counts
TRIAL_PLANS = [LayerwisePlanner(), GroupsPlanner(2), GroupsPlanner(4), GroupsPlanner(8), GroupsPlanner(16)]
#: the fitted scale factors of the compression and the communication costs lie in [1/RANGE, RANGE]
SCALE_RANGE = 8.0


class AutoTuner:
    """Profiles, tries, plans and verifies for one synchroniser (see the module docstring)."""

    def __init__(self, synchronizer: TunedSynchronizer, planner: AutoPlanner) -> None:
        self.synchronizer = synchronizer
        self.steps = planner.profile_steps
        self.phase = "settle"  # -> "profile" -> "trial" -> "verify" -> "done"
        self._settled = 0
        self.report: dict[str, Any] | None = None
        self._ready: list[list[float]] = []
        self._other: list[float] = []
        self._periods: list[float] = []
        self._last_end: float | None = None
        self._step_marks: dict[str, Any] = {}  # parameter name -> when its gradient was ready
        self._first_wall: float | None = None
        self._model: CostModel | None = None  # the profiled cost model, before fitting
        self._fitted: CostModel | None = None  # after fitting its scales to the measured steps
        self._baselines: dict[str, Cost] = {}  # fp32 and bf16 allreduces' cost curves (uncompressed baselines)
        self._profile_s = 0.0
        self._gradients: dict[str, Tensor] = {}  # raw local gradients by parameter name, for the profile
        self._measured: dict[tuple[int, ...], float] = {}  # plan -> median step time (this rank)
        self._names: dict[tuple[int, ...], str] = {}
        self._queue: list[tuple[int, ...]] = []

    @property
    def recording(self) -> bool:
        return self.phase != "done" and self.synchronizer.ready_order is not None

    # ------------------------------------------------------------------ during backward
    def on_ready(self, name: str, excluded_s: float, grad: Tensor) -> None:
        """At the hook of parameter ``name``, whose local gradient is ``grad``; ``excluded_s``: the
        synchroniser's hook work so far. In the last settling step (whose times are not used) the
        gradient is kept for the profile's samples."""
        if self.phase == "settle" and self._settled == self.steps - 1:
            self._gradients[name] = grad.detach().flatten().float().clone()
        now = time.perf_counter()
        if self._first_wall is None:
            self._first_wall = now
        if self.synchronizer.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.synchronizer.device))
            self._step_marks[name] = event
        else:
            self._step_marks[name] = now - excluded_s

    def on_step_end(self) -> None:
        """After the synchronised backward's results are applied."""
        end = time.perf_counter()
        if self.phase == "settle":  # the first steps of a process run slower than the rest
            self._settled += 1
            self.phase = "profile" if self._settled >= self.steps else "settle"
            self._last_end, self._first_wall, self._step_marks = end, None, {}
            return
        if self._last_end is not None and self._first_wall is not None:
            period = end - self._last_end
            if self.phase == "profile":
                self._other.append(period - (end - self._first_wall))
            self._periods.append(period)
        if self.phase == "profile" and self._step_marks:
            self._ready.append(self._ready_times())
        self._first_wall, self._step_marks = None, {}
        if len(self._periods) < self.steps or (
            self.phase == "profile" and (len(self._ready) < self.steps or not self._other)
        ):
            self._last_end = end
            return
        self._measured[tuple(self.synchronizer.layout.tensors_per_bucket)] = statistics.median(self._periods)
        self._periods = []
        if self.phase == "profile":
            self._profile()
        if self.phase in ("profile", "trial"):
            self._next_trial_or_plan()
        elif self.phase == "verify":
            self._decide()
        self._last_end = time.perf_counter()  # the next period starts after this work

    def _ready_times(self) -> list[float]:
        """This step's ready times in bucket order, relative to the first (a tensor that got no
        gradient counts as ready with the tensor before it)."""
        marks = self._step_marks
        if self.synchronizer.device.type == "cuda":
            torch.cuda.current_stream(self.synchronizer.device).synchronize()
            first = next(iter(marks.values()))
            marks = {name: first.elapsed_time(event) / 1000 for name, event in marks.items()}
        origin = min(marks.values())
        times, last = [], 0.0
        for name in self.synchronizer.layout.order:
            mark = marks.get(name)
            last = max(last, mark - origin) if mark is not None else last
            times.append(last)
        return times

    # ------------------------------------------------------------------ profile, trials, plan
    def _profile(self) -> None:
        """The cost curves (microbenchmarks) and the ready times, reduced across ranks; the trials."""
        synchronizer = self.synchronizer
        start = time.perf_counter()
        numels = [synchronizer.layout.parameter(name).numel() for name in synchronizer.layout.order]
        sizes, costs, eager = measure_costs(synchronizer, self._gradients)
        self._gradients = {}
        ready = [statistics.median(column) for column in zip(*self._ready)]
        values = _max_across_ranks(synchronizer, [*ready, statistics.median(self._other), *costs.flatten().tolist()])
        ready, other = values[: len(numels)], values[len(numels)]
        encode, communicator, decode, between, fp32, bf16 = (
            Cost.measured(sizes, row) for row in torch.tensor(values[len(numels) + 1 :]).view(6, -1).tolist()
        )
        element = synchronizer.layout.parameter(synchronizer.layout.order[0]).element_size()
        self._model = CostModel(
            tuple(ready),
            tuple(numels),
            encode,
            communicator,
            decode,
            other=max(other, 0.0),
            between=between,
            advance_at=EAGER_AFTER_BYTES / element if eager else None,
        )
        self._baselines = {"fp32": fp32, "bf16": bf16}
        nbytes = synchronizer.layout.tensor_nbytes(synchronizer.layout.order)
        self._names = {tuple(synchronizer.layout.tensors_per_bucket): synchronizer.planner.default.describe()}
        for plan in TRIAL_PLANS:
            self._names.setdefault(tuple(plan.plan(nbytes)), plan.describe())
        self._queue = [cut for cut in self._names if cut not in self._measured]
        self._profile_s = time.perf_counter() - start
        self.phase = "trial"

    def _next_trial_or_plan(self) -> None:
        if self._queue:
            self.synchronizer.layout.rebucket(list(self._queue.pop(0)))
        else:
            self._plan()

    def _plan(self) -> None:
        synchronizer = self.synchronizer
        start = time.perf_counter()
        tried = list(self._measured)
        measured = dict(zip(tried, _max_across_ranks(synchronizer, [self._measured[g] for g in tried])))
        scales, model = fit_scales(self._model, measured)
        search = time.perf_counter()
        cut, _ = best_plan(model)
        search_s = time.perf_counter() - search
        cut = _broadcast_plan(synchronizer, cut)
        free = Cost.linear(0.0, 0.0)
        nbytes = synchronizer.layout.tensor_nbytes(synchronizer.layout.order)
        plan = SizeCapPlanner(25).plan(nbytes)
        baselines = {
            precision: simulate(CostModel(model.ready, model.numels, free, cost, free, model.other), plan)
            for precision, cost in self._baselines.items()
        }
        self._measured = measured
        self.report = {
            "searched_groups": cut,
            "searched_measured_step_s": None,
            "compression_cost_scale": scales[0],
            "communication_cost_scale": scales[1],
            "trials": [
                {
                    "plan": self._names[g],
                    "groups": list(g),
                    "measured_step_s": t,
                    "predicted_step_s": simulate(model, list(g)),
                }
                for g, t in measured.items()
            ],
            "predicted_other_plans_s": {p.describe(): simulate(model, p.plan(nbytes)) for p in REFERENCE_PLANS},
            "predicted_fp32_allreduce_s": baselines["fp32"],
            "predicted_bf16_allreduce_s": baselines["bf16"],
            "profile_s": self._profile_s + time.perf_counter() - start,
            "search_s": search_s,
            "cost_model": model.to_dict(),
        }
        self._fitted = model
        self._describe_plan(cut, measured_s=None)
        synchronizer.layout.rebucket(cut)
        self.phase = "verify"

    def _decide(self) -> None:
        """Keep the fastest measured plan: the searched one (as verified: if it was also a trial, the
        newer measurement counts), or a trial that was measured faster."""
        searched = tuple(self.report["searched_groups"])
        (verified,) = _max_across_ranks(self.synchronizer, [self._measured[searched]])
        self._measured[searched] = verified
        self.report["searched_measured_step_s"] = verified
        best = min(self._measured, key=lambda g: (self._measured[g], g != searched))
        if best != searched:
            self.synchronizer.layout.rebucket(list(best))
        self._describe_plan(list(best), measured_s=self._measured[best])
        self.report["chosen_by"] = "search" if best == searched else f"measurement (trial {self._names[best]})"
        self.phase = "done"

    def _describe_plan(self, cut: list[int], measured_s: float | None) -> None:
        nbytes = self.synchronizer.layout.tensor_nbytes(self.synchronizer.layout.order)
        self.report.update(
            {
                "groups": cut,
                "buckets": len(cut),
                "bucket_mb": [round(sum(nbytes[a:b]) / 2**20, 3) for a, b in _ranges(cut)],
                "predicted_step_s": simulate(self._fitted, cut),
                "measured_step_s": measured_s,
            }
        )
        self.report["compression_pays"] = self.report["predicted_step_s"] < self.report["predicted_bf16_allreduce_s"]

    def restore(self, report: dict[str, Any]) -> None:
        """A plan restored from a checkpoint: nothing left to profile."""
        self.report, self.phase = report, "done"


def fit_scales(model: CostModel, measured: dict[tuple[int, ...], float]) -> tuple[tuple[float, float], CostModel]:
    """The factors ``(a, b)`` by which to scale the compression (encode, decode) and the
    communication cost curves so that the timeline model best reproduces the step times
    ``measured`` of the plans tried: least squares on ``log(simulated) - log(measured)``, over a
    geometric grid in ``[1/SCALE_RANGE, SCALE_RANGE]`` refined three times around its best point. The
    microbenchmarks give the shape of each cost over sizes; the training steps, where compression
    and collectives compete with everything else on the device, give their level."""
    plans = [(list(cut), np.log(seconds)) for cut, seconds in measured.items()]

    def error(a: float, b: float) -> float:
        scaled = model.scaled(a, b)
        return sum((np.log(simulate(scaled, cut)) - target) ** 2 for cut, target in plans)

    limit = np.log2(SCALE_RANGE)
    centre, half_width = (0.0, 0.0), limit
    for points in (13, 7, 7, 7):  # log2 grid: 0.5 steps, then 3 refinements around the best
        axis = np.linspace(-half_width, half_width, points)
        grid = [
            (np.clip(centre[0] + x, -limit, limit), np.clip(centre[1] + y, -limit, limit)) for x in axis for y in axis
        ]
        centre = min(grid, key=lambda p: (error(2 ** p[0], 2 ** p[1]), abs(p[0]) + abs(p[1])))
        half_width = 2 * half_width / (points - 1)
    a, b = 2 ** centre[0], 2 ** centre[1]
    return (float(a), float(b)), model.scaled(a, b)


def _max_across_ranks(synchronizer: TunedSynchronizer, values: list[float]) -> list[float]:
    measured = torch.tensor(values, dtype=torch.float64)
    if synchronizer.world_size > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=synchronizer.process_group)
    return measured.tolist()


def _broadcast_plan(synchronizer: TunedSynchronizer, cut: list[int]) -> list[int]:
    """Identical inputs give identical plans; rank 0's is authoritative."""
    if synchronizer.world_size == 1:
        return cut
    padded = torch.zeros(len(synchronizer.layout.order), dtype=torch.int64)
    padded[: len(cut)] = torch.tensor(cut)
    dist.broadcast(padded, _rank0(synchronizer), group=synchronizer.process_group)
    return [g for g in padded.tolist() if g > 0]


def _rank0(synchronizer: TunedSynchronizer) -> int:
    return dist.get_global_rank(synchronizer.process_group, 0) if synchronizer.process_group is not None else 0


def _ranges(groups: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for count in groups:
        out.append((start, start + count))
        start += count
    return out
