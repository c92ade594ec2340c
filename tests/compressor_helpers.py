"""Shared helpers for compressor tests."""

import torch

from gc_strategy import COMPRESSORS
from gc_strategy.bucket import Bucket
from gc_strategy.communicators import RunningExchange

#: options that make every compressor send something of the small test models' gradients
SMALL_MODEL_OPTIONS = {
    "topk": dict(density=0.1),
    "randk": dict(density=0.1),
    "dgc": dict(density=0.1),
    "sidco": dict(density=0.1),
    "threshold": dict(threshold=0.01),
}

#: each compressor with the memories it is usually run with
STEP_MEMORIES = {
    "topk": ("none", "residual"),
    "randk": ("none", "residual"),
    "dgc": ("dgc", "residual"),
    "threshold": ("residual",),
    "sidco": ("residual",),
    "onebit": ("residual",),
    "efsignsgd": ("residual",),
    "signsgd": ("none",),
    "fp16": ("none", "residual"),
    "qsgd": ("none", "residual"),
}
#: options that make every compressor compress from its second step on the small test models
STEP_OPTIONS = {**SMALL_MODEL_OPTIONS, "powersgd": dict(start_iter=1), "acpsgd": dict(start_iter=1)}
#: (compressor, memory) of every synchronised-step test of all compressors
STEP_CONFIGS = [(name, memory) for name in COMPRESSORS.names() for memory in STEP_MEMORIES.get(name, ("none",))]


def bucket(n: int, index: int = 0, dtype=torch.float32) -> Bucket:
    return Bucket(index, [f"p{index}"], [torch.Size([n])], dtype, torch.device("cpu"))


def build(name: str, world_size: int = 1, process_rank: int = 0, step: int = 0, **options):
    compressor = COMPRESSORS.build(name, **options)
    compressor.bind(world_size, process_rank)
    compressor.begin_step(step)
    return compressor


def roundtrip(compressor, g: torch.Tensor, b: Bucket | None = None) -> torch.Tensor:
    b = b or bucket(g.numel())
    return compressor.decode(compressor.encode(g, b), b)


def finish(exchange):
    """Drive an exchange generator (a memory's, a compressor's or a communicator's) through its
    rounds, as the synchroniser does: its return value."""
    return RunningExchange(exchange).finish()


def payload_bytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


# inputs every compressor must survive: odd sizes, a single element, all zeros, ties
EDGE_INPUTS = {
    "odd": lambda: torch.randn(1001),
    "single": lambda: torch.tensor([0.37]),
    "zeros": lambda: torch.zeros(77),
    "ties": lambda: torch.tensor([1.0, -1.0, 1.0, 0.5, -0.5, 1.0, 0.0, 1.0, -1.0]),
}
