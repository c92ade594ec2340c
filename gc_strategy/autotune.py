"""``fusion="auto"``: profile the first steps of training, fit the timeline model, search the best plan.

The :class:`AutoTuner` serves a :class:`~gc_strategy.engine.GradientSynchronizer` whose planner is
an :class:`~gc_strategy.fusion.plans.AutoPlan` (``auto:S``), through the synchroniser's public API
only (:class:`Synchronizer`: its roles, process group, bucket order and sizes, and ``rebucket``);
the planning itself (plans, timeline model, search) is :mod:`gc_strategy.fusion`, which knows no
synchroniser. Once the gradient-ready order is known:

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
   exchange (:func:`measure_costs`).
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
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from .algos import COMPRESSORS, MEMORIES, Compressor, Memory
from .bucket import Bucket
from .communicators import COMMUNICATORS, EAGER_AFTER_BYTES, Communicator, RunningExchange
from .fusion.plans import AutoPlan, GroupsPlan, LayerwisePlan, SinglePlan, SizeCapPlan
from .fusion.timeline import Cost, CostModel, best_plan, simulate
from .hierarchy import NodeGroups, node_exchange
from .registry import fresh_copy

#: timed runs per sample bucket (after one warm-up run, the samples interleaved); the median is kept
RUNS = 5
#: fixed plans whose predicted times the report lists next to the chosen one
REFERENCE_PLANS = [LayerwisePlan(), SinglePlan(), GroupsPlan(4), GroupsPlan(16), SizeCapPlan(25)]
#: plans run for S steps each after the profile: measured step times over a spread of bucket counts
TRIAL_PLANS = [LayerwisePlan(), GroupsPlan(2), GroupsPlan(4), GroupsPlan(8), GroupsPlan(16)]
#: the fitted scale factors of the compression and the communication costs lie in [1/RANGE, RANGE]
SCALE_RANGE = 8.0


class Synchronizer(Protocol):
    """What the tuner uses of a :class:`~gc_strategy.engine.GradientSynchronizer`: its public API."""

    compressor: Compressor
    memory: Memory
    communicator: Communicator
    planner: AutoPlan
    process_group: Any
    #: hierarchy="node": this rank's node groups (None for a flat exchange), and the precision inside
    nodes: NodeGroups | None
    node_precision: str
    device: torch.device
    world_size: int
    rank: int
    #: the gradient-ready order (None before the first synchronised step)
    ready_order: list[str] | None
    #: the parameters' names in bucket order, and how many of them each bucket holds
    order: list[str]
    tensors_per_bucket: list[int]

    def parameter(self, name: str) -> nn.Parameter: ...

    def tensor_nbytes(self, names: list[str]) -> list[int]: ...

    def rebucket(self, tensors_per_bucket: list[int]) -> None: ...


class AutoTuner:
    """Profiles, tries, plans and verifies for one synchroniser (see the module docstring)."""

    def __init__(self, engine: Synchronizer, planner: AutoPlan) -> None:
        self.engine = engine
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
        return self.phase != "done" and self.engine.ready_order is not None

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
        if self.engine.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.engine.device))
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
        self._measured[tuple(self.engine.tensors_per_bucket)] = statistics.median(self._periods)
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
        if self.engine.device.type == "cuda":
            torch.cuda.current_stream(self.engine.device).synchronize()
            first = next(iter(marks.values()))
            marks = {name: first.elapsed_time(event) / 1000 for name, event in marks.items()}
        origin = min(marks.values())
        times, last = [], 0.0
        for name in self.engine.order:
            mark = marks.get(name)
            last = max(last, mark - origin) if mark is not None else last
            times.append(last)
        return times

    # ------------------------------------------------------------------ profile, trials, plan
    def _profile(self) -> None:
        """The cost curves (microbenchmarks) and the ready times, reduced across ranks; the trials."""
        engine = self.engine
        start = time.perf_counter()
        numels = [engine.parameter(name).numel() for name in engine.order]
        sizes, costs, eager = measure_costs(engine, numels, self._gradients)
        self._gradients = {}
        ready = [statistics.median(column) for column in zip(*self._ready)]
        values = _max_across_ranks(engine, [*ready, statistics.median(self._other), *costs.flatten().tolist()])
        ready, other = values[: len(numels)], values[len(numels)]
        encode, communicator, decode, between, fp32, bf16 = (
            Cost.measured(sizes, row) for row in torch.tensor(values[len(numels) + 1 :]).view(6, -1).tolist()
        )
        element = engine.parameter(engine.order[0]).element_size()
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
        nbytes = engine.tensor_nbytes(engine.order)
        self._names = {tuple(engine.tensors_per_bucket): engine.planner.default.describe()}
        for plan in TRIAL_PLANS:
            self._names.setdefault(tuple(plan.plan(nbytes)), plan.describe())
        self._queue = [groups for groups in self._names if groups not in self._measured]
        self._profile_s = time.perf_counter() - start
        self.phase = "trial"

    def _next_trial_or_plan(self) -> None:
        if self._queue:
            self.engine.rebucket(list(self._queue.pop(0)))
        else:
            self._plan()

    def _plan(self) -> None:
        engine = self.engine
        start = time.perf_counter()
        tried = list(self._measured)
        measured = dict(zip(tried, _max_across_ranks(engine, [self._measured[g] for g in tried])))
        scales, model = fit_scales(self._model, measured)
        search = time.perf_counter()
        groups, _ = best_plan(model)
        search_s = time.perf_counter() - search
        groups = _broadcast_plan(engine, groups)
        free = Cost.linear(0.0, 0.0)
        nbytes = engine.tensor_nbytes(engine.order)
        plan = SizeCapPlan(25).plan(nbytes)
        baselines = {
            precision: simulate(CostModel(model.ready, model.numels, free, cost, free, model.other), plan)
            for precision, cost in self._baselines.items()
        }
        self._measured = measured
        self.report = {
            "searched_groups": groups,
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
        self._describe_plan(groups, measured_s=None)
        engine.rebucket(groups)
        self.phase = "verify"

    def _decide(self) -> None:
        """Keep the fastest measured plan: the searched one (as verified: if it was also a trial, the
        newer measurement counts), or a trial that was measured faster."""
        searched = tuple(self.report["searched_groups"])
        (verified,) = _max_across_ranks(self.engine, [self._measured[searched]])
        self._measured[searched] = verified
        self.report["searched_measured_step_s"] = verified
        best = min(self._measured, key=lambda g: (self._measured[g], g != searched))
        if best != searched:
            self.engine.rebucket(list(best))
        self._describe_plan(list(best), measured_s=self._measured[best])
        self.report["chosen_by"] = "search" if best == searched else f"measurement (trial {self._names[best]})"
        self.phase = "done"

    def _describe_plan(self, groups: list[int], measured_s: float | None) -> None:
        nbytes = self.engine.tensor_nbytes(self.engine.order)
        self.report.update(
            {
                "groups": groups,
                "buckets": len(groups),
                "bucket_mb": [round(sum(nbytes[a:b]) / 2**20, 3) for a, b in _ranges(groups)],
                "predicted_step_s": simulate(self._fitted, groups),
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
    plans = [(list(groups), np.log(seconds)) for groups, seconds in measured.items()]

    def error(a: float, b: float) -> float:
        scaled = model.scaled(a, b)
        return sum((np.log(simulate(scaled, groups)) - target) ** 2 for groups, target in plans)

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


def _max_across_ranks(engine: Synchronizer, values: list[float]) -> list[float]:
    measured = torch.tensor(values, dtype=torch.float64)
    if engine.world_size > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=engine.process_group)
    return measured.tolist()


def _broadcast_plan(engine: Synchronizer, groups: list[int]) -> list[int]:
    """Identical inputs give identical plans; rank 0's is authoritative."""
    if engine.world_size == 1:
        return groups
    padded = torch.zeros(len(engine.order), dtype=torch.int64)
    padded[: len(groups)] = torch.tensor(groups)
    dist.broadcast(padded, _rank0(engine), group=engine.process_group)
    return [g for g in padded.tolist() if g > 0]


def _rank0(engine: Synchronizer) -> int:
    return dist.get_global_rank(engine.process_group, 0) if engine.process_group is not None else 0


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


def measure_costs(
    engine: Synchronizer, numels: list[int], gradients: dict[str, Tensor]
) -> tuple[list[int], torch.Tensor, bool]:
    """Bucket sizes (elements) and, on this rank, ``[6, sizes]`` median seconds of: encode (with the
    memory's compensation), communication, decode (with the memory's update) and the work between
    rounds (PowerSGD's orthogonalisation) of this synchroniser's roles, and an fp32 and a bf16
    allreduce of the same bucket over all ranks (the uncompressed baselines), on samples cut from
    ``gradients`` (flat local gradients by parameter name; zeros where one is missing); and whether
    the exchange has an eager round (then it waits for the engine to advance it).

    With ``hierarchy="node"`` each sample runs the whole :func:`~gc_strategy.hierarchy.node_exchange`,
    owned by local rank 0 of every node. Its communication is the owner's time from the reduce inside
    the node to the broadcast's end, the owner's coding between them included (the exchange across
    nodes waits for it); its encode and decode are the owner's coding divided by the ranks per node,
    since each rank codes its share of the buckets (the work between rounds is in both, as coding).
    The other ranks report zeros (their wait holds the owner's coding), so the maximum across ranks
    is the owners'."""
    compressor, memory = fresh_copy(engine.compressor), fresh_copy(engine.memory)
    compressor.bind(engine.world_size, engine.rank)
    compressor.begin_step(1 << 30)  # steady state: past start_iter / density warm-up
    plain = {precision: COMPRESSORS.build(name) for precision, name in (("fp32", "none"), ("bf16", "bf16"))}
    for baseline in plain.values():
        baseline.bind(engine.world_size, engine.rank)
    allreduce = COMMUNICATORS.build("allreduce")
    allreduce.bind(engine.process_group)
    gradient = torch.cat(
        [
            gradients[name] if name in gradients else torch.zeros(engine.parameter(name).numel(), device=engine.device)
            for name in engine.order
        ]
    )
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    samples = []
    for index, (a, b) in enumerate(sample_ranges(numels)):
        names = engine.order[a:b]
        bucket = Bucket(index, names, [engine.parameter(name).shape for name in names], torch.float32, engine.device)
        samples.append((bucket, gradient[offsets[a] : offsets[b]]))
    times: list[list[list[float]]] = [[] for _ in samples]  # [sample][run] = [enc, comm, dec, btw, fp32, bf16]
    eager = False
    for run in range(RUNS + 1):  # round by round, so that a burst of machine noise hits all sizes alike
        for (bucket, flat), timed in zip(samples, times):
            if engine.nodes is None:
                ours = time_exchange(compressor, memory, engine.communicator, flat, bucket)
            else:
                ours = time_node_exchange(engine, compressor, memory, flat, bucket)
            eager = eager or ours.eager
            baselines = [time_exchange(plain[p], None, allreduce, flat, bucket).comm_s for p in ("fp32", "bf16")]
            if run:
                timed.append([ours.encode_s, ours.comm_s, ours.decode_s, ours.between_s, *baselines])
    rows = [[statistics.median(column) for column in zip(*timed)] for timed in times]
    return [bucket.numel for bucket, _ in samples], torch.tensor(rows, dtype=torch.float64).T, eager


class ExchangeTimes(NamedTuple):
    """One bucket's exchange, timed: seconds of encode, communication, decode and the work between
    rounds, the bytes this rank sent, and whether a round was eager."""

    encode_s: float
    comm_s: float
    decode_s: float
    between_s: float
    sent_bytes: int
    eager: bool


def time_node_exchange(
    engine: Synchronizer, compressor: Compressor, memory: Memory, flat: Tensor, bucket: Bucket
) -> ExchangeTimes:
    """hierarchy="node": one sample bucket's node exchange, timed as :func:`measure_costs` counts it:
    the owner's work between rounds is in its encode and communication, so ``between_s`` is 0; zero
    seconds on a rank that does not own it. Its eager round (the node's reduce) is on every rank."""
    nodes = engine.nodes
    flat = flat.clone()
    dist.barrier()
    exchange = node_exchange(nodes, 0, memory, compressor, engine.communicator, flat, bucket, engine.node_precision)
    running = RunningExchange(exchange, clock=_clock(flat))
    running.finish()
    if nodes.local_rank != 0:
        return ExchangeTimes(0.0, 0.0, 0.0, 0.0, running.sent_bytes, running.eager)
    coding = running.encode_s + running.between_s
    share = 1 / nodes.ranks_per_node
    return ExchangeTimes(
        share * coding, coding + running.wait_s, share * running.decode_s, 0.0, running.sent_bytes, running.eager
    )


def _clock(flat: Tensor) -> Callable[[], float]:
    """A host clock that first waits for ``flat``'s device (so it measures the device's work too)."""

    def now() -> float:
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        return time.perf_counter()

    return now


def time_exchange(
    compressor: Compressor, memory: Memory | None, communicator: Communicator, flat: Tensor, bucket: Bucket
) -> ExchangeTimes:
    """One bucket's exchange timed, all ranks of the communicator's group starting together
    (``memory`` may be None); the exchange runs as the engine runs it (the memory's
    :meth:`~gc_strategy.algos.base.Memory.exchange` driven by a
    :class:`~gc_strategy.communicators.RunningExchange`). Encode includes the memory's
    compensation, communication every round, decode the last combine and the memory's update,
    between the work between rounds. ``flat`` is left as it was."""
    memory = memory if memory is not None else MEMORIES.build("none")
    flat = flat.clone()  # an exchange may overwrite its gradient buffer: keep the sample as it is
    if communicator.world_size > 1:
        dist.barrier(group=communicator.group)
    running = RunningExchange(memory.exchange(compressor, flat, bucket, communicator), clock=_clock(flat))
    running.finish()
    return ExchangeTimes(
        running.encode_s, running.wait_s, running.decode_s, running.between_s, running.sent_bytes, running.eager
    )
