"""The costs of a synchroniser's roles, measured on this rank with real collectives: how
``fusion="auto"`` (:mod:`gc_strategy.sync.every_step.autotune`) and the benchmarks time an exchange.

:func:`time_exchange` runs one bucket's exchange as the synchroniser runs it and times its parts;
:func:`measure_costs` samples bucket sizes from one tensor to the whole model and returns the cost
curves the timeline model is fitted to.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from ...algos import Compressor, Memory
from ...bucket import Bucket
from ...communicators import Communicator, RunningExchange
from ...components import Components, build_components
from ...fusion.plans import AutoPlanner

#: timed runs per sample bucket (after one warm-up run, the samples interleaved); the median is kept
RUNS = 5


class TimedRoute(Protocol):
    """What the profiler uses of a :class:`~gc_strategy.sync.paths.routes.Route`."""

    def timed_exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> ExchangeTimes: ...


class TunedLayout(Protocol):
    """What the tuner and the profiler use of a :class:`~gc_strategy.sync.every_step.layout.BucketLayout`."""

    #: the parameters' names in bucket order, and how many of them each bucket holds
    order: list[str]
    tensors_per_bucket: list[int]

    def parameter(self, name: str) -> nn.Parameter: ...

    def tensor_nbytes(self, names: list[str]) -> list[int]: ...

    def rebucket(self, tensors_per_bucket: list[int]) -> None: ...


class TunedSynchronizer(Protocol):
    """What the tuner and the profiler use of a :class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer`:
    its public API."""

    compressor: Compressor
    memory: Memory
    communicator: Communicator
    #: the three with the planner, bound to the route's group
    roles: Components
    planner: AutoPlanner
    process_group: Any
    #: how its buckets travel across ranks
    route: TimedRoute
    device: torch.device
    world_size: int
    rank: int
    #: the gradient-ready order (None before the first synchronised step)
    ready_order: list[str] | None
    #: its buckets
    layout: TunedLayout


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


def sample_buckets(shapes: dict[str, torch.Size], gradient: Tensor) -> list[tuple[Bucket, Tensor]]:
    """Sample buckets of :func:`sample_ranges` over the tensors ``shapes`` (gradient-ready order),
    each with its part of ``gradient`` (their flat gradients, concatenated, fp32)."""
    names = list(shapes)
    offsets = [0]
    for name in names:
        offsets.append(offsets[-1] + shapes[name].numel())
    samples = []
    for index, (a, b) in enumerate(sample_ranges([shapes[name].numel() for name in names])):
        bucket = Bucket(index, names[a:b], [shapes[name] for name in names[a:b]], torch.float32, gradient.device)
        samples.append((bucket, gradient[offsets[a] : offsets[b]]))
    return samples


def measure_costs(
    synchronizer: TunedSynchronizer, gradients: dict[str, Tensor]
) -> tuple[list[int], torch.Tensor, bool]:
    """Bucket sizes (elements) and, on this rank, ``[6, sizes]`` median seconds of: encode (with the
    memory's compensation), communication, decode (with the memory's update) and the work between
    rounds (PowerSGD's orthogonalisation) of this synchroniser's roles, and an fp32 and a bf16
    allreduce of the same bucket over all ranks (the uncompressed baselines), on samples cut from
    ``gradients`` (flat local gradients by parameter name; zeros where one is missing); and whether
    the exchange has an eager round (then it waits for the synchroniser to advance it).

    Each sample runs as the synchroniser's route runs it (:meth:`~gc_strategy.sync.paths.routes.Route.timed_exchange`);
    with ``hierarchy="node"`` only the owners report times, so the maximum across ranks is theirs."""
    roles = synchronizer.roles.fresh()
    roles.bind(synchronizer.communicator.group)  # the route's group: across nodes with hierarchy="node"
    roles.begin_step(1 << 30)  # steady state: past start_iter / density warm-up
    plain = {
        precision: build_components(name, communicator="allreduce")
        for precision, name in (("fp32", "none"), ("bf16", "bf16"))
    }
    for baseline in plain.values():  # the uncompressed baselines over all ranks
        baseline.bind(synchronizer.process_group)
    gradient = torch.cat(
        [
            gradients[name]
            if name in gradients
            else torch.zeros(synchronizer.layout.parameter(name).numel(), device=synchronizer.device)
            for name in synchronizer.layout.order
        ]
    )
    samples = sample_buckets(
        {name: synchronizer.layout.parameter(name).shape for name in synchronizer.layout.order}, gradient
    )
    times: list[list[list[float]]] = [[] for _ in samples]  # [sample][run] = [enc, comm, dec, btw, fp32, bf16]
    eager = False
    for run in range(RUNS + 1):  # round by round, so that a burst of machine noise hits all sizes alike
        for (bucket, flat), timed in zip(samples, times):
            ours = synchronizer.route.timed_exchange(flat, bucket, roles)
            eager = eager or ours.eager
            baselines = [time_exchange(flat, bucket, plain[p]).comm_s for p in ("fp32", "bf16")]
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


def device_clock(flat: Tensor) -> Callable[[], float]:
    """A host clock that first waits for ``flat``'s device (so it measures the device's work too)."""

    def now() -> float:
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        return time.perf_counter()

    return now


def time_exchange(flat: Tensor, bucket: Bucket, roles: Components) -> ExchangeTimes:
    """One bucket's exchange timed, all ranks of the communicator's group starting together; the
    exchange runs as the synchroniser runs it (:meth:`~gc_strategy.components.Components.exchange`
    driven by a
    :class:`~gc_strategy.communicators.RunningExchange`). Encode includes the memory's
    compensation, communication every round, decode the last combine and the memory's update,
    between the work between rounds. ``flat`` is left as it was."""
    flat = flat.clone()  # an exchange may overwrite its gradient buffer: keep the sample as it is
    roles.communicator.barrier()
    running = RunningExchange(roles.exchange(flat, bucket), clock=device_clock(flat))
    running.finish()
    return ExchangeTimes(
        running.encode_s, running.wait_s, running.decode_s, running.between_s, running.sent_bytes, running.eager
    )
