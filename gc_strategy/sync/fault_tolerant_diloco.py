"""DiLoCo across replica groups that survive each other's loss, on torchft (docs/fault_tolerance.md).

Each replica group (one process) runs DiLoCo's ``H`` inner steps on its own data
(:mod:`gc_strategy.sync.diloco`); the outer step's exchange of the pseudo-gradients runs over the
process group of a quorum that torchft's lighthouse decides at that outer step
(:mod:`gc_strategy.sync.quorum`), so that a group that died during the inner steps is simply absent
from the outer average. Each outer step is a *round*:

1. **Quorum.** The participating groups. A group that joins or comes back first heals from a live
   peer: the outer parameters ``θ`` and the outer optimizer's momentum, its parameters set to
   ``θ``, the inner optimizers and whatever else it was given (LR schedules, a loop's counters), the
   inner-step counter and the state all groups share (PowerSGD's factors). Its error feedback
   starts at zero, as with every-step fault tolerance: a peer's holds what the peer's own
   pseudo-gradients left unsent.
2. **Exchange.** ``Δ_r = θ − θ_r`` through the roles over the quorum's group. A group that healed
   in this round did no inner step since ``θ``: it takes part in the collectives with ``Δ_r = 0``
   but is not a *contributor*. With ``n`` participants of which ``k`` contributed (one small
   all-reduce counts them), the mean over the participants is scaled by ``n / k``, so that
   ``Δ̄ = (1/k) Σ_{contributors} Δ_r``: the mean of the groups that trained, as without failures.
   (Exact for the compressors whose aggregate is linear in each Δ_r: all but the sign votes.)
3. **Commit.** torchft's vote. Where every participant's exchange succeeded, the outer step is
   taken and every group continues from the new ``θ``. Where a peer died during the exchange, the
   roles' state is put back as before the round and the round is tried again at once, with a new
   quorum: the survivors keep their inner steps, and lose only the exchange in flight.

A group starting (the first forward) runs a round before its first inner step: at the run's start
every group takes ``θ`` from the first one (torchft's first-step synchronisation), and a group
that comes back waits in its quorum until the others reach their next outer step, then heals.

Refused: Streaming DiLoCo's fragments and overlapped exchanges (each fragment's exchange would be a
round of its own, and a group healing between them would hold fragments of different outer steps),
and buffers' averaging: each group keeps its own buffers (BatchNorm's statistics) and a healing
group takes a peer's.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import nn

from ..components import Components
from ..registry import Configuration
from .diloco import DiLoCoSynchronizer
from .finish_line import FinishLine
from .healing import HealedObjects, Stateful, keep_roles, load_shared_state, settle_roles, shared_state
from .quorum import FaultTolerance, Quorum, QuorumRoute, refuse_several_processes


def refuse_streaming(config: Configuration) -> None:
    """Fault tolerance runs DiLoCo's outer step as one round: refuse fragments and overlap."""
    if config.fragments != 1 or config.overlap_steps != 0:
        raise ValueError(
            f"fault_tolerance with Streaming DiLoCo (fragments = {config.fragments!r}, overlap_steps = "
            f"{config.overlap_steps}) is not supported; allowed: fragments=1, overlap_steps=0 (one outer exchange "
            "per round: a group healing between fragments would hold fragments of different outer steps)"
        )


class FaultTolerantDiLoCo(HealedObjects, DiLoCoSynchronizer):
    """See the module's docstring: ``module`` trained as ``config`` (a
    :class:`~gc_strategy.sync.modes.DiLoCo`) says, its outer steps over the participating replica
    groups. ``healed``: further objects with ``state_dict`` and ``load_state_dict`` that a healing
    group takes from a peer; optimizers given to :meth:`use_optimizers` are added to them.

    A training loop::

        sync = FaultTolerantDiLoCo(model, build_components("topk", "residual"), DiLoCo(inner_steps=5), options)
        sync.use_optimizers([optimizer])
        for batch in loader:
            with sync.forward_pass():           # the first one: a round that heals a joining group
                loss = model(batch)
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
        healed: dict[str, Stateful] | None = None,
    ) -> None:
        refuse_streaming(config)
        refuse_several_processes()
        super().__init__(module, components, config, broadcast_buffers=False)
        self.options = options
        self.healed: dict[str, Stateful] = dict(healed or {})
        self.quorum = Quorum(options, self._peer_state, self._load_peer_state)
        #: this group's place among the planned groups: the name of its state file beside a checkpoint
        self.rank, self.world_size = options.replica_group, options.groups
        #: the inner step of the last committed round (a group that did none since contributes no Δ)
        self.synced_at = 0
        self.joined = False
        #: the contributors of the last committed round, and the rounds that did not commit
        self.contributors = 0
        self.failed_steps = 0
        #: seconds between the last two committed rounds (an inner phase and its outer step), and when the last ended
        self.phase_s, self._last_round = 0.0, None
        self._said_left_out = False
        self._finish_line = FinishLine(options.groups, options.quorum_timeout_s)

    # ------------------------------------------------------------------ the schedule
    def before_forward(self) -> None:
        """The first training forward: a round (a group joining or coming back heals in it)."""
        if not self.joined and torch.is_grad_enabled():
            self.outer_round()
            self.joined = True

    def after_optimizer_step(self) -> None:
        """After each inner optimizer step; every ``inner_steps``, the outer round."""
        self.inner_step += 1
        if self.inner_step % self.inner_steps == 0:
            self.outer_round()

    def outer_round(self) -> None:
        """Rounds until one commits (see the module's docstring)."""
        while not self.try_round():
            self.failed_steps += 1

    def try_round(self) -> bool:
        """One round: quorum, exchange, vote; whether it committed (if not, the roles' state is as
        before it)."""
        fragment = self.fragments[0]
        if self.quorum.start():
            route = QuorumRoute(self.quorum)
            for synchronizer in self.synchronizers:
                synchronizer.rebind(route)
        kept = [keep_roles(synchronizer) for synchronizer in self.synchronizers]
        count = torch.tensor([float(self.inner_step > self.synced_at)])
        self.quorum.sum(count)
        contributors = int(count.item())
        if contributors:
            self._start(fragment)
            averaged = self._collect(fragment)
        committed = self.quorum.vote()
        for synchronizer, state in zip(self.synchronizers, kept):
            settle_roles(synchronizer, state, committed)
        if not committed:
            fragment.started, fragment.averaged = None, None
            return False
        if contributors:
            for delta in averaged:
                delta.mul_(self.quorum.participants / contributors)
            self._apply(fragment)
        self.synced_at, self.contributors = self.inner_step, contributors
        now = time.monotonic()
        self.phase_s, self._last_round = now - (self._last_round or now), now
        figures = {"participants": self.participants, "contributors": contributors, "committed": 1.0}
        self.telemetry.last.extra.update({**figures, "failed_steps": self.failed_steps})
        return True

    @property
    def participants(self) -> int:
        """The participating groups of the last round (0 before the first)."""
        return self.quorum.participants

    @property
    def committed_steps(self) -> int:
        """The inner steps taken so far (a healed group takes its peer's): the step to read data for."""
        return self.inner_step

    @property
    def together(self) -> bool:
        """Whether the last outer round had every planned group and no inner step followed it."""
        return self.participants == self.options.groups and self.synced_at == self.inner_step

    def finished(self, steps: int, step: int | None = None) -> bool:
        """Whether this group's run ends, with ``steps`` inner steps planned and ``step`` taken (by
        default the inner steps): at the first outer step from ``steps`` on that every group took
        part in, or ``quorum_timeout_s`` after ``steps`` where one does not come back
        (:class:`~gc_strategy.sync.finish_line.FinishLine`)."""
        taken = self.inner_step if step is None else step
        return taken >= steps and self.quorum.any_rank(self._finish_line.crossed(taken, steps, self.together))

    # ------------------------------------------------------------------ healing
    def _peer_state(self) -> dict[str, Any]:
        """What a healing group loads from this one (called by torchft inside a round's quorum)."""
        return {
            "module": self.module.state_dict(),
            "outer": self.outer,
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "healed": self.healed_state(),
            "synchronizers": [shared_state(s) for s in self.synchronizers],
            "inner_step": self.inner_step,
            "step": self.step,
        }

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        with torch.no_grad():
            for name, p in self.named:
                self.outer[name].copy_(state["outer"][name])
                p.copy_(self.outer[name])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.load_healed_state(state["healed"])
        for synchronizer, shared in zip(self.synchronizers, state["synchronizers"]):
            load_shared_state(synchronizer, shared)
        self.inner_step = self.synced_at = int(state["inner_step"])
        self.step = int(state["step"])
        if self.joined:
            self._say_left_out()

    def _say_left_out(self) -> None:
        """A group that heals after its first round was alive but left out of an outer step (its
        inner steps since the last one are lost); where that repeats, the lighthouse's join timeout
        is shorter than an inner phase and the quorums rotate (docs/fault_tolerance.md). Said once."""
        if self._said_left_out:
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

    # ------------------------------------------------------------------ the Synchronizer interface
    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's state of this group and the rounds committed (a checkpoint's)."""
        return {"diloco": super().state_dict(), "quorum": self.quorum.state_dict(), "synced_at": self.synced_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state["diloco"])
        self.quorum.load_state_dict(state["quorum"])
        self.synced_at, self.joined = int(state["synced_at"]), True  # at the checkpoint's round

    def close(self) -> None:
        super().close()
        self.quorum.close()
