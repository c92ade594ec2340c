"""The Accelerate integration's documented entry point, ``gc_strategy.accelerate.prepare``
(:mod:`gc_strategy.integrations.accelerate`)."""

from .integrations.accelerate import CompressionState, prepare

__all__ = ["CompressionState", "prepare"]
