"""One fault-tolerant round of a replica group, composed once for every fault-tolerant synchroniser
(docs/fault_tolerance.md).

A *round* is one exchange across the replica groups that either every participant commits or none
does: a step's gradients (:mod:`~gc_strategy.sync.fault_tolerance.every_step`), an outer step's
pseudo-gradients (:mod:`~gc_strategy.sync.fault_tolerance.diloco`), or a toy mode's own
(docs/extending.md). :class:`Round` runs it:

1. :meth:`Round.begin`: the quorum (torchft's lighthouse decides the participating groups; a group
   that joins, comes back or fell behind first *heals*, loading the objects registered with
   :meth:`Round.heal` from a live peer, each by its key); where the quorum's process group changed,
   the exchanging synchronisers are bound to it (a failure there fails the round, as one in an
   exchange does); then a rollback point is held on each of them
   (:class:`~gc_strategy.sync.every_step.rollback.RollbackPoint`: copy-on-write, no pass over the
   usual error feedback).
2. The exchanges, over the quorum's group, each collective guarded
   (:mod:`~gc_strategy.sync.fault_tolerance.quorum`): a dead peer fails the round instead of
   raising, and the round's remaining collectives are skipped.
3. :meth:`Round.end`: torchft's vote; the rollback point is released, keeping what the round
   wrote where every participant succeeded and putting back the state as it was where one did
   not; the round's :class:`RoundReport`.

Why one object: the quorum, the healed objects, the rollback point and the report are one protocol;
a fault-tolerant synchroniser then says only when a round happens and what a failure means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ..every_step.rollback import RollbackPoint
from ..paths.routes import Route
from .options import FaultTolerance
from .quorum import Quorum, quorum_route


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ReplicaState:
    """A synchroniser's state that every replica holds alike, as a healed object: its
    ``replicated_state`` on the peer, its ``load_replicated_state`` here (then ``healed()``, where
    given)."""

    def __init__(self, synchronizer: Any, healed: Callable[[], None] | None = None) -> None:
        self.synchronizer, self.healed = synchronizer, healed

    def state_dict(self) -> dict[str, Any]:
        return self.synchronizer.replicated_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.synchronizer.load_replicated_state(state)
        if self.healed is not None:
            self.healed()


@dataclass(frozen=True)
class RoundReport:
    """What a replica group's last round was: ``participants`` (the groups in its quorum),
    ``committed`` (every participant succeeded), ``contributors`` (DiLoCo: the groups that trained
    since the round before; None where every participant contributes) and ``failed_rounds`` (the
    rounds so far that did not commit)."""

    participants: int = 0
    committed: bool = False
    contributors: int | None = None
    failed_rounds: int = 0

    def as_metrics(self, prefix: str = "gc/") -> dict[str, float]:
        """The report as logged numbers: ``gc/participants``, ``gc/committed``, ``gc/failed_steps``
        (and ``gc/contributors``)."""
        metrics = {"participants": self.participants, "committed": self.committed, "failed_steps": self.failed_rounds}
        if self.contributors is not None:
            metrics["contributors"] = self.contributors
        return {prefix + key: float(value) for key, value in metrics.items()}


class Round:
    """A replica group's fault-tolerant rounds (see the module's docstring). ``synchronizers`` are
    the ones that exchange over the quorum's group, rebound and held at each round, each to a
    ``route`` of its own over the quorum (by default through the group's ranks where it has
    several: :func:`~gc_strategy.sync.fault_tolerance.quorum.quorum_route`); ``quorum`` builds this
    group's :class:`~gc_strategy.sync.fault_tolerance.quorum.Quorum` from the options and the two
    healing callbacks (injected, as torchft's integrations take its manager)."""

    def __init__(
        self,
        options: FaultTolerance,
        synchronizers: list[Any],
        quorum: Callable[..., Quorum] = Quorum,
        route: Callable[[Quorum], Route] = quorum_route,
    ) -> None:
        self.options = options
        self.synchronizers = synchronizers
        self.route = route
        self.healed: dict[str, Stateful] = {}
        self.quorum = quorum(options, self.peer_state, self.load_peer_state)
        self.report = RoundReport()
        self._held: list[RollbackPoint] | None = None
        self._bound = False

    def heal(self, objects: dict[str, Stateful]) -> None:
        """Objects a healing group takes from a live peer, by key (their ``state_dict`` there, their
        ``load_state_dict`` here), loaded in the order registered."""
        self.healed.update(objects)

    def peer_state(self) -> dict[str, Any]:
        """What a healing group loads from this one (torchft asks for it inside a peer's quorum)."""
        return {key: obj.state_dict() for key, obj in self.healed.items()}

    def load_peer_state(self, state: dict[str, Any]) -> None:
        for key, obj in self.healed.items():
            obj.load_state_dict(state[key])

    def begin(self) -> None:
        """The round's quorum (and healing), its group bound where it changed, a rollback point."""
        changed = self.quorum.start()
        self.quorum.watch()  # from the round's first collective: the group's heartbeats were learned as it formed
        if changed or not self._bound:
            self._bound = self.quorum.guard(self._rebind)
        self._held = [RollbackPoint(synchronizer) for synchronizer in self.synchronizers]

    @property
    def running(self) -> bool:
        """Whether a round began and has not ended."""
        return self._held is not None

    def _rebind(self) -> bool:
        for synchronizer in self.synchronizers:  # a route each: a route places its synchroniser's buckets
            synchronizer.rebind(self.route(self.quorum))  # a collective where the compressor checks the group
        return True

    @contextmanager
    def as_held(self) -> Iterator[None]:
        """Inside the block the exchanging synchronisers' state reads as at the round's begin (as it
        is, between rounds): what a checkpoint taken while a round runs saves."""
        with ExitStack() as stack:
            for point in self._held or []:
                stack.enter_context(point.as_held())
            yield

    def count(self, flag: bool) -> int:
        """How many participants say ``flag`` (a guarded sum; meaningless where the round failed)."""
        return int(self.quorum.sum(float(flag)))

    @property
    def failed(self) -> bool:
        """Whether a collective of this round failed already (the round will not commit)."""
        return self.quorum.failure.failed

    def end(self, contributors: int | None = None) -> bool:
        """torchft's vote, the rollback point released, the report; whether the round committed."""
        if self._held is None:
            raise RuntimeError("a round ends after it began (Round.begin)")
        self.quorum.unwatch()
        committed = self.quorum.vote()
        for point in self._held:
            point.release(keep_changes=committed)
        self._held = None
        failed = self.report.failed_rounds + (not committed)
        self.report = RoundReport(self.quorum.participants, committed, contributors if committed else None, failed)
        return committed

    def close(self) -> None:
        """Leave the quorums: the others go on without this group."""
        self.quorum.close()
