"""What a fault-tolerant round keeps, and what a healing group takes from a live peer, shared by
the fault-tolerant synchronisers (:mod:`gc_strategy.sync.fault_tolerant`,
:mod:`gc_strategy.sync.fault_tolerant_diloco`; docs/fault_tolerance.md).

A round that does not commit puts the roles' state back as it was (:func:`keep_roles`,
:func:`settle_roles`). A group that joins or comes back loads a peer's state: the model, the
objects in :class:`HealedObjects` (optimizers, LR schedules, a loop's counters) and the
synchroniser's state all groups share (:func:`shared_state`); its own error feedback starts at
zero.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from .every_step import GradientSynchronizer


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class HealedObjects:
    """A fault-tolerant synchroniser's objects that a healing group takes from a peer, by name
    (``healed``); the optimizers given to :meth:`use_optimizers` and the objects given to
    :meth:`share_state` join them. Mixed in before the synchroniser's base class."""

    healed: dict[str, Stateful]
    quorum: Any  # the group's :class:`~gc_strategy.sync.quorum.Quorum`

    def use_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The training's optimizers: healed too."""
        super().use_optimizers(optimizers)  # type: ignore[misc]
        self.share_state({f"optimizer_{i}": optimizer for i, optimizer in enumerate(optimizers)})

    def share_state(self, objects: dict[str, Any]) -> None:
        self.healed.update(objects)

    def healed_state(self) -> dict[str, Any]:
        """The healed objects' states, by name: part of what a healing peer loads."""
        return {name: obj.state_dict() for name, obj in self.healed.items()}

    def load_healed_state(self, state: dict[str, Any]) -> None:
        for name, obj in self.healed.items():
            obj.load_state_dict(state[name])

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the run's checkpoint (one group at a time)."""
        return self.quorum.writes_checkpoints


def keep_roles(synchronizer: GradientSynchronizer) -> dict[str, Any]:
    """A rollback point on ``synchronizer``'s roles for a round that may not commit: their
    per-element state (error feedback, compressor state) is held copy-on-write
    (:meth:`~gc_strategy.bucket.BucketState.hold`: error feedback formed from its old value in one
    pass, as the residual's, PowerSGD's and DGC's, is written into a second vector at no cost), and
    copies of the step counter and the compressor's other state are returned; :func:`settle_roles`
    ends it."""
    synchronizer.roles.hold_state()
    return {"step": synchronizer.step, "extra": copy.deepcopy(synchronizer.compressor.extra_state())}


def settle_roles(synchronizer: GradientSynchronizer, kept: dict[str, Any], committed: bool) -> None:
    """End :func:`keep_roles`' rollback point: a committed round keeps the roles' new state, one
    that did not commit puts back the state as it was."""
    synchronizer.roles.release_state(keep_changes=committed)
    if not committed:
        synchronizer.step = kept["step"]
        synchronizer.compressor.load_extra_state(kept["extra"])


def shared_state(synchronizer: GradientSynchronizer) -> dict[str, Any]:
    """``synchronizer``'s state that a healing group takes from a peer: all but the per-rank
    error feedback and compressor state, which hold what the *peer's* own gradients left unsent (a
    copy would apply the peer's correction twice: once there, once here)."""
    return {**synchronizer.state_dict(), "memory": {}, "compressor": {}}


def load_shared_state(synchronizer: GradientSynchronizer, state: dict[str, Any]) -> None:
    """Load a peer's :func:`shared_state`; this group's own error feedback starts at zero."""
    synchronizer.roles.clear_state()
    synchronizer.load_state_dict(state)
