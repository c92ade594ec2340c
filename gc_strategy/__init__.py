"""gc_strategy: communication-efficient data-parallel training for PyTorch Lightning.

``import gc_strategy`` registers the Lightning strategies ``gc_fused`` (popen launcher, like
``ddp``), ``gc_fused_spawn`` and ``gc_fused_fork``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .algos import COMPRESSORS, MEMORIES, Compressor, Memory
from .communicators import COMMUNICATORS, Communicator
from .components import Components, build_components
from .engine import GradientSynchronizer
from .fusion import FusionPlanner, parse_fusion
from .monitor import ThroughputMonitor
from .strategy import GCFusedStrategy
from .telemetry import StepTelemetry

GCFusedStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"

__all__ = [
    "COMMUNICATORS",
    "COMPRESSORS",
    "MEMORIES",
    "Communicator",
    "Components",
    "Compressor",
    "FusionPlanner",
    "GCFusedStrategy",
    "GradientSynchronizer",
    "Memory",
    "StepTelemetry",
    "ThroughputMonitor",
    "build_components",
    "parse_fusion",
]
