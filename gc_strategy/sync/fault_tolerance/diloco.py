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

Refused (:meth:`~gc_strategy.sync.modes.DiLoCo.check_fault_tolerant`): Streaming DiLoCo's fragments
and overlapped exchanges (each fragment's exchange would be a round of its own, and a group healing
between them would hold fragments of different outer steps). Each group keeps its own buffers
(BatchNorm's statistics; inside a group, its first rank's before each forward, as DDP does); a
healing group takes a peer's.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
        #: the inner step of the last committed round (a group that did none since contributes no Δ)
        self.synced_at = 0
        self.joined = False
        #: seconds between the last two committed rounds (an inner phase and its outer step), and when the last ended
        self.phase_s, self._last_round = 0.0, None
        self._said_left_out = False

    # ------------------------------------------------------------------ the schedule
    def before_forward(self) -> None:
        """The first training forward: a round (a group joining or coming back heals in it)."""
        if not self.joined and torch.is_grad_enabled():
            self.outer_round()
            self.joined = True
        if self.within is not None:
            self.within.before_forward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes that accumulate gradients: inside a group of several ranks too."""
        with super().no_sync(), self.within.no_sync() if self.within is not None else nullcontext():
            yield

    def after_optimizer_step(self) -> None:
        """After each inner optimizer step; every ``inner_steps``, the outer round."""
        self.inner.inner_step += 1
        if self.inner.inner_step % self.inner.inner_steps == 0:
            self.outer_round()

    def outer_round(self) -> None:
        """Rounds until one commits (see the module's docstring)."""
        while not self.try_round():
            pass

    def try_round(self) -> bool:
        """One round: quorum, exchange, vote; whether it committed (if not, every state is as
        before it)."""
        inner, round_ = self.inner, self.round
        round_.begin()
        contributors = round_.count(inner.inner_step > self.synced_at)
        if contributors:
            inner.exchange_outer()
        if not round_.end(contributors):
            inner.drop_outer()
            return False
        if contributors:
            inner.apply_outer(scale=round_.report.participants / contributors)
        self.synced_at = inner.inner_step
        now = time.monotonic()
        self.phase_s, self._last_round = now - (self._last_round or now), now
        return True

    @property
    def committed_steps(self) -> int:
        """The inner steps taken so far (a healed group takes its peer's): the step to read data for."""
        return self.inner.inner_step

    @property
    def together(self) -> bool:
        """Whether the last outer round had every planned group, each of them contributing, and no
        inner step followed it. A group that healed in a round did not contribute to it: it trains
        on to the next one, so the run ends there, for every group (a group that joined in the
        others' last round would otherwise train on alone)."""
        report = self.round.report
        every_group = report.participants == self.options.groups and report.contributors == report.participants
        return every_group and self.synced_at == self.inner.inner_step

    # ------------------------------------------------------------------ healing
    def _healed(self) -> None:
        """After a peer's state was loaded: this group stands at the peer's outer step. One that
        heals after its first round was alive but left out of an outer step (its inner steps since
        the last one are lost); where that repeats, the lighthouse's join timeout is shorter than an
        inner phase and the quorums rotate (docs/fault_tolerance.md). Said once."""
        self.synced_at = self.inner.inner_step
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
        """DiLoCo's state of this group and the rounds committed (a checkpoint's)."""
        return {**super().state_dict(), "synced_at": self.synced_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.synced_at, self.joined = int(state["synced_at"]), True  # at the checkpoint's round

    def close(self) -> None:
        if self.within is not None:
            self.within.close()
        super().close()

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Always: each replica's own module and inner optimizer states differ inside an inner phase."""
        return True
