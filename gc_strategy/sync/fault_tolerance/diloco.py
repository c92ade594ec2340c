"""DiLoCo across replica groups that survive each other's loss, on torchft (docs/fault_tolerance.md).

Each replica group (one process, or the ranks of one launch) runs DiLoCo's ``H`` inner steps on its
own data (:mod:`gc_strategy.sync.diloco.synchronizer`): a group of several ranks is one DiLoCo
replica, its inner steps' gradients averaged over its ranks as DDP averages them (densely, during
backward), so that its ranks hold the same ``θ_r``; each outer step's exchange of the pseudo-gradients
is a fault-tolerant round (:mod:`~gc_strategy.sync.fault_tolerance.round`), so that a group that
died during the inner steps is simply absent from the outer average:

1. **Quorum.** A group that joins or comes back first heals from a live peer: the outer parameters
   ``θ`` and the outer optimizer's momentum, its parameters set to ``θ``, the inner optimizers and
   whatever else was registered (LR schedules, a loop's counters), the inner-step counter and the
   state all groups share (PowerSGD's factors). Its error feedback starts at zero, as with
   every-step fault tolerance: a peer's holds what the peer's own pseudo-gradients left unsent.
2. **Exchange.** ``Δ_r = θ − θ_r`` through the roles over the quorum's group. A group that healed
   in this round did no inner step since ``θ``: it takes part in the collectives with ``Δ_r = 0``
   but is not a *contributor*. With ``n`` participants of which ``k`` contributed (the round counts
   them), the mean over the participants is scaled by ``n / k``, so that
   ``Δ̄ = (1/k) Σ_{contributors} Δ_r``: the mean of the groups that trained, as without failures.
   (Exact for the compressors whose aggregate is linear in each Δ_r: all but the sign votes.)
3. **Commit.** torchft's vote. What a failure means here: the exchange is tried again at once, with
   a new quorum, the roles' state put back as before the round: the survivors keep their inner
   steps and lose only the exchange in flight.

A group starting (the first forward) runs a round before its first inner step: at the run's start
every group takes ``θ`` from the first one (torchft's first-step synchronisation), and a group that
comes back waits in its quorum until the others reach their next outer step, then heals.

A group may shard its model with FSDP2 over its ranks (``mesh``, a ``(1, R)`` mesh): its inner steps
are FSDP2's own, inside the group (:class:`~gc_strategy.sync.sharded.diloco.ShardedDiLoCo`), and each
rank exchanges the ``Δ`` of its own shards with the rank holding them in every other group, over its
quorum's process group; a healing rank takes its own shards of ``θ``, of the outer optimizer and of
the model (:mod:`~gc_strategy.sync.fault_tolerance.shards`).

In a replicated group of several ranks, each ``Δ`` crosses the groups once: the quorum's route reduces it onto
one owner rank per bucket inside the group (every rank holds the same ``Δ``), the owners exchange it
across the groups, and broadcast the result back (:class:`~gc_strategy.sync.fault_tolerance.quorum.QuorumNodeRoute`).

Streaming DiLoCo (``fragments``, ``overlap_steps``): each fragment's exchange is a round of its own,
begun after the inner step its exchange is due and ended (the vote, then the outer step on that
fragment) ``overlap_steps`` inner steps later, the exchange running meanwhile. Why every group's
replicated state stays bit-identical when a group dies or heals between two fragments' exchanges:

- one round runs at a time (``overlap_steps`` at most the fewest inner steps between two
  fragments' exchanges; :meth:`~gc_strategy.sync.modes.DiLoCo.check_fault_tolerant`), so a quorum,
  and with it every heal, falls between two rounds, when no exchange is in flight anywhere;
- the outer state (``θ`` and the outer optimizer's momentum, per parameter) changes only in a
  committed round, on the same fragment with the same ``Δ̄`` in every participant, and a failed
  round changes nothing (its exchange dropped, the roles' state put back);
- a healing group takes the whole outer state, every fragment's, as its peer holds it at that round,
  the inner-step counter (hence the schedule: which fragment is due when) and the round the peer is
  running (its fragment and when it ends, :class:`Plan`): it takes part in that round from its
  quorum on, as the peer does;
- the contributors are counted per fragment: a group contributes a fragment's ``Δ`` where it took an
  inner step since that fragment's last round (a healed group's parameters start at ``θ``; its
  first contribution to each fragment counts the inner steps it took since it healed).

A failed round is run again at once without overlap, its ``Δ`` taken from the parameters as they are
then (the survivors lose no inner step: those of the overlap are in it). Each group's own parameters
differ between outer steps (the inner steps, and with ``overlap_steps`` the mixing), as they do
without failures; what every group holds alike is the outer state. A checkpoint taken while a round
runs saves the roles' state as the round found it (:meth:`~.round.Round.as_held`), and the round
runs again from its start on resume.

Each group keeps its own buffers
(BatchNorm's statistics; inside a group, its first rank's before each forward, as DDP does); a
healing group takes a peer's.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...components import Components, build_components
from ...registry import Configuration
from ..diloco.synchronizer import DiLoCoSynchronizer
from ..every_step.synchronizer import GradientSynchronizer
from ..paths.routes import Route
from ..sharded.diloco import ShardedDiLoCo
from .options import FaultTolerance
from .quorum import Quorum, QuorumRoute, quorum_route
from .round import ReplicaState
from .sharded import one_node
from .synchronizer import RoundSynchronizer


@dataclass(frozen=True)
class Plan:
    """A round: the fragment it exchanges, and the inner step after which it ends (its vote and
    outer step): the step it began at without overlap, ``overlap_steps`` later with it."""

    fragment: int
    ends_at: int


class PlanState:
    """The running round, as a healed object: a group that heals in a peer's round runs that round
    (and does not begin it again: the step whose round began last)."""

    def __init__(self, synchronizer: FaultTolerantDiLoCo) -> None:
        self.synchronizer = synchronizer

    def state_dict(self) -> dict[str, int]:
        sync = self.synchronizer
        return {"fragment": sync.plan.fragment, "ends_at": sync.plan.ends_at, "scheduled_at": sync.scheduled_at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sync = self.synchronizer
        sync.plan, sync.scheduled_at = Plan(int(state["fragment"]), int(state["ends_at"])), int(state["scheduled_at"])


class FaultTolerantDiLoCo(RoundSynchronizer):
    """See the module's docstring: ``module`` trained as ``config`` (a
    :class:`~gc_strategy.sync.modes.DiLoCo`) says, its outer steps over the participating replica
    groups. A training loop::

        sync = FaultTolerantDiLoCo(model, build_components("topk", "residual"), DiLoCo(inner_steps=5), options)
        sync.use_optimizers([optimizer])
        while not sync.finished(steps):
            with sync.forward_pass():           # the first one: a round that heals a joining group
                loss = model(batch(sync.committed_steps))
            loss.backward()                     # inner steps: no exchange
            optimizer.step()
            optimizer.zero_grad()
            sync.after_optimizer_step()         # every H steps: the outer round
    """

    def __init__(
        self,
        module: nn.Module,
        components: Components,
        config: Configuration,
        options: FaultTolerance,
        quorum: Callable[..., Quorum] = Quorum,
        mesh: Any = None,
    ) -> None:
        options.check(components)
        config.check_fault_tolerant()
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        config.check_replica_group(ranks)
        route: Callable[[Quorum], Route] = quorum_route
        if mesh is None:
            #: a group of several ranks: its inner steps' gradients averaged over its ranks (the default group)
            self.within = GradientSynchronizer(module, build_components("none")) if ranks > 1 else None
            inner: Any = DiLoCoSynchronizer(module, components, config, broadcast_buffers=False)
        else:  # FSDP2 inside the group: each rank's Δ of its own shards, with the same rank of every group
            self.within, route = None, QuorumRoute
            inner = ShardedDiLoCo(module, components, config, one_node(mesh))
        healed = ReplicaState(inner, self._healed)
        super().__init__(module, inner, inner.synchronizers, options, healed, quorum, route)
        #: per fragment, the inner step of its last committed round (a group that did none since contributes no Δ)
        self.synced_at = [0] * config.fragments
        #: the inner step of the last committed round
        self.committed_at = 0
        #: the running round (None between rounds), and the groups that contribute to it
        self.plan: Plan | None = None
        self._contributors = 0
        #: the inner step whose fragment's round began last (a healing group takes its peer's)
        self.scheduled_at = -1
        #: a checkpoint's running round, run again first (None: none)
        self._resume: int | None = None
        self.round.heal({"plan": PlanState(self)})
        self.joined = False
        #: seconds between the last two committed rounds (an inner phase and its outer step), and when the last ended
        self.phase_s, self._last_round = 0.0, None
        self._said_left_out = False

    # ------------------------------------------------------------------ the schedule
    def before_forward(self) -> None:
        """The first training forward: a round, ended at once (a group joining or coming back heals
        in it, and takes its peer's round)."""
        if not self.joined and torch.is_grad_enabled():
            self.begin_round(Plan(self._first_fragment(), self.inner.inner_step))
            self._resume = None
            self.settle()
            self.joined = True
        if self.within is not None:
            self.within.before_forward()

    def _first_fragment(self) -> int:
        """The fragment of the first round: the one whose round a checkpoint was taken in, else the
        one due now (at step 0 the last fragment's: its exchange ends each period), else the first."""
        if self._resume is not None:
            return self._resume
        due = self.inner.due_fragment()
        return 0 if due is None else due

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes that accumulate gradients: inside a group of several ranks too."""
        with super().no_sync(), self.within.no_sync() if self.within is not None else nullcontext():
            yield

    def after_optimizer_step(self) -> None:
        """After each inner optimizer step: the running round ends where it is due; a fragment's
        round begins where its exchange is due (and ends at once without overlap)."""
        inner = self.inner
        inner.inner_step += 1
        self.settle()  # a group that heals here takes its peer's round, which may be this step's
        index = inner.due_fragment()
        if index is not None and self.plan is None and self.scheduled_at != inner.inner_step:
            self.scheduled_at = inner.inner_step
            self.begin_round(Plan(index, inner.inner_step + inner.overlap_steps))
            self.settle()

    def begin_round(self, plan: Plan) -> None:
        """The round's quorum (a healing group takes its peer's plan), the count of the groups that
        trained since the fragment's last round, and its exchange started where any did."""
        self.plan = plan
        self.round.begin()
        index = self.plan.fragment
        self._contributors = self.round.count(self.inner.inner_step > self.synced_at[index])
        if self._contributors:
            self.inner.start_outer(index)

    def end_round(self) -> bool:
        """The exchange waited for, the vote, and the outer step where it committed; whether it did
        (if not, every state is as before the round began)."""
        inner, index, contributors = self.inner, self.plan.fragment, self._contributors
        if contributors:
            inner.collect_outer(index)
        self.plan = None
        if not self.round.end(contributors):
            inner.drop_outer(index)
            return False
        if contributors:
            inner.apply_outer(index, scale=self.round.report.participants / contributors)
        self.synced_at[index] = self.committed_at = inner.inner_step
        now = time.monotonic()
        self.phase_s, self._last_round = now - (self._last_round or now), now
        return True

    def settle(self) -> None:
        """End the running round where it is due; where it fails, its fragment's round again at
        once (no overlap: the survivors keep their inner steps) until one commits."""
        while self.plan is not None and self.inner.inner_step >= self.plan.ends_at:
            index = self.plan.fragment
            if not self.end_round():
                self.begin_round(Plan(index, self.inner.inner_step))

    @property
    def committed_steps(self) -> int:
        """The inner steps taken so far (a healed group takes its peer's): the step to read data for."""
        return self.inner.inner_step

    @property
    def together(self) -> bool:
        """Whether the last round had every planned group, each of them contributing, and no inner
        step followed it (a round may have begun since: where ``overlap_steps`` spans the time
        between two fragments' exchanges one always runs; the run's end leaves it unapplied, in
        every group). A group that healed in a round did not contribute to it: it trains on to the
        next one, so the run ends there, for every group (a group that joined in the others' last
        round would otherwise train on alone)."""
        report = self.round.report
        every_group = report.participants == self.options.groups and report.contributors == report.participants
        return every_group and self.committed_at == self.inner.inner_step

    def replicated_parameters(self) -> dict[str, Tensor]:
        """The outer parameters ``θ`` (this rank's shards where FSDP2 shards them): each group's own
        parameters differ between outer steps (Streaming DiLoCo's fragments and mixing: always)."""
        return dict(self.inner.outer)

    # ------------------------------------------------------------------ healing
    def _healed(self) -> None:
        """After a peer's state was loaded: this group stands at the peer's outer step. One that
        heals after its first round was alive but left out of an outer step (its inner steps since
        the last one are lost); where that repeats, the lighthouse's join timeout is shorter than an
        inner phase and the quorums rotate (docs/fault_tolerance.md). Said once."""
        self.synced_at = [self.inner.inner_step] * len(self.synced_at)
        if not self.joined or self._said_left_out:
            return
        self._said_left_out = True
        warnings.warn(
            f"fault_tolerance with DiLoCo: replica group {self.options.replica_group} was left out of an outer step "
            "while it trained, and healed from a peer: its inner steps since the last outer step are lost. If this "
            "repeats, the lighthouse's --join_timeout_ms is shorter than an inner phase (about "
            f"{self.phase_s:.1f} s here) and the quorums rotate: start torchft_lighthouse with a longer "
            "--join_timeout_ms (docs/fault_tolerance.md)",
            RuntimeWarning,
            stacklevel=2,
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's state of this group and the rounds committed (a checkpoint's). A round running
        (an overlapped exchange) is saved as its fragment, to be run again from its start on
        resume, and the roles' state as it was when it began (its exchange waited for first, so
        that nothing writes that state meanwhile)."""
        running = None if self.plan is None else self.plan.fragment
        if running is not None and self._contributors:
            self.inner.collect_outer(running)
        with self.round.as_held():
            state = super().state_dict()
        return {**state, "synced_at": list(self.synced_at), "running": running}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's, at its round; a round that ran when it was saved did not commit: its
        exchange is dropped and the fragment's round is the first one run (as a joining group's)."""
        super().load_state_dict(state)
        self.synced_at = [int(step) for step in state["synced_at"]]
        self.committed_at, self._resume = max(self.synced_at), state["running"]
        if self._resume is not None:
            self.inner.drop_outer(self._resume)
        self.joined = self._resume is None

    def close(self) -> None:
        """A round still running (begun at the run's last step, where ``overlap_steps`` spans the
        time between two fragments' exchanges) is waited for and not applied, in every group alike
        (they end together); then leave the quorums."""
        if self.plan is not None:
            if self._contributors:
                self.inner.collect_outer(self.plan.fragment)
            self.inner.drop_outer(self.plan.fragment)
            self.plan = None
        if self.within is not None:
            self.within.close()
        super().close()

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Always: each replica's own module and inner optimizer states differ inside an inner phase."""
        return True
