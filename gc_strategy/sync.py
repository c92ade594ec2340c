"""``sync=``: which :class:`~gc_strategy.synchronizer.Synchronizer` a configuration builds, so
that the integrations name none of them."""

from __future__ import annotations

from typing import Any

from torch import nn

from .components import Components
from .diloco import DiLoCoSynchronizer
from .gradient_sync import GradientSynchronizer
from .hierarchy import NodeHierarchy
from .sharded import ShardedSynchronizer
from .sharded_diloco import ShardedDiLoCo
from .sync_modes import DiLoCo, EveryStep
from .synchronizer import Synchronizer


def build_synchronizer(
    module: nn.Module,
    components: Components,
    sync: EveryStep | DiLoCo,
    *,
    hierarchy: str | NodeHierarchy = "flat",
    broadcast_buffers: bool = True,
    broadcast_from_rank0: bool = True,
    find_unused_parameters: bool = False,
) -> Synchronizer:
    """The synchroniser of ``sync`` (a checked configuration, :func:`~gc_strategy.sync_modes.parse_sync`)
    over ``hierarchy``. ``broadcast_from_rank0`` and ``find_unused_parameters`` apply to every-step
    synchronisation (DiLoCo starts every replica from rank 0's values, and its inner steps use
    whichever parameters they use)."""
    if isinstance(sync, DiLoCo):
        return DiLoCoSynchronizer(module, components, sync, broadcast_buffers=broadcast_buffers, hierarchy=hierarchy)
    c = components
    return GradientSynchronizer(
        module,
        c.compressor,
        c.memory,
        c.communicator,
        c.fusion,
        broadcast_from_rank0=broadcast_from_rank0,
        find_unused_parameters=find_unused_parameters,
        broadcast_buffers=broadcast_buffers,
        hierarchy=hierarchy,
    )


def build_sharded_synchronizer(
    module: nn.Module, components: Components, sync: EveryStep | DiLoCo, mesh: Any
) -> Synchronizer:
    """The synchroniser of ``sync`` for ``module``, already ``fully_shard``-ed over ``mesh["shard"]``
    of a ``("replicate", "shard")`` mesh (:mod:`gc_strategy.sharded`)."""
    if isinstance(sync, DiLoCo):
        return ShardedDiLoCo(module, components, sync, mesh)
    return ShardedSynchronizer(module, components, mesh)
