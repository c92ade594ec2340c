"""What the advisor (:mod:`gc_strategy.tools.advise`) measures on this machine: each configuration's
exchange on sample buckets of a model (payload bytes, rounds, encode and decode time at the target's
world size, through :class:`Replicas`, with :mod:`gc_strategy.sync.paths.profiler`'s sample buckets and
exchange timing, the same that ``fusion="auto"`` uses), the backward's gradient-ready times, and a
cluster of CPU ranks like this machine's (:mod:`gc_strategy.tools.contention`). Its models are random-weight
instances of :data:`MODELS`: only their shapes and compute time matter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..communicators import Communicator, Exchange, Payload, Round
from ..components import Components, build_components
from ..fusion.timeline import Cost
from ..fusion.topology import Link
from ..sync.paths.profiler import sample_buckets, time_exchange
from . import contention

#: timed runs of each sample bucket after one warm-up run; the median is kept
RUNS = 3
#: the options of a configuration that do not build its roles
NOT_ROLES = ("hierarchy", "node_precision")


def roles(options: dict[str, Any]) -> dict[str, Any]:
    """The options that build the roles (all but :data:`NOT_ROLES`)."""
    return {k: v for k, v in options.items() if k not in NOT_ROLES}


class Replicas(Communicator):
    """``world_size`` ranks that all hold this rank's payload, and no network: an allgather returns
    ``world_size`` copies, an allreduce the payload times ``world_size``. Counts its rounds (a
    variable-size gather also exchanges its lengths first, in an eager round)."""

    def __init__(self, world_size: int, sums: bool) -> None:
        super().__init__()
        self.world_size, self.sums, self.rounds = world_size, sums, 0

    def bind(self, group: Any) -> None:
        """Stands for its own ranks: there is no process group to bind."""

    def barrier(self) -> None:
        """Its ranks are this one: nothing to wait for."""

    def exchange(self, payload: Payload, variable_size: bool, eager: bool = False) -> Exchange:
        handshake = variable_size and not self.sums
        self.rounds += 1 + handshake
        nbytes = sum(t.numel() * t.element_size() for t in payload)
        if self.sums:
            return (yield Round([], lambda: [t.mul_(self.world_size) for t in payload], nbytes, eager))
        copies = [t.contiguous().view(-1) for t in payload]
        return (yield Round([], lambda: [copies] * self.world_size, nbytes, eager or handshake))


@dataclass(frozen=True)
class Profile:
    """One configuration's exchange on sample buckets of one model: elements, seconds, bytes."""

    options: dict[str, Any]
    sizes: tuple[int, ...]
    encode_s: tuple[float, ...]
    between_s: tuple[float, ...]  # work between rounds (PowerSGD's orthogonalisation)
    decode_s: tuple[float, ...]
    payload_bytes: tuple[float, ...]  # sent by one rank
    rounds: int
    sums: bool
    eager: bool  # a round waits for a later bucket's launch to be advanced
    #: ``node_precision="bf16"``: rounding the dense bucket to bf16 and widening it back (empty: no casts)
    narrow_s: tuple[float, ...] = ()
    widen_s: tuple[float, ...] = ()


def profile(options: dict[str, Any], shapes: dict[str, torch.Size], world_size: int) -> Profile:
    """Measure one configuration (``GCFusedStrategy`` options) on buckets cut from ``shapes``
    (gradient-ready order), as it runs among ``world_size`` ranks (for ``hierarchy="node"``: nodes).
    With ``node_precision="bf16"`` also the casts around the node's collectives, as
    :func:`~gc_strategy.sync.paths.hierarchy.node_exchange` makes them: the fp32 bucket rounded to bf16 and the
    bf16 bucket copied back into fp32."""
    components = build_components(**roles(options))
    compressor, memory, sums = components.compressor, components.memory, components.communicator.sums
    compressor.bind(world_size, 0)
    compressor.begin_step(1 << 30)  # steady state: past start_iter and warm-ups
    total = sum(shape.numel() for shape in shapes.values())
    gradient = torch.randn(total, generator=torch.Generator().manual_seed(0))
    rows, rounds, casts = [], 0, []
    for bucket, flat in sample_buckets(shapes, gradient):
        runs = []
        for run in range(RUNS + 1):
            replicas = Replicas(world_size, sums)
            timed = time_exchange(flat, bucket, Components(compressor, memory, replicas, components.fusion))
            if run:
                runs.append((timed.encode_s, timed.between_s, timed.decode_s, timed.sent_bytes))
            rounds, eager = replicas.rounds, timed.eager
        rows.append((bucket.numel, *(statistics.median(column) for column in zip(*runs))))
        if options.get("node_precision") == "bf16":
            casts.append(_time_casts(flat.clone()))
    sizes, encode, between, decode, payload = zip(*rows)
    narrow, widen = zip(*casts) if casts else ((), ())
    return Profile(options, sizes, encode, between, decode, payload, rounds, sums, eager, narrow, widen)


def _time_casts(flat: Tensor) -> tuple[float, float]:
    """Median seconds of ``flat.to(torch.bfloat16)`` and of copying that back into ``flat``, after one
    warm-up run."""
    runs = []
    for run in range(RUNS + 1):
        start = time.perf_counter()
        wire = flat.to(torch.bfloat16)
        narrowed = time.perf_counter()
        flat.copy_(wire)
        if run:
            runs.append((narrowed - start, time.perf_counter() - narrowed))
    narrow, widen = zip(*runs)
    return statistics.median(narrow), statistics.median(widen)


@dataclass(frozen=True)
class Compute:
    """A step without synchronisation: gradient-ready times after the first, and the rest."""

    ready: tuple[float, ...]
    other: float

    @property
    def step_s(self) -> float:
        return self.other + self.ready[-1]

    def scaled(self, factor: float) -> Compute:
        return Compute(tuple(factor * r for r in self.ready), factor * self.other)


def measure_compute(
    model: nn.Module, make_batch: Callable[[], Any], loss: Callable[[Any, Any], Tensor], steps: int = 3
) -> tuple[list[str], Compute]:
    """Gradient-ready order (names) and :class:`Compute` of the model's training step on this
    device (forward, backward, SGD step), the median of ``steps`` steps after one warm-up."""
    params = {p: name for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    stamps: dict[str, float] = {}

    def stamp(parameter: Tensor) -> None:
        stamps.setdefault(params[parameter], time.perf_counter())

    handles = [p.register_post_accumulate_grad_hook(stamp) for p in params]
    measured = []
    try:
        for step in range(steps + 1):
            stamps.clear()
            batch = make_batch()
            start = time.perf_counter()
            loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end = time.perf_counter()
            if step:
                measured.append((dict(stamps), end - start))
    finally:
        for handle in handles:
            handle.remove()
    stamps, step_s = sorted(measured, key=lambda m: m[1])[len(measured) // 2]
    order = sorted(stamps, key=stamps.get)
    first = stamps[order[0]]
    ready = tuple(stamps[name] - first for name in order)
    return order, Compute(ready, step_s - ready[-1])


@dataclass(frozen=True)
class CpuRanks:
    """A cluster of CPU ranks like this machine's, measured (:mod:`gc_strategy.tools.contention`): the
    ``link`` inside a node, from broadcasts alone, and what each collective takes from the compute
    beside it, in seconds as a function of bytes per rank: the node's ``reduce`` and ``broadcast``
    of a dense bucket (the hierarchy's, before and after its exchange across nodes), and the
    ``exchange`` of a payload, summed or gathered, by ``(span, sums)``: over all ranks (``"world"``,
    flat) or over one rank per node (``"across"``, the hierarchy's)."""

    link: Link
    reduce: Cost
    broadcast: Cost
    exchange: dict[tuple[str, bool], Cost]


#: sizes of the collectives measured for :class:`CpuRanks`, bytes per rank: a small message and a node's
#: dense buckets; a payload exchanged (smaller: an allgather's ranks each receive all the others')
INSIDE_BYTES = [4 << 10, 4 << 20, 32 << 20]
EXCHANGE_BYTES = [1 << 20, 8 << 20]
#: the spans of an exchange (:data:`~gc_strategy.tools.contention.SPANS`): flat, over all ranks; the hierarchy's,
#: over one rank per node
EXCHANGE_SPANS = ("world", "across")


def measure_cpu_ranks(
    nodes: int,
    ranks_per_node: int,
    step: Callable[[], Any],
    runs: int = 10,
    spans: tuple[str, ...] = EXCHANGE_SPANS,
) -> CpuRanks:
    """:class:`CpuRanks` measured here beside ``step`` (the model's forward and backward), every
    group's collectives at once (as the emulated cluster of ``benchmarks/bench.py`` shares this
    machine), at :data:`INSIDE_BYTES` inside a node and :data:`EXCHANGE_BYTES` for the exchanges over
    the ``spans`` asked for (the others are left out of ``exchange``); a collective of no bytes, or
    over one rank, takes nothing. The link's bandwidth is the slope of a broadcast's time alone
    between the two largest sizes; its latency is :func:`~gc_strategy.tools.contention.latency`'s small
    message less its bytes' time. On one node of a real cluster run with ``nodes = 1``."""
    unknown = [span for span in spans if span not in EXCHANGE_SPANS]
    if unknown:
        raise ValueError(f"spans = {unknown} are invalid; allowed: {', '.join(map(repr, EXCHANGE_SPANS))}")

    def lost(beside: dict, collective: str, sizes: list[int]) -> Cost:
        return Cost.measured([0, *sizes], [0.0, *(beside[collective, n].lost_s for n in sizes)])

    inside = contention.measure(nodes, ranks_per_node, step, INSIDE_BYTES, ("reduce", "broadcast"), runs)
    exchange = {}
    for span in spans:
        if contention.span_ranks(nodes, ranks_per_node, span) == 1:  # no exchange over one rank
            exchange[span, True] = exchange[span, False] = Cost.linear(0.0, 0.0)
            continue
        beside = contention.measure(nodes, ranks_per_node, step, EXCHANGE_BYTES, ("allreduce", "allgather"), runs, span)
        exchange[span, True], exchange[span, False] = (
            lost(beside, "allreduce", EXCHANGE_BYTES),
            lost(beside, "allgather", EXCHANGE_BYTES),
        )
    medium, large = (inside["broadcast", n].collective_s for n in INSIDE_BYTES[1:])
    bandwidth = (INSIDE_BYTES[2] - INSIDE_BYTES[1]) / max(large - medium, 1e-9)
    message = contention.latency(nodes, ranks_per_node)
    link = Link(bandwidth, max(0.0, message - contention.MESSAGE_BYTES / bandwidth))
    return CpuRanks(link, lost(inside, "reduce", INSIDE_BYTES), lost(inside, "broadcast", INSIDE_BYTES), exchange)


MODELS = ("resnet18", "resnet50", "resnet101", "bert-base")


def model_and_batch(name: str, batch: int, size: int) -> tuple[nn.Module, Callable[[], Any], Callable]:
    """A model of the advisor's list (weights random: only shapes and compute time matter), a maker
    of random batches, and its loss."""
    if name not in MODELS:
        raise ValueError(f"model = {name!r} is invalid; allowed: {', '.join(MODELS)}")
    if name.startswith("resnet"):
        import torchvision

        model = getattr(torchvision.models, name)(num_classes=10 if name == "resnet18" else 1000)
        classes = model.fc.out_features
        return (
            model,
            lambda: (torch.randn(batch, 3, size, size), torch.randint(classes, (batch,))),
            lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        )
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig())
    vocabulary = model.config.vocab_size
    return (
        model,
        lambda: torch.randint(vocabulary, (batch, size)),
        lambda m, b: m(input_ids=b, labels=b).loss,
    )
