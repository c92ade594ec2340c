"""Per-step fault tolerance for replica groups that shard their model with FSDP2 (docs/fault_tolerance.md).

A replica group of ``S`` ranks (one torchrun on one machine) shards the model over its ranks with
FSDP2, as compressed HSDP shards it inside a node (:mod:`gc_strategy.sync.sharded.synchronizer`):
FSDP2 all-gathers the parameters and reduce-scatters the gradients inside the group, and the
all-reduce hook sends this rank's shard of each unit's mean gradient through the roles to the ranks
holding the same shard in the other groups. Here those ranks are the quorum's process group of this
rank (torchft's manager of local rank ``r`` meets the managers of local rank ``r`` of the other
groups), so the exchange runs shard by shard, ``rank r`` with ``rank r``, over the quorum's route,
each collective guarded:

    ĝ_s = (1/N) Σ_groups D(C((1/S) Σ_ranks g_s + e_s))        (N participating groups)

Each step is a fault-tolerant round, as for replicated groups
(:class:`~gc_strategy.sync.fault_tolerance.every_step.FaultTolerantSynchronizer`): what a failure
means is the same, the step is not taken, and the roles' state of every shard is put back as it
was. The error feedback is per shard (each rank's own), and a healing group takes the parameters
and optimizer state shard by shard (:class:`~gc_strategy.sync.fault_tolerance.shards.Shards`):
each rank moves ``1/S`` of the state. Groups must have as many ranks, sharded alike (a quorum of
groups of unequal ranks is refused: :class:`~gc_strategy.sync.fault_tolerance.quorum.UnequalGroups`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ...components import Components
from ..sharded.synchronizer import ShardedSynchronizer
from .every_step import EveryStepRounds
from .options import FaultTolerance
from .quorum import Quorum, QuorumRoute


def one_node(mesh: Any) -> Any:
    """``mesh``, after refusing one of several nodes: a replica group is the ranks of one machine."""
    if mesh["replicate"].size() != 1:
        raise ValueError(
            f"fault_tolerance with a mesh of {mesh['replicate'].size()} nodes is not supported; allowed: one node "
            "(a replica group is the ranks of one machine: start a group per machine)"
        )
    return mesh


class FaultTolerantShardedSynchronizer(EveryStepRounds):
    """See the module's docstring. ``module`` is ``fully_shard``-ed over ``mesh["shard"]``; ``mesh``
    is this group's ``(1, S)`` mesh with the dimensions
    :data:`~gc_strategy.sync.sharded.synchronizer.MESH_DIMS`. A training loop is the replicated
    one's (:class:`~gc_strategy.sync.fault_tolerance.every_step.FaultTolerantSynchronizer`), run
    by every rank of the group."""

    def __init__(
        self,
        module: nn.Module,
        roles: Components,
        options: FaultTolerance,
        mesh: Any,
        quorum: Callable[..., Quorum] = Quorum,
    ) -> None:
        options.check(roles)
        inner = ShardedSynchronizer(module, roles, one_node(mesh))
        super().__init__(module, inner, [inner], options, quorum=quorum, route=QuorumRoute)

    def should_commit(self) -> bool:
        """torchft's vote (see the parent's); a committed step is counted by the sharded synchroniser."""
        committed = super().should_commit()
        if committed:
            self.inner.after_optimizer_step()
        return committed
