"""Communicators on real gloo ranks: sums, uneven gathers, empty payloads."""

import torch
from compressor_helpers import finish

from gc_strategy.communicators import AllGather, AllReduce
from gc_strategy.tools.ranks import run_ranks


def _uneven_gather(rank, world_size):
    communicator = AllGather()
    communicator.bind(None)
    # rank r sends r+1 fp32 values, r int32 indices and a bf16 scalar: sizes and offsets all differ
    values = torch.arange(rank + 1, dtype=torch.float32) + 10 * rank
    indices = torch.arange(rank, dtype=torch.int32) * 3
    scale = torch.tensor([rank + 0.5], dtype=torch.bfloat16)
    gathered = finish(communicator.exchange([values, indices, scale], variable_size=True))
    return [[t.clone() for t in payload] for payload in gathered]


def test_allgather_uneven_sizes_and_dtypes_three_ranks():
    results = run_ranks(_uneven_gather, 3)
    for gathered in results:  # every rank receives every rank's exact payload
        assert len(gathered) == 3
        for r, (values, indices, scale) in enumerate(gathered):
            assert torch.equal(values, torch.arange(r + 1, dtype=torch.float32) + 10 * r)
            assert torch.equal(indices, torch.arange(r, dtype=torch.int32) * 3)
            assert scale.dtype == torch.bfloat16 and float(scale) == r + 0.5


def _empty_gather(rank, world_size):
    communicator = AllGather()
    communicator.bind(None)
    empty = [torch.empty(0), torch.empty(0, dtype=torch.int32)]
    return [[t.numel() for t in payload] for payload in finish(communicator.exchange(empty, variable_size=True))]


def test_allgather_when_no_rank_selects_anything():
    assert run_ranks(_empty_gather, 2) == [[[0, 0], [0, 0]]] * 2


def _fixed_gather(rank, world_size):
    communicator = AllGather()
    communicator.bind(None)
    rounds = []
    exchange = communicator.exchange([torch.full((5,), float(rank), dtype=torch.float16)], variable_size=False)
    try:
        round_ = next(exchange)
        while True:
            rounds.append(round_)
            round_ = exchange.send(round_.wait())
    except StopIteration as stop:
        return len(rounds), [p[0].tolist() for p in stop.value]


def test_allgather_fixed_size_skips_the_length_exchange():
    for n_rounds, gathered in run_ranks(_fixed_gather, 2):
        assert n_rounds == 1
        assert gathered == [[0.0] * 5, [1.0] * 5]


def _sum(rank, world_size):
    communicator = AllReduce()
    communicator.bind(None)
    a, b = torch.full((4,), rank + 1.0), torch.full((2,), 2.0 * rank, dtype=torch.float64)
    return [t.tolist() for t in finish(communicator.exchange([a, b], variable_size=False))]


def test_allreduce_sums_every_payload_tensor():
    assert run_ranks(_sum, 3) == [[[6.0] * 4, [6.0] * 2]] * 3


def test_single_process_needs_no_process_group():
    communicator = AllGather()
    communicator.bind(None)
    payload = [torch.ones(3)]
    (received,) = finish(communicator.exchange(payload, variable_size=True))
    assert torch.equal(received[0], payload[0])
