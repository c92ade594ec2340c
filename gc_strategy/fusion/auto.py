"""``fusion="auto"``: profile the first steps of training, fit the timeline model, search the best plan.

The :class:`AutoTuner` lives inside a :class:`~gc_strategy.engine.GradientSynchronizer` whose planner
is an :class:`~gc_strategy.fusion.plans.AutoPlan`. Once the gradient-ready order is known it lets
``profile_steps`` steps pass (the first steps of a process are slower than the rest: the allocator
and caches are still cold), then records, for ``profile_steps`` steps run with the default plan:

- each tensor's ready time within backward, on a clock that leaves out the synchroniser's own work
  in the gradient hooks (a monotonic host clock on the CPU; CUDA events on the compute stream on GPU),
- the iteration period, hence ``other`` = period - (first gradient ready -> end of synchronisation).

Then, at the end of the same step on every rank, it measures the compressor's encode and decode and
the communicator's exchange with real collectives on buckets cut from the model's own tensors
(real shapes, real gradient values) at sizes spread geometrically from one tensor to the whole
model, reduces every measurement across ranks with ``max`` (all ranks then hold the same numbers),
makes :class:`~gc_strategy.fusion.timeline.Cost` curves of them, searches
the plan exactly (:func:`~gc_strategy.fusion.timeline.best_plan`), broadcasts rank 0's plan and has
the synchroniser rebuild its buckets. For ``profile_steps`` more steps it measures the period again,
so :attr:`AutoTuner.report` holds the predicted and the measured step time side by side.

Re-planning when measurements drift is not done: a plan is chosen once per synchroniser (a resumed
run keeps the plan stored in its checkpoint).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..bucket import Bucket
from .plans import AutoPlan, GroupsPlan, LayerwisePlan, SinglePlan, SizeCapPlan
from .timeline import Cost, CostModel, best_plan, simulate

if TYPE_CHECKING:
    from ..engine import GradientSynchronizer

#: timed runs per sample bucket (after one warm-up run, the samples interleaved); the median is kept
RUNS = 5
#: fixed plans whose predicted times the report lists next to the chosen one
REFERENCE_PLANS = [LayerwisePlan(), SinglePlan(), GroupsPlan(4), GroupsPlan(16), SizeCapPlan(25)]


class AutoTuner:
    """Profiles, plans and verifies for one synchroniser (see the module docstring)."""

    def __init__(self, engine: "GradientSynchronizer", planner: AutoPlan) -> None:
        self.engine = engine
        self.steps = planner.profile_steps
        self.phase = "settle"  # -> "profile" -> "verify" after planning -> "done"
        self._settled = 0
        self.report: dict[str, Any] | None = None
        self._ready: list[list[float]] = []
        self._other: list[float] = []
        self._periods: list[float] = []
        self._last_end: float | None = None
        self._step_marks: dict[int, Any] = {}
        self._first_wall: float | None = None

    @property
    def recording(self) -> bool:
        return self.phase != "done" and self.engine.ready_order is not None

    # ------------------------------------------------------------------ during backward
    def on_ready(self, index: int, excluded_s: float) -> None:
        """At the hook of parameter ``index``; ``excluded_s``: the synchroniser's hook work so far."""
        now = time.perf_counter()
        if self._first_wall is None:
            self._first_wall = now
        if self.engine.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.engine.device))
            self._step_marks[index] = event
        else:
            self._step_marks[index] = now - excluded_s

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
        self._last_end, self._first_wall, self._step_marks = end, None, {}
        if self.phase == "profile" and len(self._ready) >= self.steps and self._other:
            self._plan()
            self._last_end = time.perf_counter()  # the next period starts after the planning
        elif self.phase == "verify" and len(self._periods) >= self.steps:
            self.report["measured_step_s"] = statistics.median(self._periods)
            self.phase = "done"

    def _ready_times(self) -> list[float]:
        """This step's ready times in bucket order, relative to the first (a tensor that got no
        gradient counts as ready with the tensor before it)."""
        marks = self._step_marks
        if self.engine.device.type == "cuda":
            torch.cuda.current_stream(self.engine.device).synchronize()
            first = next(iter(marks.values()))
            marks = {i: first.elapsed_time(event) / 1000 for i, event in marks.items()}
        origin = min(marks.values())
        times, last = [], 0.0
        for name in self.engine.order:
            mark = marks.get(self.engine._index[name])
            last = max(last, mark - origin) if mark is not None else last
            times.append(last)
        return times

    # ------------------------------------------------------------------ planning
    def _plan(self) -> None:
        engine = self.engine
        start = time.perf_counter()
        numels = [engine._param(name).numel() for name in engine.order]
        sizes, costs = measure_costs(engine, numels)
        ready = [statistics.median(column) for column in zip(*self._ready)]
        steps = [statistics.median(self._other), statistics.median(self._periods)]
        measured = torch.tensor([*ready, *steps, *costs.flatten().tolist()], dtype=torch.float64)
        if engine.world_size > 1:
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=engine.group)
        values = measured.tolist()
        ready, (other, default_step) = values[: len(numels)], values[len(numels) : len(numels) + 2]
        encode, comm, decode, fp32 = (Cost.measured(sizes, row) for row in torch.tensor(values[len(numels) + 2 :]).view(4, -1).tolist())
        uncalibrated = CostModel(tuple(ready), tuple(numels), encode, comm, decode, other=max(other, 0.0))
        scale, model = calibrate(uncalibrated, engine.groups, default_step)
        search = time.perf_counter()
        groups, _ = best_plan(model)
        search_s = time.perf_counter() - search
        if engine.world_size > 1:  # identical inputs give identical plans; rank 0's is authoritative
            padded = torch.zeros(len(numels), dtype=torch.int64)
            padded[: len(groups)] = torch.tensor(groups)
            dist.broadcast(padded, _rank0(engine), group=engine.group)
            groups = [g for g in padded.tolist() if g > 0]
        free = Cost.linear(0.0, 0.0)
        baseline = CostModel(model.ready, model.numels, free, fp32, free, other=model.other)
        element_size = engine._param(engine.order[0]).element_size()
        nbytes = [n * element_size for n in numels]
        self.report = {
            "groups": groups,
            "default_plan_measured_step_s": default_step,
            "compression_cost_scale": scale,
            "buckets": len(groups),
            "bucket_mb": [round(sum(nbytes[a:b]) / 2**20, 3) for a, b in _ranges(groups)],
            "predicted_step_s": simulate(model, groups),
            "predicted_other_plans_s": {p.describe(): simulate(model, p.plan(nbytes)) for p in REFERENCE_PLANS},
            "predicted_fp32_allreduce_s": simulate(baseline, SizeCapPlan(25).plan(nbytes)),
            "measured_step_s": None,
            "profile_s": time.perf_counter() - start,
            "search_s": search_s,
            "cost_model": model.to_dict(),
        }
        engine._rebuild(engine.order, groups)
        self._periods = []
        self.phase = "verify"

    def restore(self, report: dict[str, Any]) -> None:
        """A plan restored from a checkpoint: nothing left to profile."""
        self.report, self.phase = report, "done"


def calibrate(model: CostModel, groups: list[int], measured_step: float) -> tuple[float, CostModel]:
    """Scale the encode and decode curves by the factor ``s`` (within [1/4, 4]) under which the model
    reproduces ``measured_step``, the step time measured with the plan ``groups`` during profiling.
    The microbenchmark gives the shape of the compression cost over sizes; the real training step,
    where compression competes with everything else on the device, gives its level."""

    def scaled(s: float) -> CostModel:
        def times(cost: Cost) -> Cost:
            return Cost(cost.sizes, tuple(s * t for t in cost.seconds))

        return CostModel(model.ready, model.numels, times(model.encode), model.comm, times(model.decode), model.other)

    low, high = 0.25, 4.0
    if simulate(scaled(low), groups) >= measured_step:
        return low, scaled(low)
    if simulate(scaled(high), groups) <= measured_step:
        return high, scaled(high)
    for _ in range(50):  # the simulated time is non-decreasing in s
        middle = (low + high) / 2
        low, high = (middle, high) if simulate(scaled(middle), groups) < measured_step else (low, middle)
    return (low + high) / 2, scaled((low + high) / 2)


def _rank0(engine: "GradientSynchronizer") -> int:
    return dist.get_global_rank(engine.group, 0) if engine.group is not None else 0


def _ranges(groups: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for count in groups:
        out.append((start, start + count))
        start += count
    return out


def sample_ranges(numels: list[int]) -> list[tuple[int, int]]:
    """Tensor ranges to time: the smallest tensor, and prefixes of the gradient-ready order whose
    sizes grow by about 2x from there up to the whole model."""
    smallest = min(range(len(numels)), key=lambda i: numels[i])
    picks = {(smallest, smallest + 1), (0, len(numels))}
    total, target, prefix, end = sum(numels), max(numels[smallest], 1) * 2, 0, 0
    while target < total:
        while prefix < target:
            prefix += numels[end]
            end += 1
        picks.add((0, end))
        target = max(target * 2, prefix + 1)
    return sorted(picks, key=lambda r: (sum(numels[r[0] : r[1]]), r))


def measure_costs(engine: "GradientSynchronizer", numels: list[int]) -> tuple[list[int], torch.Tensor]:
    """Bucket sizes (elements) and, on this rank, ``[4, sizes]`` median seconds of: encode (with the
    memory's compensation), communication, decode (with the memory's update) of this synchroniser's
    roles, and an fp32 allreduce of the same bucket (the uncompressed baseline)."""
    from ..algos import COMPRESSORS
    from ..comm import COMMUNICATORS

    compressor = type(engine.compressor)(**engine.compressor.options)
    memory = type(engine.memory)(**engine.memory.options)
    compressor.world_size, compressor.rank = engine.world_size, engine.comm.rank
    compressor.step = 1 << 30  # steady state: past start_iter / density warm-up
    plain = COMPRESSORS.build("none")
    plain.world_size, plain.rank = compressor.world_size, compressor.rank
    allreduce = COMMUNICATORS.build("allreduce")
    allreduce.bind(engine.group)
    gradient = torch.cat([_gradient(engine._param(name)) for name in engine.order])
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    samples = []
    for index, (a, b) in enumerate(sample_ranges(numels)):
        names = engine.order[a:b]
        bucket = Bucket(index, names, [engine._param(name).shape for name in names], torch.float32, engine.device)
        samples.append((bucket, gradient[offsets[a] : offsets[b]]))
    times: list[list[list[float]]] = [[] for _ in samples]  # [sample][run] = [enc, comm, dec, fp32 comm]
    for run in range(RUNS + 1):  # round by round, so that a burst of machine noise hits all sizes alike
        for (bucket, flat), timed in zip(samples, times):
            ours = time_exchange(compressor, memory, engine.comm, flat, bucket)[:3]
            fp32 = time_exchange(plain, None, allreduce, flat, bucket)[1]
            if run:
                timed.append([*ours, fp32])
    rows = [[statistics.median(column) for column in zip(*timed)] for timed in times]
    return [bucket.numel for bucket, _ in samples], torch.tensor(rows, dtype=torch.float64).T


def _gradient(param: torch.nn.Parameter) -> Tensor:
    if param.grad is None:
        return torch.zeros(param.numel(), device=param.device)
    return param.grad.detach().flatten().float()


def time_exchange(compressor, memory, communicator, flat: Tensor, bucket: Bucket) -> tuple[float, float, float, int]:
    """(encode, communication, decode) seconds of one bucket's exchange, all ranks of the
    communicator's group starting together (``memory`` may be None), and the bytes it sent.
    Encode includes the memory's compensation, communication every round and the work between
    rounds, decode the last combine and the memory's update."""
    cuda = flat.is_cuda

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(flat.device)
        return time.perf_counter()

    if communicator.world_size > 1:
        dist.barrier(group=communicator.group)
    start = now()
    need_local = memory is not None and memory.needs_local_estimate
    compensated = memory.compensate(flat, bucket) if memory is not None else flat
    exchange = compressor.exchange(compensated, bucket, communicator, need_local)
    current = next(exchange)
    encoded = now()
    sent = 0
    while True:
        sent += current.nbytes
        value = current.wait()
        received = now()
        try:
            current = exchange.send(value)
        except StopIteration as stop:
            average, local = stop.value
            if need_local:
                memory.update(compensated, local, bucket, torch.isfinite(flat).all())
            finished = now()
            break
    return encoded - start, received - encoded, finished - received, sent
