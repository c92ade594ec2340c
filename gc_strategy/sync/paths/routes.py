"""How a bucket travels across ranks: the exchange across ranks as one object, chosen once.

A :class:`Route` runs a bucket's exchange through the roles over its process groups, places the
buckets on the ranks that compress them, and says which rank keeps a bucket's per-element state.
:class:`FlatRoute` exchanges among all ranks of one process group; the hierarchy's
:class:`~gc_strategy.sync.paths.hierarchy.NodeRoute` reduces inside each node and compresses across nodes.
The synchronizer, its bucket layout and the profiler ask their route; none of them branches on the
topology.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...bucket import Bucket
from ...communicators import Exchange
from ...components import Components
from .profiler import ExchangeTimes, time_exchange


class Route(ABC):
    """The path of every bucket's exchange across ranks."""

    #: the process group the communicator's collectives run over
    group: Any = None

    def place(self, nbytes: list[int]) -> None:  # noqa: B027 (a flat route compresses every bucket here)
        """A new cut of ``len(nbytes)`` buckets of ``nbytes`` bytes: choose which ranks compress each."""

    def keeps_state(self, b: int) -> bool:
        """Whether this rank keeps bucket ``b``'s per-element compression state."""
        return True

    def carry_state(
        self, state: dict[str, dict[str, Tensor]], shapes: dict[str, torch.Size], device: torch.device
    ) -> dict[str, dict[str, Tensor]]:
        """Per-element state by parameter (``{state name: {parameter: tensor}}``) as the ranks that
        compress the new cut need it (a collective where buckets change owners)."""
        return state

    def sum_counts(self, counts: Tensor) -> Any:
        """Sum ``counts`` (the usage flags) in place over every rank whose exchanges this route
        joins, asynchronously: the returned work's ``wait()`` ends it."""
        return dist.all_reduce(counts, group=self.group, async_op=True)

    @abstractmethod
    def exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> Exchange:
        """One bucket's exchange through ``roles`` along this route: returns ``(average, finite)``
        as :meth:`~gc_strategy.components.Components.exchange` does."""

    @abstractmethod
    def timed_exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> ExchangeTimes:
        """One sample bucket's exchange timed as :func:`~gc_strategy.sync.paths.profiler.measure_costs` counts it."""


class FlatRoute(Route):
    """Every rank exchanges with every rank of ``group`` (None: the default process group)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> Exchange:
        return roles.exchange(flat, bucket)

    def timed_exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> ExchangeTimes:
        return time_exchange(flat, bucket, roles)
