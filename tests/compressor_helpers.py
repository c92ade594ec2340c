"""Shared helpers for compressor tests."""

import torch

from gc_strategy import COMPRESSORS
from gc_strategy.bucket import Bucket


def bucket(n: int, index: int = 0, dtype=torch.float32) -> Bucket:
    return Bucket(index, [f"p{index}"], [torch.Size([n])], dtype, torch.device("cpu"))


def build(name: str, world_size: int = 1, process_rank: int = 0, step: int = 0, **options):
    compressor = COMPRESSORS.build(name, **options)
    compressor.world_size, compressor.rank, compressor.step = world_size, process_rank, step
    return compressor


def roundtrip(compressor, g: torch.Tensor, b: Bucket | None = None) -> torch.Tensor:
    b = b or bucket(g.numel())
    return compressor.decode(compressor.encode(g, b), b)


def finish(exchange):
    """Drive an exchange generator (a compressor's or a communicator's) through its rounds, waiting for
    each in turn: its return value."""
    try:
        current = next(exchange)
        while True:
            current = exchange.send(current.wait())
    except StopIteration as stop:
        return stop.value


def payload_bytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


# inputs every compressor must survive: odd sizes, a single element, all zeros, ties
EDGE_INPUTS = {
    "odd": lambda: torch.randn(1001),
    "single": lambda: torch.tensor([0.37]),
    "zeros": lambda: torch.zeros(77),
    "ties": lambda: torch.tensor([1.0, -1.0, 1.0, 0.5, -0.5, 1.0, 0.0, 1.0, -1.0]),
}
