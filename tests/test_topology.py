"""The α-β collective costs of the topology-aware timeline model, against the formulas written out."""

import pytest

from gc_strategy.fusion.topology import Link, Topology, exchange_seconds, parse_rate, ring_allgather, ring_allreduce


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
