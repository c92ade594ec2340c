"""Compressors and memories, registered by name (importing this package registers them all)."""

from . import capacity, dense, memory, powersgd, quant, sidco, sign, sparse, topk  # noqa: F401  (registration side effects)
from .base import COMPRESSORS, MEMORIES, Compressor, Memory

__all__ = ["COMPRESSORS", "MEMORIES", "Compressor", "Memory"]
