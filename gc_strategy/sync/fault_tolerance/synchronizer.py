"""The synchroniser of a replica group whose exchanges run in fault-tolerant rounds: the
:class:`~gc_strategy.sync.base.Synchronizer` interface over a :class:`~.round.Round` and an inner
synchroniser, shared by every fault-tolerant sync mode (docs/fault_tolerance.md, docs/extending.md).

A subclass says when a round happens and what a failure means: every step, the step is not taken
(:mod:`~gc_strategy.sync.fault_tolerance.every_step`); every outer step, the exchange is tried again
(:mod:`~gc_strategy.sync.fault_tolerance.diloco`). Everything else is here once: the objects a
healing group takes (the module, the inner synchroniser's state every replica holds alike, the
optimizers and whatever the integration registers), the round's report, the checkpoints (one group
writes each; every rank its own state file, named by its data shard), the end of the run
(every group at the same step) and leaving the quorums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ...telemetry import TelemetryLog
from ..base import Synchronizer
from ..every_step.synchronizer import GradientSynchronizer
from ..paths.routes import Route
from .finish_line import FinishLine
from .options import FaultTolerance
from .quorum import Quorum, quorum_route
from .round import ReplicaState, Round, RoundReport
from .shards import Shards, parameter_shards


class RoundSynchronizer(Synchronizer):
    """``inner`` synchronises ``module``; ``exchanging`` (its synchronisers that exchange over the
    quorum's group) are rebound to a ``route`` over each new quorum and held by each
    :class:`~.round.Round`; ``healed`` is what a healing group loads after the module, by default
    ``inner``'s replicated state. The module and the optimizers heal shard by shard where FSDP2
    shards them (:class:`~.shards.Shards`). ``quorum`` builds the quorum (injected). Subclasses
    implement :attr:`committed_steps` and :attr:`together`, and start and end the rounds."""

    def __init__(
        self,
        module: nn.Module,
        inner: Any,
        exchanging: list[Any],
        options: FaultTolerance,
        healed: Any = None,
        quorum: Callable[..., Quorum] = Quorum,
        route: Callable[[Quorum], Route] = quorum_route,
    ) -> None:
        self.module, self.inner, self.options = module, inner, options
        self.round = Round(options, exchanging, quorum, route)
        self.round.heal({"module": Shards(module), "synchronizer": healed or ReplicaState(inner)})
        self._finish_line = FinishLine(options.groups, options.quorum_timeout_s)

    # ------------------------------------------------------------------ what a subclass says
    @property
    def committed_steps(self) -> int:
        """The steps taken so far across the groups (a healed group takes its peer's): the step to
        read data for."""
        raise NotImplementedError

    @property
    def together(self) -> bool:
        """Whether the last round committed with every planned group and nothing followed it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the interface
    @property
    def participants(self) -> int:
        """The participating groups of the current (or last) round; 0 before the first."""
        return self.round.quorum.participants

    @property
    def last_round(self) -> RoundReport:
        return self.round.report

    def finished(self, steps: int, step: int | None = None) -> bool:
        """Whether this group's run ends, with ``steps`` planned and ``step`` taken (by default
        :attr:`committed_steps`): at the first step from ``steps`` on that every group took part
        in, so that all end at the same step with the same parameters and a group that came back
        late has a live peer to heal from; or ``quorum_timeout_s`` after ``steps`` where one does
        not come back (:class:`~gc_strategy.sync.fault_tolerance.finish_line.FinishLine`), decided
        alike on every rank of the group."""
        taken = self.committed_steps if step is None else step
        return taken >= steps and self.round.quorum.any_rank(self._finish_line.crossed(taken, steps, self.together))

    def replicated_parameters(self) -> dict[str, Tensor]:
        """The parameters every group holds alike after a committed round, by name (this rank's
        shards where FSDP2 shards them): the module's."""
        return parameter_shards(self.module)

    def register_healed(self, objects: dict[str, Any]) -> None:
        self.round.heal(objects)

    def use_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The training's optimizers: the inner synchroniser's, and healed from a peer."""
        self.inner.use_optimizers(optimizers)
        self.round.heal({f"optimizer_{i}": Shards(optimizer) for i, optimizer in enumerate(optimizers)})

    def restore_optimizers(self) -> None:
        self.inner.restore_optimizers()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.inner.no_sync():
            yield

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.inner.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.inner.world_size

    @property
    def telemetry(self) -> TelemetryLog:  # type: ignore[override]
        return self.inner.telemetry

    @property
    def synchronizers(self) -> list[GradientSynchronizer]:
        """The synchronisers that run the exchanges (for reports of the buckets)."""
        return self.round.synchronizers

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the run's checkpoint (one group at a time)."""
        return self.round.quorum.writes_checkpoints

    @property
    def checkpoint_rank(self) -> int:
        """This rank's data shard (:meth:`~gc_strategy.sync.fault_tolerance.options.FaultTolerance.shard`),
        whatever the quorum: the name of its state file beside a checkpoint."""
        quorum = self.round.quorum
        return self.options.shard(quorum.local_rank, quorum.local_world)[0]

    @property
    def checkpoint_world_size(self) -> int:
        quorum = self.round.quorum
        return self.options.shard(quorum.local_rank, quorum.local_world)[1]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state and the rounds committed (a checkpoint's)."""
        return {"synchronizer": self.inner.state_dict(), "quorum": self.round.quorum.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's: groups restarted from one checkpoint start at its round, and none heals
        from another (which would reset its error feedback)."""
        self.inner.load_state_dict(state["synchronizer"])
        self.round.quorum.load_state_dict(state["quorum"])

    def close(self) -> None:
        """Leave the quorums (the others go on without this group); the inner synchroniser stops."""
        self.inner.close()
        self.round.close()
