"""Per-step fault tolerance across replica groups, on torchft (docs/fault_tolerance.md).

A *replica group* is a set of ranks that live and die together: one process, or the ranks of one
launch (a torchrun per node, its default process group), which reduce inside the group and exchange
across groups each its share of the buckets, with the same rank of every other group
(:class:`~gc_strategy.sync.quorum.QuorumNodeRoute`).
The groups train the same model on their own data and average their compressed gradients every
step, as with :class:`~gc_strategy.sync.every_step.GradientSynchronizer`, but over a process group
that torchft (Ma et al., "torchft", PyTorch 2025) forms anew whenever a group dies, joins or comes
back, so that the survivors go on instead of ending the run. Each step:

1. **Quorum.** torchft's lighthouse decides the participating groups; the manager reconfigures a
   process group over them (rank: the group's place in the quorum). A group that joins, comes back
   or fell behind first *heals*: it loads a live peer's state (parameters and buffers, the optimizers
   and whatever else it was given, the synchroniser's step, gradient order and the state all ranks
   share, e.g. PowerSGD's factors), sent by torchft's checkpoint transport. Its error feedback and
   other per-rank state start at zero: they hold what *this* group's own gradients left unsent, and
   a peer's copy would apply the peer's correction twice (once there, once here).
2. **Bind.** Where the quorum changed, the roles are bound again to the new group
   (:meth:`GradientSynchronizer.rebind`): the average is over the participants, the communicator's
   size. The roles' state is held at a rollback point before any exchange of the step
   (:func:`~gc_strategy.sync.healing.keep_roles`: copy-on-write, no pass for the usual error feedback).
3. **Exchange.** Backward runs each bucket's compressed exchange over that group. An exchange that
   fails (a peer died: a closed connection or the collective's timeout) is reported to the manager
   and every later exchange of the step is skipped, so a step fails in one timeout at most.
4. **Commit.** ``should_commit`` is True only where every participant finished without error
   (torchft's vote). Where False no optimizer step is taken, and the roles' state is put back as it
   was before the step: error feedback, compressor state and step counter exactly as if the step
   had not been tried.

A failed step costs its compute and one timeout; a dead group's samples of that step are lost (each
group reads its own shard; docs/fault_tolerance.md). torchft is optional (``pip install
"gc_strategy[ft]"``, torch >= 2.7).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..components import Components
from ..fusion import AutoPlanner
from ..telemetry import TelemetryLog
from .base import Synchronizer
from .every_step import GradientSynchronizer
from .finish_line import FinishLine
from .healing import HealedObjects, Stateful, keep_roles, load_shared_state, settle_roles, shared_state
from .quorum import FaultTolerance, Quorum, quorum_route


def refuse_measured_plan(roles: Components) -> None:
    """``fusion="auto"`` measures its plan with collectives that the groups would not all take part in."""
    if isinstance(roles.fusion, AutoPlanner):
        raise ValueError(
            "fault_tolerance: fusion = 'auto' is invalid (its plan is measured with collectives the groups "
            "would not all take part in); allowed: 'bucket_mb:N', 'groups:N', 'layerwise', 'single', 'file:PATH'"
        )


class FaultTolerantSynchronizer(HealedObjects, Synchronizer):
    """See the module's docstring. ``module``'s gradients are averaged through ``roles`` across the
    participating replica groups; ``healed`` names further objects with ``state_dict`` and
    ``load_state_dict`` that a healing group takes from a peer (optimizers, LR schedules, a loop's
    counters); optimizers given to :meth:`use_optimizers` are added to them.

    A training loop (no ``init_process_group``: a group of one process needs none)::

        sync = FaultTolerantSynchronizer(model, build_components("topk", "residual"), options)
        sync.use_optimizers([optimizer])
        while not sync.finished(steps):         # every group ends at the same step
            step = sync.start_step()            # the quorum (and healing): the step to read data for
            x, y = batch(step)
            with sync.forward_pass():
                loss = loss_fn(model(x), y)
            loss.backward()                     # the exchange over the participating groups
            if sync.should_commit():            # False: a peer failed; the roles' state is restored
                optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        roles: Components,
        options: FaultTolerance,
        healed: dict[str, Stateful] | None = None,
        find_unused_parameters: bool = False,
    ) -> None:
        refuse_measured_plan(roles)
        self.module, self.options = module, options
        self.healed: dict[str, Stateful] = dict(healed or {})
        self.inner = GradientSynchronizer(
            module,
            roles,
            broadcast_buffers=False,
            find_unused_parameters=find_unused_parameters,
        )
        if self.inner.ready_order is None:  # no first-step agreement: a group may join at any step
            self.inner.ready_order = list(self.inner.layout.order)
        self.quorum = Quorum(options, self._peer_state, self._load_peer_state)
        self._kept: dict[str, Any] | None = None
        self.failed_steps = 0
        #: whether the last step committed (False before the first)
        self.committed = False
        self._finish_line = FinishLine(options.groups, options.quorum_timeout_s)

    # ------------------------------------------------------------------ one step
    def start_step(self) -> int:
        """The step's quorum (healing first where this group must), then the roles bound to its
        group and their state kept; returns the step to read data for (the steps committed so far
        across the groups: a group that healed takes its peer's). :meth:`before_forward` calls it
        where the loop has not; a loop whose data depends on the step calls it before reading."""
        if self._kept is None:
            if self.quorum.start():
                self.inner.rebind(quorum_route(self.quorum))
            self._kept = keep_roles(self.inner)
        return self.committed_steps

    @property
    def participants(self) -> int:
        """The participating groups of the current step (0 before the first quorum)."""
        return self.quorum.participants

    def should_commit(self) -> bool:
        """torchft's vote: True where every participant's exchange of this step succeeded (then
        take the optimizer step); False restores the roles' state as it was before the step."""
        if self._kept is None:
            raise RuntimeError("should_commit: no step was started (run the forward inside sync.forward_pass())")
        committed = self.quorum.vote()
        settle_roles(self.inner, self._kept, committed)
        self.failed_steps += not committed
        self.committed, self._kept = committed, None
        figures = {"participants": self.participants, "committed": float(committed), "failed_steps": self.failed_steps}
        self.inner.telemetry.last.extra.update(figures)  # beside the step's exchange figures: gc/participants, ...
        return committed

    @property
    def together(self) -> bool:
        """Whether the last step committed with every planned group (``groups``)."""
        return self.committed and self.participants == self.options.groups

    def finished(self, steps: int, step: int | None = None) -> bool:
        """Whether this group's run ends, with ``steps`` planned and ``step`` taken (by default the
        steps committed): at the first step from ``steps`` on that every group took part in, so
        that all end at the same step with the same parameters and a group that came back late has
        a live peer to heal from; or ``quorum_timeout_s`` after ``steps`` where one does not come
        back (:class:`~gc_strategy.sync.finish_line.FinishLine`)."""
        taken = self.committed_steps if step is None else step
        return taken >= steps and self.quorum.any_rank(self._finish_line.crossed(taken, steps, self.together))

    # ------------------------------------------------------------------ healing
    def _peer_state(self) -> dict[str, Any]:
        """What a healing group loads from this one: called by torchft between steps."""
        return {
            "module": self.module.state_dict(),
            "healed": self.healed_state(),
            "synchronizer": shared_state(self.inner),
        }

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.load_healed_state(state["healed"])
        load_shared_state(self.inner, state["synchronizer"])

    # ------------------------------------------------------------------ the Synchronizer interface
    def before_forward(self) -> None:
        """The step's quorum before its first training forward; a forward without gradients
        (validation, Lightning's sanity check) takes no part in quorums."""
        if torch.is_grad_enabled():
            self.start_step()
        self.inner.before_forward()

    def after_forward(self) -> None:
        self.inner.after_forward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.inner.no_sync():
            yield

    votes_on_commit = True

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This process's place among the run's planned ranks (``groups`` times the ranks of a
        group): the name of its state file beside a checkpoint, whatever the quorum."""
        return self.options.replica_group * self.quorum.local_world + self.quorum.local_rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.options.groups * self.quorum.local_world

    @property
    def telemetry(self) -> TelemetryLog:  # type: ignore[override]
        return self.inner.telemetry

    @property
    def synchronizers(self) -> list[GradientSynchronizer]:
        """The synchroniser that runs the exchanges (as DiLoCo's, for reports of the buckets)."""
        return [self.inner]

    @property
    def committed_steps(self) -> int:
        """The steps committed so far across the groups (the same on every participant; a healed
        group takes its peer's): the step to read data for."""
        return self.quorum.step

    def state_dict(self) -> dict[str, Any]:
        """This rank's synchroniser state and the rounds committed (a checkpoint's)."""
        return {"synchronizer": self.inner.state_dict(), "quorum": self.quorum.state_dict()}

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Whether this group keeps state of its own (no collective: the groups are not all there)."""
        return bool(state["synchronizer"]["memory"] or state["synchronizer"]["compressor"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["synchronizer"])
        self.quorum.load_state_dict(state["quorum"])

    def close(self) -> None:
        """Leave the quorum (the others go on without this group) and remove the hooks."""
        self.inner.close()
        self.quorum.close()
