"""The one interface of every way of synchronising a data-parallel model: what the Lightning
strategy, the Accelerate adapter, the loop adapter and checkpoints talk to, whatever synchronises
underneath (every step: :class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer`;
every ``H`` steps: :class:`~gc_strategy.sync.diloco.synchronizer.DiLoCoSynchronizer`; sharded over
nodes: :class:`~gc_strategy.sync.sharded.synchronizer.ShardedSynchronizer` and
:class:`~gc_strategy.sync.sharded.diloco.ShardedDiLoCo`; across replica groups that survive each
other's loss: :class:`~gc_strategy.sync.fault_tolerance.every_step.FaultTolerantSynchronizer` and
:class:`~gc_strategy.sync.fault_tolerance.diloco.FaultTolerantDiLoCo`), each built by its ``sync=``
mode (:mod:`gc_strategy.sync.modes`).

A training loop does, on every rank in the same order::

    with sync.forward_pass():          # or before_forward() / after_forward() as module hooks
        loss = model(batch)
    loss.backward()                    # inside sync.no_sync() for a micro-batch that only accumulates
    optimizer.step()
    sync.after_optimizer_step()

Why one interface: the integrations then hold no branch per kind of synchroniser, and a new kind
plugs in by implementing these methods and registering the sync mode that builds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..telemetry import TelemetryLog


class Synchronizer(ABC):
    """See the module's docstring. ``rank`` and ``world_size`` are this process's place in the
    group it synchronises over; ``telemetry`` holds the last step's measurements and running totals."""

    rank: int
    world_size: int
    telemetry: TelemetryLog

    # ------------------------------------------------------------------ the training loop
    @contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Run a forward of the module inside this context (:meth:`before_forward` and
        :meth:`after_forward` around it)."""
        self.before_forward()
        try:
            yield
        finally:
            self.after_forward()

    def before_forward(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """Before a forward pass (a module's forward pre-hook may call it)."""

    def after_forward(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """After a forward pass (a module's forward hook may call it)."""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context accumulate gradients without synchronising."""
        yield

    def after_optimizer_step(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """After every optimizer step, on every rank."""

    #: whether a step's exchange may fail and the optimizer step then be skipped: an integration
    #: asks :meth:`should_commit` after backward, before the optimizer step (fault tolerance)
    votes_on_commit = False

    def should_commit(self) -> bool:
        """After backward, before the optimizer step: whether to take it (always, by default)."""
        return True

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process's group writes the checkpoint file (every rank writes its own
        state beside it): always, but with fault tolerance, where one replica group does."""
        return True

    def register_healed(self, objects: dict[str, Any]) -> None:  # noqa: B027 (a hook: nothing by default)
        """Objects with ``state_dict`` and ``load_state_dict`` (LR schedules, a loop's counters)
        that a replica group healing must take from a live peer, by key (fault tolerance)."""

    @property
    def last_round(self) -> Any:
        """Fault tolerance: the last round's report (participants, committed, failed rounds);
        None otherwise."""
        return None

    def finished(self, steps: int, step: int) -> bool:
        """Whether the run ends with ``steps`` planned and ``step`` taken: there, by default; with
        fault tolerance where every replica group ends at the same step."""
        return step >= steps

    @property
    def checkpoint_rank(self) -> int:
        """The index of this rank's state file beside a checkpoint: its rank, by default."""
        return self.rank

    @property
    def checkpoint_world_size(self) -> int:
        """How many state files a checkpoint holds: the world size, by default."""
        return self.world_size

    def use_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:  # noqa: B027 (a hook: nothing by default)
        """The training's optimizers, whose states a checkpoint keeps per rank where they differ
        between ranks (DiLoCo's inner optimizers); call it before saving or restoring."""

    def restore_optimizers(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """After a checkpoint's optimizer states were loaded (rank 0's, on every rank): put back
        each rank's own, where this synchroniser keeps them."""

    @property
    def plan_report(self) -> dict[str, Any] | None:
        """``fusion="auto"``'s chosen plan and its predictions, once chosen; None otherwise."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Stop synchronising: no collective is left in flight and the module trains locally."""

    # ------------------------------------------------------------------ checkpoints
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, on the CPU."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by this rank (or, for a world size that changed, made
        by :meth:`load_states_of`)."""

    @abstractmethod
    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Whether any rank keeps state of its own, given this rank's :meth:`state_dict`: a
        collective, called on every rank. Without it rank 0's state is every rank's."""

    def load_states_of(self, states: Iterable[dict[str, Any]], world_size: int) -> None:
        """Start from the states of the ``world_size`` ranks of a run with another world size,
        read one at a time; by default refused."""
        raise ValueError(
            f"the checkpoint was saved by {world_size} ranks and this run has {self.world_size}; "
            f"{type(self).__name__} resumes on the same number of ranks only"
        )
