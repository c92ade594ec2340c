"""Per-step fault tolerance across replica groups, on torchft (docs/fault_tolerance.md).

A *replica group* is a set of ranks that live and die together: one process, or the ranks of one
launch on one machine (a torchrun per node, its default process group), which reduce inside the
group and exchange across groups each its share of the buckets, with the same rank of every other
group (:class:`~gc_strategy.sync.fault_tolerance.quorum.QuorumNodeRoute`). The groups train the
same model on their own data and average their compressed gradients every step, as
:class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer` does, but each step is a
fault-tolerant round (:mod:`~gc_strategy.sync.fault_tolerance.round`, Ma et al., "torchft",
PyTorch 2025): the quorum and healing before the first forward, the exchange in backward over the
quorum's process group, torchft's vote before the optimizer step. What a failure means here: the
step is not taken. ``should_commit`` is False on every participant, no optimizer step is taken,
and the roles' state is put back as it was before the step: error feedback, compressor state and
step counter exactly as if the step had not been tried. A failed step costs its compute and one
timeout at most; a dead group's samples of that step are lost (each group reads its own shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...components import Components
from ..every_step.synchronizer import GradientSynchronizer
from .options import FaultTolerance
from .quorum import Quorum
from .synchronizer import RoundSynchronizer


class EveryStepRounds(RoundSynchronizer):
    """A fault-tolerant round every step (see the module's docstring), whatever synchronises the
    group inside: the round begins before the step's first training forward and ends in
    :meth:`should_commit`."""

    votes_on_commit = True

    def start_step(self) -> int:
        """The step's round begins, where it has not (the quorum, healing, the rollback point);
        returns the step to read data for (a group that healed takes its peer's). Before its first
        training forward a step calls it itself; a loop whose data depends on the step calls it
        before reading."""
        if not self.round.running:
            self.round.begin()
        return self.committed_steps

    def before_forward(self) -> None:
        """A training forward begins the step's round; one without gradients (validation,
        Lightning's sanity check) takes no part in rounds."""
        if torch.is_grad_enabled():
            self.start_step()
        self.inner.before_forward()

    def after_forward(self) -> None:
        self.inner.after_forward()

    def should_commit(self) -> bool:
        """The round ends in torchft's vote: True where every participant's exchange of this step
        succeeded (then take the optimizer step); False puts the roles' state back as it was."""
        if not self.round.running:
            raise RuntimeError("should_commit: no step was started (run the forward inside sync.forward_pass())")
        return self.round.end()

    @property
    def committed_steps(self) -> int:
        return self.round.quorum.step

    @property
    def together(self) -> bool:
        report = self.last_round
        return report.committed and report.participants == self.options.groups

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Whether this group keeps state of its own (no collective: the groups are not all there)."""
        return bool(state["synchronizer"]["memory"] or state["synchronizer"]["compressor"])


class FaultTolerantSynchronizer(EveryStepRounds):
    """See the module's docstring. ``module``'s gradients are averaged through ``roles`` across the
    participating replica groups. A training loop (no ``init_process_group``: a group of one process
    needs none)::

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
        find_unused_parameters: bool = False,
        quorum: Callable[..., Quorum] = Quorum,
    ) -> None:
        options.check(roles)
        inner = GradientSynchronizer(
            module, roles, broadcast_buffers=False, find_unused_parameters=find_unused_parameters
        )
        if inner.ready_order is None:  # no first-step agreement: a group may join at any step
            inner.ready_order = list(inner.layout.order)
        super().__init__(module, inner, [inner], options, quorum=quorum)
