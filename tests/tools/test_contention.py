"""What a collective takes from the compute beside it: the measurement, its groups and its errors."""

import time

import pytest
import torch

from gc_strategy.tools import contention


def test_a_collective_takes_from_a_step_that_computes_and_not_from_one_that_sleeps():
    matrix = torch.randn(384, 384)

    def busy():  # one thread per rank, as the ranks of the netbed
        for _ in range(40):
            matrix @ matrix

    size = 32 << 20
    sleeping = contention.measure(1, 2, lambda: time.sleep(0.03), [size], ("broadcast",), runs=7)["broadcast", size]
    computing = contention.measure(1, 2, busy, [size], ("broadcast",), runs=7)["broadcast", size]
    assert sleeping.step_s == pytest.approx(0.03, abs=0.02) and sleeping.collective_s > 0
    assert computing.lost_s > sleeping.lost_s
    assert computing.hidden == pytest.approx(1 - computing.lost_s / computing.collective_s)


def _fails():
    raise ArithmeticError("no step here")


def test_bad_input_and_a_failing_rank_are_errors_not_hangs():
    with pytest.raises(ValueError, match="node ranks = 1 is invalid; allowed: an integer >= 2"):
        contention.measure(2, 1, _fails, [4])
    with pytest.raises(ValueError, match="across ranks = 1 is invalid; allowed: an integer >= 2"):
        contention.measure(1, 2, _fails, [4], span="across")
    with pytest.raises(ValueError, match="span = 'rack' is invalid; allowed: node, across, world"):
        contention.measure(2, 2, _fails, [4], span="rack")
    with pytest.raises(ValueError, match=r"collectives = \['gather'\] are invalid; allowed: reduce, broadcast"):
        contention.measure(1, 2, _fails, [4], ("gather",))
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="(?s)while measuring, rank [01] failed: .*ArithmeticError: no step here"):
        contention.measure(1, 2, _fails, [4])
    assert time.perf_counter() - start < 60


def _group_of(group, root):
    return root, torch.distributed.get_world_size(group)


def test_each_span_is_a_group_of_the_ranks_it_names():
    """4 ranks on 2 nodes, numbered node by node: a node's ranks, one rank of each node (the same
    local rank), all of them; each group's root is its first rank."""
    assert contention.on_node_ranks(2, 2, _group_of) == [(0, 2), (0, 2), (2, 2), (2, 2)]
    assert contention.on_node_ranks(2, 2, _group_of, span="across") == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert contention.on_node_ranks(2, 2, _group_of, span="world") == [(0, 4)] * 4


def test_an_allgather_takes_more_than_an_allreduce_of_the_same_payload():
    """Over 4 ranks each receives 3 payloads from an allgather, and 1.5 from a ring allreduce."""
    size = 8 << 20
    measured = contention.measure(2, 2, lambda: None, [size], ("allreduce", "allgather"), runs=5, span="world")
    assert measured["allgather", size].collective_s > measured["allreduce", size].collective_s > 0


def test_the_latency_is_the_median_over_launches_of_the_median_over_ranks(monkeypatch):
    """Each launch's ranks report their median run; the launches' medians 2.5, 5.0 and 0.25 s give 2.5 s."""
    launches = iter([[3.0, 1.0, 2.0, 9.0], [5.0, 5.0, 4.0, 6.0], [0.5, 0.1, 0.2, 0.3]])
    asked = []

    def launched(nodes, ranks_per_node, work):
        asked.append((nodes, ranks_per_node))
        return next(launches)

    monkeypatch.setattr(contention, "on_node_ranks", launched)
    assert contention.latency(2, 2, launches=3) == 2.5
    assert asked == [(2, 2)] * 3


def test_a_small_message_inside_a_node_takes_less_than_a_large_one():
    small = contention.latency(1, 2, launches=2, runs=5)
    size = 32 << 20
    large = contention.measure(1, 2, lambda: None, [size], ("broadcast",), runs=3)["broadcast", size].collective_s
    assert 0 < small < large
    with pytest.raises(ValueError, match="node ranks = 1 is invalid; allowed: an integer >= 2"):
        contention.latency(2, 1)
    with pytest.raises(ValueError, match="launches = 0 is invalid; allowed: an integer >= 1"):
        contention.latency(1, 2, launches=0)


def _rank_one_hangs(group, root):
    if torch.distributed.get_rank() == 1:
        time.sleep(120)
    return "done"


def test_a_rank_that_never_reports_is_an_error_naming_it():
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"while measuring, ranks \[1\] reported nothing within 5 s"):
        contention.on_node_ranks(1, 2, _rank_one_hangs, timeout_s=5)
    assert time.perf_counter() - start < 60
