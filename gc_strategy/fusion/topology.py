"""Collective costs on a cluster of nodes: the communication term of the timeline model.

A cluster is ``N`` nodes of ``L`` ranks (``W = N L``), with links inside a node and between nodes,
each a latency ``α`` (seconds per message) and a bandwidth ``β`` (bytes per second). Costs follow
the α-β model of ring collectives (Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH", 2005), for a payload of ``n`` bytes per rank:

- ring allreduce: ``2 (W − 1) (α + n / (W β))``: a reduce-scatter and an allgather, each ``W − 1``
  steps of ``n / W`` bytes; every rank sends ``2 (W − 1) / W · n`` bytes;
- ring allgather: ``(W − 1) (α + n / β)``: every rank receives ``W − 1`` payloads.

A flat ring over several nodes, ranks numbered node by node, crosses each node boundary once in
each direction; every step waits for its slowest edge, the link between nodes, so a flat collective
runs at the inter-node link's ``α`` and ``β``.

``hierarchy="node"`` (:mod:`gc_strategy.sync.paths.hierarchy`) reduces each bucket onto its owner inside the
node and broadcasts the result back, both over the node's link (modelled as a ring reduce and a
ring broadcast of the dense bucket, ``2 (L − 1) (α + n / (L β))`` each), and runs the compressor's
collective across the ``N`` nodes only. The ``L`` owners of a node share its link to the other
nodes: their exchanges, one bucket after another on the timeline, are charged the link's full
bandwidth each, so that together they take the time the shared link needs for all of them. Inside
and across run on different links, but one bucket's three steps run one after another.

A multi-round exchange (PowerSGD's P and Q) pays the latency of every round.

Bytes across nodes follow from the same rings. Every edge of a ring carries what one of its ranks
sends: ``2 (R − 1) / R · n`` for an allreduce over ``R`` ranks, ``(R − 1) n`` for an allgather. A
flat ring crosses each of the ``N`` node boundaries once in each direction; with the hierarchy, a
bucket's ``N`` owners form a ring whose every edge crosses. Either way ``N`` edges cross, and the
bytes that leave the nodes are ``N`` times one rank's share (``R = W`` flat, ``R = N`` over the
hierarchy, whose owners send only the buckets they own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: a rate: a number, an optional decimal prefix, and bit or B (bytes), per second; e.g. 1gbit, 25Gbit, 10GB
RATE = re.compile(r"(?P<number>\d+(\.\d+)?)\s*(?P<prefix>[kmgt]?)(?P<unit>bit|b)(/s|ps)?", re.IGNORECASE)
PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str, option: str = "rate") -> float:
    """Bytes per second of a rate written like ``tc`` writes it (``1gbit``, ``100mbit``) or in bytes
    (``10GB``, ``1.5gb/s``: a lower-case ``b`` after a prefix also means bytes, as in tc's ``gbps``)."""
    match = RATE.fullmatch(str(text).strip())
    if not match:
        raise ValueError(
            f"{option} = {text!r} is invalid; allowed: a number, a prefix k, m, g or t, and bit or B, e.g. 1gbit, "
            "25gbit, 10GB"
        )
    value = float(match["number"]) * PREFIXES[match["prefix"].lower()]
    return value / 8 if match["unit"].lower() == "bit" else value


@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` bytes per second, ``latency`` seconds per message."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0; got {self.bandwidth}, {self.latency}")

    def send(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Topology:
    """``nodes`` × ``ranks_per_node`` ranks; ``intra`` links inside a node, ``inter`` between nodes."""

    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"a topology needs nodes >= 1 and ranks_per_node >= 1; got {self.nodes}, {self.ranks_per_node}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        def rate(link: Link) -> str:
            return f"{link.bandwidth * 8 / 1e9:.4g} Gbit/s, {link.latency * 1e6:.4g} µs"

        ranks = f"{self.nodes} node(s) x {self.ranks_per_node} rank(s)"
        return f"{ranks}; inside a node {rate(self.intra)}; between nodes {rate(self.inter)}"


def ring_allreduce(nbytes: float, ranks: int, link: Link, rounds: int = 1) -> float:
    """Seconds of a ring allreduce of ``nbytes`` per rank over ``ranks`` ranks."""
    return 2 * (ranks - 1) * (rounds * link.latency + nbytes / (ranks * link.bandwidth)) if ranks > 1 else 0.0


def ring_allgather(nbytes: float, ranks: int, link: Link, rounds: int = 1) -> float:
    """Seconds of a ring allgather of ``nbytes`` per rank over ``ranks`` ranks."""
    return (ranks - 1) * (rounds * link.latency + nbytes / link.bandwidth) if ranks > 1 else 0.0


def bytes_across_nodes(topology: Topology, hierarchy: str, sums: bool, payload_bytes: float) -> float:
    """Bytes that leave the nodes, summed over them, in one exchange of ``payload_bytes`` per rank
    (with ``hierarchy="node"``: the bucket's owner's payload), summed (``sums``) or gathered."""
    if hierarchy not in ("flat", "node"):
        raise ValueError(f"hierarchy = {hierarchy!r} is invalid; allowed: 'flat', 'node'")
    if topology.nodes == 1:
        return 0.0
    ranks = topology.world_size if hierarchy == "flat" else topology.nodes
    return topology.nodes * (2 * (ranks - 1) / ranks if sums else ranks - 1) * payload_bytes


def exchange_seconds(
    topology: Topology,
    hierarchy: str,
    sums: bool,
    dense_bytes: float,
    payload_bytes: float,
    rounds: int = 1,
    inside: bool = True,
) -> float:
    """Network seconds of one bucket's exchange (see the module docstring): ``payload_bytes`` per rank
    summed (``sums``) or gathered, in ``rounds`` rounds; with ``hierarchy="node"`` the dense bucket of
    ``dense_bytes`` is reduced and broadcast inside the node around it (left out with ``inside=False``,
    for a caller that prices them otherwise)."""
    collective = ring_allreduce if sums else ring_allgather
    if hierarchy == "flat":
        link = topology.inter if topology.nodes > 1 else topology.intra
        return collective(payload_bytes, topology.world_size, link, rounds)
    if hierarchy != "node":
        raise ValueError(f"hierarchy = {hierarchy!r} is invalid; allowed: 'flat', 'node'")
    node = 2 * ring_allreduce(dense_bytes, topology.ranks_per_node, topology.intra) if inside else 0.0
    return node + collective(payload_bytes, topology.nodes, topology.inter, rounds)
