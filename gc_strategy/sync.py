"""``sync=``: which :class:`~gc_strategy.synchronizer.Synchronizer` a configuration builds, so
that the integrations name none of them."""

from __future__ import annotations

from typing import Any

from torch import nn

from .components import Components
from .diloco import DiLoCo
from .engine import GradientSynchronizer
from .synchronizer import Synchronizer


def build_synchronizer(
    module: nn.Module,
    components: Components,
    diloco: dict[str, Any] | None,
    *,
    broadcast_from_rank0: bool = True,
    find_unused_parameters: bool = False,
    **shared: Any,
) -> Synchronizer:
    """Every step (``diloco`` None) or DiLoCo with the options ``diloco`` (from
    :func:`~gc_strategy.diloco_options.diloco_options`). ``shared``: the options both take
    (``broadcast_buffers``, the hierarchy's); ``broadcast_from_rank0`` and
    ``find_unused_parameters`` apply to every-step synchronisation (DiLoCo starts every replica
    from rank 0's values, and its inner steps use whichever parameters they use)."""
    if diloco is not None:
        return DiLoCo(module, components, **diloco, **shared)
    c = components
    return GradientSynchronizer(
        module,
        c.compressor,
        c.memory,
        c.communicator,
        c.fusion,
        broadcast_from_rank0=broadcast_from_rank0,
        find_unused_parameters=find_unused_parameters,
        **shared,
    )
