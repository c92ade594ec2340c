"""``hierarchy="node"``: dense reduction inside a node, compression only across nodes.

Links inside a node are fast and those between nodes slow; a flat exchange spends compression work
where only the slow link needs it, and a gathered sparse payload costs every rank ``W − 1`` decodes.
With ``L`` ranks on each of ``N`` nodes (``W = N L``), each bucket ``b`` has an owner ``o(b)``, a local
rank; buckets are dealt to the local ranks by bytes, whole buckets of whole tensors, so every rank of
a node compresses a share and low-rank methods keep their matrices. One bucket's exchange:

1. inside the node, the bucket's gradients are summed onto its owner (a reduce, at full precision,
   or in bf16 with ``NodeHierarchy(precision="bf16")``);
2. across nodes, the owner exchanges the node's mean ``(1/L) Σ_local g`` with the owners of ``b``
   on the other nodes, through the memory and the compressor: a process group of the same local
   rank on every node, so all of a node's links work at once. The compressor divides by ``N``:
   ``(1/N) Σ_nodes (1/L) Σ_local g = (1/W) Σ_ranks g``. Error-feedback state lives on the owner and
   covers its share;
3. inside the node, the owner broadcasts the average.

``precision="bf16"`` (the app's ``trainer.node_precision=bf16``) halves the bytes of steps 1 and 3
for fp32 gradients, for nodes whose links inside are the bottleneck. Each rank's gradient is rounded
to bf16 (8 significant bits: a relative error of at most 2⁻⁸) and the node's sum accumulates in
bf16; the owner divides and compresses in full precision, then rounds the average to bf16 for the
broadcast and keeps that rounded value itself, so every replica applies the same bits. The rounding
inside the node is not error-corrected: the error-feedback memory covers what the compressor drops
across nodes, from the node mean it receives.
It is the precision that DDP's ``bf16_compress_hook`` gives every gradient.

The exchange across nodes overlaps backward. The reduce is an eager round
(:class:`~gc_strategy.communicators.Round`): the synchroniser advances it at the launch of a later large
bucket, and the owner encodes and sends its share across nodes while backward goes on. The
broadcasts wait for the end of backward: before step 3 every rank of the node yields a round that
is never eager. So every rank issues the node's reduces in bucket order during backward and its
broadcasts in bucket order after it, whichever rounds of the owner's exchange were eager. The owners
of a bucket on every node advance its exchange at the same points (the synchroniser's schedule is the
same on every rank), so the collective order is the same on every rank of each group. Ranks are
numbered node by node (``rank = node · L + local rank``), as torchrun, SLURM and Lightning's
launchers number them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...bucket import Bucket
from ...communicators import Exchange, Round, RunningExchange
from ...components import Components
from ...fusion.timeline import bucket_owners
from ...registry import Configuration, Option
from .profiler import ExchangeTimes, device_clock
from .routes import FlatRoute, Route

#: the precision of the reduce and the broadcast inside a node
NODE_PRECISIONS = ("full", "bf16")


class NodeHierarchy(Configuration):
    """``hierarchy="node"`` and its options. ``precision``: of the reduction inside each node,
    ``"full"`` (the gradients' dtype) or ``"bf16"``. ``ranks_per_node``: by default the Trainer's
    ``devices``, or torchrun's ``LOCAL_WORLD_SIZE``. ``node_rank`` and ``local_rank``: this rank's
    place as its launcher numbers it, where known (the Lightning strategy fills them in), checked
    against the numbering node by node."""

    OPTIONS = {
        "precision": Option("full", str, choices=NODE_PRECISIONS),
        "ranks_per_node": Option(None, int, low=1, optional=True),
        "node_rank": Option(None, int, low=0, optional=True),
        "local_rank": Option(None, int, low=0, optional=True),
    }

    def launched(self, ranks_per_node: int, node_rank: int, local_rank: int) -> NodeHierarchy:
        """This hierarchy on a launcher's nodes of ``ranks_per_node`` ranks; a different
        ``ranks_per_node`` given by the user is refused."""
        if self.ranks_per_node not in (None, ranks_per_node):
            raise ValueError(
                f"NodeHierarchy: option 'ranks_per_node' = {self.ranks_per_node} is invalid; allowed: the launcher's "
                f"{ranks_per_node} ranks per node, or None"
            )
        options = dict(self.options, ranks_per_node=ranks_per_node, node_rank=node_rank, local_rank=local_rank)
        return NodeHierarchy(**options)


#: the forms ``hierarchy=`` takes
HIERARCHY_FORMS = "'flat', 'node', or a NodeHierarchy(...)"


def parse_hierarchy(hierarchy: Any) -> NodeHierarchy | None:
    """``hierarchy=``: ``"flat"`` (None), ``"node"`` (:class:`NodeHierarchy` with its defaults) or
    a :class:`NodeHierarchy`."""
    if isinstance(hierarchy, NodeHierarchy):
        return hierarchy
    if hierarchy == "flat":
        return None
    if hierarchy == "node":
        return NodeHierarchy()
    raise ValueError(f"hierarchy = {hierarchy!r} is invalid; allowed: {HIERARCHY_FORMS}")


def hierarchy_of(hierarchy: str = "flat", node_precision: str = "full") -> NodeHierarchy | None:
    """The hierarchy of a flat command-line configuration (``hierarchy=node,node_precision=bf16``:
    the app's and the advisor's): None for flat."""
    precision = Option("full", str, choices=NODE_PRECISIONS).validate("hierarchy", "node_precision", node_precision)
    parsed = parse_hierarchy(hierarchy)
    if parsed is None and precision != "full":
        raise ValueError(
            f"node_precision = {precision!r} applies to the reduction inside nodes; it needs hierarchy='node' "
            f"(got hierarchy = {hierarchy!r})"
        )
    return None if parsed is None else NodeHierarchy(precision=precision)


@dataclass
class NodeGroups:
    """This rank's place in ``nodes`` nodes of ``ranks_per_node`` ranks, and its two process groups."""

    nodes: int
    ranks_per_node: int
    node: int
    local_rank: int
    #: the ranks of this node
    intra: Any
    #: the ranks of this local rank on every node
    inter: Any

    def rank_of(self, local_rank: int) -> int:
        """The global rank of ``local_rank`` on this node."""
        return self.node * self.ranks_per_node + local_rank


def node_groups(ranks_per_node: Any, node_rank: int | None = None, local_rank: int | None = None) -> NodeGroups:
    """Form the groups of :class:`NodeGroups` over the default process group (a collective: every
    rank calls it). ``node_rank`` and ``local_rank`` (from the launcher, where known) are checked
    against the numbering node by node. Every rank gathers every rank's view first and raises the same
    error where they disagree, so a bad layout fails on every rank instead of hanging one."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, (ranks_per_node, node_rank, local_rank))
    counts = sorted({view[0] for view in views}, key=str)
    if len(counts) > 1:
        raise ValueError(
            f"hierarchy='node' needs the same number of ranks on every node, but the ranks report {counts} "
            "ranks per node"
        )
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1:
        raise ValueError(f"hierarchy='node': ranks per node = {ranks_per_node!r} is invalid; allowed: an integer >= 1")
    if world_size % ranks_per_node:
        raise ValueError(
            f"hierarchy='node': {world_size} ranks cannot form nodes of {ranks_per_node} ranks each "
            "(every node needs the same number of ranks)"
        )
    for r, (_, node, local) in enumerate(views):
        if node is not None and local is not None and r != node * ranks_per_node + local:
            raise ValueError(
                f"hierarchy='node' cannot form node groups: rank {r} is local rank {local} of node {node}, but "
                f"ranks must be numbered node by node (rank = node x {ranks_per_node} + local rank)"
            )
    nodes = world_size // ranks_per_node
    intra, _ = dist.new_subgroups_by_enumeration(
        [[n * ranks_per_node + local for local in range(ranks_per_node)] for n in range(nodes)]
    )
    inter, _ = dist.new_subgroups_by_enumeration(
        [[n * ranks_per_node + local for n in range(nodes)] for local in range(ranks_per_node)]
    )
    return NodeGroups(nodes, ranks_per_node, rank // ranks_per_node, rank % ranks_per_node, intra, inter)


def route_for(hierarchy: Any, process_group: Any, world_size: int) -> Route:
    """The :class:`~gc_strategy.sync.paths.routes.Route` of ``hierarchy`` (any form :func:`parse_hierarchy`
    takes; docs/design.md, "Hierarchical synchronisation"): a flat one also on one rank."""
    hierarchy = parse_hierarchy(hierarchy)
    if hierarchy is None or world_size == 1:
        return FlatRoute(process_group)
    if process_group is not None:
        raise ValueError("hierarchy='node' forms its groups over the default process group; pass process_group=None")
    ranks_per_node = hierarchy.ranks_per_node
    if ranks_per_node is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError("hierarchy='node' needs ranks_per_node (or LOCAL_WORLD_SIZE, set by torchrun)")
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    return NodeRoute(node_groups(ranks_per_node, hierarchy.node_rank, hierarchy.local_rank), hierarchy.precision)


class NodeRoute(Route):
    """The exchange of the module's docstring: each bucket reduced onto its owner inside the node,
    compressed across nodes by the owners (over ``groups.inter``), broadcast back inside the node."""

    def __init__(self, groups: NodeGroups, precision: str = "full") -> None:
        self.groups = groups
        self.precision = precision
        self.group = groups.inter
        #: the local rank that compresses each bucket of the current cut
        self.owners: list[int] = []

    def place(self, nbytes: list[int]) -> None:
        self.owners = bucket_owners(nbytes, self.groups.ranks_per_node)

    def keeps_state(self, b: int) -> bool:
        return self.owners[b] == self.groups.local_rank

    def sum_counts(self, counts: Tensor) -> Any:
        """Over every rank of every node (the default process group the nodes are formed over)."""
        return dist.all_reduce(counts, async_op=True)

    def carry_state(
        self, state: dict[str, dict[str, Tensor]], shapes: dict[str, torch.Size], device: torch.device
    ) -> dict[str, dict[str, Tensor]]:
        if self.groups.ranks_per_node == 1:  # no owner moves
            return state
        return gather_node_state(self.groups, state, shapes, device)

    def exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> Exchange:
        return node_exchange(flat, bucket, roles, self.groups, self.owners[bucket.index], self.precision)

    def timed_exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> ExchangeTimes:
        """The whole node exchange of a sample bucket owned by local rank 0. The owner's work
        between rounds is in its encode and communication (``between_s`` is 0); encode and decode
        are the owner's coding divided by the ranks per node, since each rank codes its share of
        the buckets; zero seconds on the other ranks (their wait holds the owner's coding). Its
        eager round (the node's reduce) is on every rank."""
        groups = self.groups
        flat = flat.clone()
        dist.barrier()
        exchange = node_exchange(flat, bucket, roles, groups, 0, self.precision)
        running = RunningExchange(exchange, clock=device_clock(flat))
        running.finish()
        if groups.local_rank != 0:
            return ExchangeTimes(0.0, 0.0, 0.0, 0.0, running.sent_bytes, running.eager)
        coding = running.encode_s + running.between_s
        share = 1 / groups.ranks_per_node
        return ExchangeTimes(
            share * coding, coding + running.wait_s, share * running.decode_s, 0.0, running.sent_bytes, running.eager
        )


def gather_node_state(
    groups: NodeGroups, state: dict[str, dict[str, Tensor]], shapes: dict[str, torch.Size], device: torch.device
) -> dict[str, dict[str, Tensor]]:
    """Every parameter's per-element state (``{state name: {parameter: tensor}}``, as
    :meth:`~gc_strategy.bucket.BucketState.state_by_parameter` gives it) on every rank of the node,
    for new buckets whose owners differ from the old ones (a collective of the node). Each
    parameter's state is on at most one rank of the node, its old owner, so one sum over the node
    (zeros elsewhere: exact) gives it to every rank; the new owner keeps it. A parameter that no rank
    holds state for gets zeros, which is what a fresh state holds."""
    names: list[Any] = [None] * groups.ranks_per_node
    dist.all_gather_object(names, sorted(state), group=groups.intra)
    offsets, total = {}, 0
    for parameter, shape in shapes.items():
        offsets[parameter] = total
        total += shape.numel()
    gathered = {}
    for name in sorted(set().union(*names)):
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        for parameter, value in state.get(name, {}).items():
            flat[offsets[parameter] : offsets[parameter] + value.numel()].copy_(value.reshape(-1))
        dist.all_reduce(flat, group=groups.intra)
        gathered[name] = {
            parameter: flat[offsets[parameter] : offsets[parameter] + shape.numel()].view(shape)
            for parameter, shape in shapes.items()
        }
    return gathered


def node_exchange(
    flat: Tensor,
    bucket: Bucket,
    roles: Components,
    groups: NodeGroups,
    owner: int,
    precision: str = "full",
    across: Callable[[Tensor, Bucket], Exchange] | None = None,
) -> Exchange:
    """One bucket's hierarchical exchange (the module's steps 1–3); returns ``(average, finite)``
    like :meth:`~gc_strategy.algos.base.Memory.exchange`, ``finite`` None except on the owner. The
    communicator is bound to ``groups.inter``, the compressor to the nodes. ``precision`` is that of
    the collectives inside the node: ``"full"`` (the gradients' dtype) or ``"bf16"``. ``across``: the
    exchange across nodes (by default ``roles.exchange``; fault tolerance guards it)."""
    source = groups.rank_of(owner)
    local = groups.ranks_per_node > 1
    wire = flat.to(torch.bfloat16) if precision == "bf16" and local else flat
    nbytes = wire.numel() * wire.element_size() if local else 0
    works = [dist.reduce(wire, source, group=groups.intra, async_op=True)] if local else []
    yield Round(works, lambda: None, nbytes, eager=True, inside_node=True)
    finite = None
    if groups.local_rank == owner:
        if wire is not flat:
            flat.copy_(wire)
        if local:
            flat.div_(groups.ranks_per_node)
        average, finite = yield from (across or roles.exchange)(flat, bucket)
        if average is not wire:
            wire.copy_(average)
    yield Round([], lambda: None, 0, inside_node=True)  # the broadcasts: after backward, in bucket order
    works = [dist.broadcast(wire, source, group=groups.intra, async_op=True)] if local else []
    yield Round(works, lambda: None, nbytes, inside_node=True)
    if wire is not flat:
        flat.copy_(wire)
    return flat, finite
