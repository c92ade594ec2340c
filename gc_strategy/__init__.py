"""gc_strategy: communication-efficient data-parallel training for PyTorch.

The core (the synchroniser, its roles, DiLoCo, fault tolerance's synchronisers, the loop adapter
:func:`attach` and the Accelerate adapter) needs torch alone (fault tolerance: torchft too). Where
Lightning is installed, ``import gc_strategy`` also registers the Lightning strategies ``gc_fused``
(popen launcher, like ``ddp``), ``gc_fused_spawn`` and ``gc_fused_fork``, and ``gc_fsdp`` (FSDP2
inside each node), ``gc_fsdp_spawn`` and ``gc_fsdp_fork``.
"""

from importlib.util import find_spec

from .algos import COMPRESSORS, MEMORIES, Compressor, Memory
from .communicators import COMMUNICATORS, Communicator
from .components import Components, build_components
from .forking import renew_thread_pool_after_fork
from .fusion import FusionPlanner, parse_fusion
from .integrations.loop import CommitGate, attach
from .sync.every_step.synchronizer import GradientSynchronizer
from .sync.fault_tolerance.diloco import FaultTolerantDiLoCo
from .sync.fault_tolerance.every_step import FaultTolerantSynchronizer
from .sync.fault_tolerance.options import FaultTolerance
from .sync.fault_tolerance.round import Round, RoundReport
from .sync.fault_tolerance.sharded import FaultTolerantShardedSynchronizer
from .sync.fault_tolerance.synchronizer import RoundSynchronizer
from .sync.modes import SYNC_MODES, DiLoCo, EveryStep, Replicated, Sharded, SyncMode, sparseloco
from .sync.paths.hierarchy import NodeHierarchy
from .telemetry import StepTelemetry

renew_thread_pool_after_fork()

#: public names that need Lightning
_WITH_LIGHTNING = ("FinishTogether", "GCFusedStrategy", "GCFSDPStrategy", "ThroughputMonitor")

if find_spec("lightning") is not None:
    from lightning.pytorch.strategies import StrategyRegistry

    from .integrations.finish_together import FinishTogether
    from .integrations.lightning import GCFusedStrategy
    from .integrations.lightning_fsdp import GCFSDPStrategy
    from .integrations.monitor import ThroughputMonitor

    GCFusedStrategy.register_strategies(StrategyRegistry)
    GCFSDPStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str):
    if name in _WITH_LIGHTNING:
        raise ImportError(f"gc_strategy.{name} needs Lightning, which is not installed: pip install lightning")
    raise AttributeError(f"module 'gc_strategy' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "COMMUNICATORS",
    "COMPRESSORS",
    "CommitGate",
    "MEMORIES",
    "SYNC_MODES",
    "Communicator",
    "Components",
    "Compressor",
    "DiLoCo",
    "EveryStep",
    "FaultTolerance",
    "FaultTolerantDiLoCo",
    "FaultTolerantShardedSynchronizer",
    "FaultTolerantSynchronizer",
    "FinishTogether",
    "FusionPlanner",
    "GCFSDPStrategy",
    "GCFusedStrategy",
    "GradientSynchronizer",
    "Memory",
    "NodeHierarchy",
    "Replicated",
    "Round",
    "RoundReport",
    "RoundSynchronizer",
    "Sharded",
    "StepTelemetry",
    "SyncMode",
    "ThroughputMonitor",
    "attach",
    "build_components",
    "parse_fusion",
    "sparseloco",
]
