"""A rollback point on a synchroniser, for an exchange that may not commit (fault tolerance's
rounds, :mod:`gc_strategy.sync.fault_tolerance.round`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class RollbackPoint:
    """Held on ``synchronizer`` (whatever exchanges through ``roles``, counts its ``step`` and has a
    ``compressor``: a :class:`~.synchronizer.GradientSynchronizer`, a sharded one, a sharded
    DiLoCo's roles of one kind of tensor) when made: the roles' per-element state copy-on-write
    (:meth:`~gc_strategy.bucket.BucketState.hold`: error feedback formed from its old value in one
    pass, as the residual's, PowerSGD's and DGC's, is written into a second vector at no cost),
    copies of the step counter and of the compressor's other state. :meth:`release` ends it,
    keeping what the exchange wrote or putting the state back as it was, to the bit;
    :meth:`as_held` shows the state as it was for a while (a checkpoint taken while the round runs)."""

    def __init__(self, synchronizer: Any) -> None:
        self.synchronizer = synchronizer
        synchronizer.roles.hold()
        self.step = synchronizer.step
        self.extra = copy.deepcopy(synchronizer.compressor.extra_state())

    def release(self, keep_changes: bool) -> None:
        synchronizer = self.synchronizer
        synchronizer.roles.release(keep_changes)
        if not keep_changes:
            synchronizer.step = self.step
            synchronizer.compressor.load_extra_state(self.extra)

    @contextmanager
    def as_held(self) -> Iterator[None]:
        """Inside the block the synchroniser's roles, step and compressor state read as they were at
        the rollback point (no copy of the per-element state); after it, as they are. Nothing may
        write the roles' state inside it."""
        synchronizer = self.synchronizer
        roles = [role for _, role in synchronizer.roles.stateful()]
        now = [role.buffers for role in roles]
        step, extra = synchronizer.step, copy.deepcopy(synchronizer.compressor.extra_state())
        for role in roles:
            role.buffers = role.held_buffers()
        synchronizer.step = self.step
        synchronizer.compressor.load_extra_state(self.extra)
        try:
            yield
        finally:
            for role, buffers in zip(roles, now):
                role.buffers = buffers
            synchronizer.step = step
            synchronizer.compressor.load_extra_state(extra)
