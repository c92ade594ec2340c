"""What a collective takes from the compute beside it, on CPU ranks.

The synchroniser issues each bucket's collective while backward goes on, and the timeline model lets
it run beside the compute: on GPU nodes NVLink and the NIC move the bytes while the SMs compute. CPU
ranks under gloo move them with the cores that compute (socket copies, the reduction's additions),
so the collective delays the backward instead. :func:`measure` times, on each rank of ``nodes`` ×
``ranks_per_node`` processes on this machine (one thread each, every group's collectives at once, as
in ``benchmarks/bench.py``'s emulated cluster):

- ``step``: a training step's work (e.g. a forward and backward), alone;
- the collective, in a gloo group of one :data:`SPANS` (a node's ranks, say), alone;
- the step with the collective issued just before it, asynchronously, as the synchroniser issues it.

``lost = step beside it − step`` is the compute that the collective took; ``hidden = 1 − lost /
collective`` the share of it that ran beside the step (1 on an ideal overlap; 0 when the two might
as well run one after the other). Medians over runs, then over ranks.

:func:`latency` times a small message inside a node: on CPU ranks mostly the wait for its receivers
to be scheduled.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..sync.paths.hierarchy import node_groups
from .ranks import run_ranks

#: the collectives: the hierarchy's reduce onto a group's first rank and broadcast from it, and the
#: exchanges' allreduce and allgather
COLLECTIVES = ("reduce", "broadcast", "allreduce", "allgather")
#: the ranks a collective spans: a node's; one of each node, the same local rank (the hierarchy's
#: exchange across nodes); or all of them (a flat collective)
SPANS = ("node", "across", "world")
#: bytes of a message whose time is the link's latency
MESSAGE_BYTES = 4 << 10


@dataclass(frozen=True)
class Beside:
    """Seconds of a step alone, a collective alone, and the step with the collective beside it."""

    step_s: float
    collective_s: float
    beside_s: float

    @property
    def lost_s(self) -> float:
        """The compute that the collective took."""
        return self.beside_s - self.step_s

    @property
    def hidden(self) -> float:
        """The share of the collective that ran beside the step."""
        return 1 - self.lost_s / self.collective_s


def _issuer(collective: str, nbytes: int, root: int, group: Any) -> Callable[[], Any]:
    """Issues the collective of ``nbytes`` per rank (fp32) asynchronously and returns its work."""
    tensor = torch.zeros(max(1, nbytes // 4))
    if collective == "reduce":
        return lambda: dist.reduce(tensor, root, group=group, async_op=True)
    if collective == "broadcast":
        return lambda: dist.broadcast(tensor, root, group=group, async_op=True)
    if collective == "allreduce":
        return lambda: dist.all_reduce(tensor, group=group, async_op=True)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    return lambda: dist.all_gather(gathered, tensor, group=group, async_op=True)


def _times(step: Callable[[], Any], issue: Callable[[], Any]) -> tuple:
    """One run on this rank: (step alone, collective alone, step beside the collective)."""
    dist.barrier()
    start = time.perf_counter()
    step()
    alone = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    issue().wait()
    communication = time.perf_counter() - start
    dist.barrier()
    work = issue()
    start = time.perf_counter()
    step()
    beside = time.perf_counter() - start
    work.wait()
    return alone, communication, beside


def on_node_ranks(
    nodes: int, ranks_per_node: int, work: Callable[[Any, int], Any], timeout_s: float = 900.0, span: str = "node"
) -> list[Any]:
    """``work(group, root)`` on each of ``nodes`` × ``ranks_per_node`` forked processes of this
    machine (:func:`~gc_strategy.tools.ranks.run_ranks`: one thread each, ranks numbered node by node),
    ``group`` being the rank's group of the ``span`` (:data:`SPANS`) and ``root`` that group's first
    rank; the results in rank order. A rank that fails, or a wait of ``timeout_s`` with no rank
    reporting (a collective that never completes), raises, naming the ranks."""
    try:
        return run_ranks(partial(_in_span, ranks_per_node, span, work), nodes * ranks_per_node, timeout=timeout_s)
    except RuntimeError as error:
        raise RuntimeError(f"while measuring, {error}") from None


def _in_span(per_node: int, span: str, work: Callable[[Any, int], Any], rank: int, world_size: int) -> Any:
    groups = node_groups(per_node)
    group, root = {
        "node": (groups.intra, groups.rank_of(0)),
        "across": (groups.inter, groups.local_rank),
        "world": (dist.group.WORLD, 0),
    }[span]
    return work(group, root)


def measure(
    nodes: int,
    ranks_per_node: int,
    step: Callable[[], Any],
    sizes: list[int],
    collectives: tuple[str, ...] = COLLECTIVES,
    runs: int = 15,
    span: str = "node",
) -> dict[tuple[str, int], Beside]:
    """:class:`Beside` of each collective (of :data:`COLLECTIVES`) over the ranks of ``span`` (of
    :data:`SPANS`) and size in bytes per rank (fp32), on ``nodes`` × ``ranks_per_node`` forked
    processes of this machine (:func:`on_node_ranks`); ``step`` runs in each."""
    _check_span(nodes, ranks_per_node, span)
    unknown = [c for c in collectives if c not in COLLECTIVES]
    if unknown:
        raise ValueError(f"collectives = {unknown} are invalid; allowed: {', '.join(COLLECTIVES)}")

    def medians(group: Any, root: int) -> dict[tuple[str, int], list[float]]:
        step()  # warm-up
        out = {}
        for nbytes in sizes:
            for collective in collectives:
                issue = _issuer(collective, nbytes, root, group)
                times = [_times(step, issue) for _ in range(runs)]
                out[collective, nbytes] = [statistics.median(column) for column in zip(*times)]
        return out

    per_rank = on_node_ranks(nodes, ranks_per_node, medians, span=span)
    return {
        key: Beside(*(statistics.median(rank[key][i] for rank in per_rank) for i in range(3))) for key in per_rank[0]
    }


def latency(nodes: int, ranks_per_node: int, launches: int = 5, runs: int = 20) -> float:
    """Seconds of a broadcast of :data:`MESSAGE_BYTES` from a node's first rank to its other ranks,
    after a barrier, every node's at once, on ``nodes`` × ``ranks_per_node`` forked processes of this
    machine: the median over ``runs`` on each rank, over the ranks, and over ``launches`` of fresh
    processes. Where the ranks share cores, the message waits for its receivers to be scheduled, and
    that wait moves more between launches (the scheduler places each launch's processes afresh)
    than between the runs of one, hence the median over launches."""
    _check_span(nodes, ranks_per_node, "node")
    for name, count in (("launches", launches), ("runs", runs)):
        if count < 1:
            raise ValueError(f"{name} = {count} is invalid; allowed: an integer >= 1")

    def median_run(group: Any, root: int) -> float:
        message = torch.zeros(MESSAGE_BYTES // 4)
        times = []
        for _ in range(runs):
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(message, root, group=group)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return statistics.median(
        statistics.median(on_node_ranks(nodes, ranks_per_node, median_run)) for _ in range(launches)
    )


def span_ranks(nodes: int, ranks_per_node: int, span: str) -> int:
    """The number of ranks in a group of ``span`` (:data:`SPANS`)."""
    return {"node": ranks_per_node, "across": nodes, "world": nodes * ranks_per_node}[span]


def _check_span(nodes: int, ranks_per_node: int, span: str) -> None:
    """Refuses a span outside :data:`SPANS`, or one of fewer than two ranks (no link to measure)."""
    if span not in SPANS:
        raise ValueError(f"span = {span!r} is invalid; allowed: {', '.join(SPANS)}")
    ranks = span_ranks(nodes, ranks_per_node, span)
    if ranks < 2:
        raise ValueError(f"{span} ranks = {ranks} is invalid; allowed: an integer >= 2 (a link to measure)")
