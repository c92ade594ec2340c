"""The α-β collective costs of the topology-aware timeline model, against the formulas written out."""

import pytest

from gc_strategy.fusion.topology import (
    Link,
    Topology,
    bytes_across_nodes,
    exchange_seconds,
    parse_rate,
    ring_allgather,
    ring_allreduce,
)


def test_rates_read_as_tc_writes_them_and_in_bytes():
    assert parse_rate("1gbit") == 125e6
    assert parse_rate("25Gbit") == 25e9 / 8
    assert parse_rate("100mbit") == 12.5e6
    assert parse_rate("10GB") == 10e9
    assert parse_rate("1.5gbps") == 1.5e9
    with pytest.raises(ValueError, match="--inter = 'fast' is invalid; allowed: a number"):
        parse_rate("fast", "--inter")


def test_ring_collectives_follow_the_alpha_beta_formulas():
    link = Link(bandwidth=1e9, latency=1e-4)
    n = 8e6
    # reduce-scatter + allgather: 2 (W-1) steps of n / W bytes
    assert ring_allreduce(n, 4, link) == pytest.approx(2 * 3 * (1e-4 + 2e6 / 1e9))
    assert ring_allreduce(n, 4, link, rounds=2) == pytest.approx(2 * 3 * (2e-4 + 2e6 / 1e9))
    # W - 1 steps of a whole payload
    assert ring_allgather(n, 4, link) == pytest.approx(3 * (1e-4 + 8e6 / 1e9))
    assert ring_allreduce(n, 1, link) == ring_allgather(n, 1, link) == 0.0
    # the allgather's bytes grow with W, the allreduce's stay flat: at 1% density with fp32 values
    # and int32 indices (8 bytes per kept element against 4 per element) they meet near W = 100
    dense, sparse = 4e8, 0.01 * 8 * 1e8
    assert ring_allgather(sparse, 99, Link(1e9, 0)) < ring_allreduce(dense, 99, Link(1e9, 0))
    assert ring_allgather(sparse, 102, Link(1e9, 0)) > ring_allreduce(dense, 102, Link(1e9, 0))


def test_a_flat_exchange_over_nodes_runs_at_the_link_between_them_and_the_hierarchy_adds_the_node_steps():
    fast, slow = Link(10e9, 1e-5), Link(125e6, 5e-5)
    cluster = Topology(nodes=2, ranks_per_node=4, intra=fast, inter=slow)
    one_node = Topology(nodes=1, ranks_per_node=8, intra=fast, inter=slow)
    dense, payload = 4e7, 1e6
    flat = 2 * 7 * (5e-5 + payload / 8 / 125e6)  # a ring allreduce of 8 ranks, every step at the slow link
    assert exchange_seconds(cluster, "flat", True, dense, payload) == pytest.approx(flat)
    assert exchange_seconds(one_node, "flat", False, dense, payload) == pytest.approx(7 * (1e-5 + payload / 10e9))
    inside = 2 * 2 * 3 * (1e-5 + dense / 4 / 10e9)  # reduce onto the owner and broadcast back
    across = 1 * (2 * 5e-5 + payload / 125e6)  # a gather over the 2 nodes, 2 rounds
    assert exchange_seconds(cluster, "node", False, dense, payload, rounds=2) == pytest.approx(inside + across)
    with pytest.raises(ValueError, match="hierarchy = 'ring' is invalid"):
        exchange_seconds(cluster, "ring", True, dense, payload)
    with pytest.raises(ValueError, match="nodes >= 1"):
        Topology(0, 2, fast, slow)


def _ring_bytes_across(members: list[int], ranks_per_node: int, sums: bool, payload: float) -> float:
    """A ring over ``members`` (global ranks, node ``r // ranks_per_node``) run step by step: what its
    edges that join two nodes carry."""
    size = len(members)
    steps, chunk = (2 * (size - 1), payload / size) if sums else (size - 1, payload)
    edges = zip(members, members[1:] + members[:1])
    crossing = sum(a // ranks_per_node != b // ranks_per_node for a, b in edges)
    return crossing * steps * chunk


@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 1), (2, 2), (2, 4), (4, 2), (3, 3)])
@pytest.mark.parametrize("sums", [True, False])
def test_bytes_across_nodes_are_what_the_rings_edges_between_nodes_carry(nodes, per_node, sums):
    cluster = Topology(nodes, per_node, Link(1e10, 0.0), Link(1e8, 0.0))
    payload = 6e6
    flat_ring = list(range(nodes * per_node))  # ranks numbered node by node
    expected = _ring_bytes_across(flat_ring, per_node, sums, payload)
    assert bytes_across_nodes(cluster, "flat", sums, payload) == pytest.approx(expected)
    # the hierarchy: each local rank's ring over the nodes, carrying the buckets it owns (1/L of them)
    owners = [[node * per_node + local for node in range(nodes)] for local in range(per_node)]
    expected = sum(_ring_bytes_across(ring, per_node, sums, payload / per_node) for ring in owners)
    assert bytes_across_nodes(cluster, "node", sums, payload / per_node) * per_node == pytest.approx(expected)
    with pytest.raises(ValueError, match="hierarchy = 'tree' is invalid"):
        bytes_across_nodes(cluster, "tree", sums, payload)
