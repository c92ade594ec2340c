"""A synchroniser attached to a training loop: the one adapter that every loop not driven by
Lightning uses (a plain loop, :mod:`gc_strategy.integrations.accelerate`, the next integration).

:func:`attach` does what a loop would otherwise wire by hand: the model's forward runs inside the
synchroniser's :meth:`~gc_strategy.sync.base.Synchronizer.before_forward` and
:meth:`~gc_strategy.sync.base.Synchronizer.after_forward` (forward hooks); each optimizer step is
followed by :meth:`~gc_strategy.sync.base.Synchronizer.after_optimizer_step` (a step post-hook);
the optimizers and LR schedulers are given to the synchroniser (per-rank states in checkpoints, a
healing replica group takes them from a peer); and where the synchroniser votes on each step (fault
tolerance), each optimizer is wrapped in a :class:`CommitGate`, whose ``step`` is taken only where
the step commits. It returns the handles, to detach it all again::

    attached = attach(sync, model, [optimizer], [scheduler])
    (optimizer,) = attached.optimizers          # the gate, where the synchroniser votes
    for x, y in loader:
        loss_fn(model(x), y).backward()          # the exchange, in backward
        optimizer.step()                         # taken where the step commits
        optimizer.zero_grad()
        scheduler.step()
    attached.detach()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..sync.base import Synchronizer


class CommitGate(torch.optim.Optimizer):
    """``optimizer``, whose :meth:`step` is taken only where ``synchronizer.should_commit()`` says
    so (fault tolerance's vote on the step: False where a peer failed); everything else is the
    optimizer's own. An optimizer itself, so that ``accelerator.prepare`` and LR schedulers take it."""

    def __init__(self, optimizer: torch.optim.Optimizer, synchronizer: Synchronizer) -> None:
        # no Optimizer.__init__: the wrapped optimizer holds the parameters and the state
        self.optimizer, self.synchronizer = optimizer, synchronizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self.synchronizer.should_commit():
            return self.optimizer.step(closure)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"CommitGate({self.optimizer!r})"


@dataclass
class Attached:
    """What :func:`attach` did: the optimizers the loop steps (gates where the synchroniser
    votes), and the hooks' handles; :meth:`detach` removes them."""

    synchronizer: Synchronizer
    optimizers: list[torch.optim.Optimizer]
    handles: list[Any] = field(default_factory=list)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def attach(
    synchronizer: Synchronizer,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any] = (),
) -> Attached:
    """Attach ``synchronizer`` to ``model``, its ``optimizers`` and LR ``schedulers`` (see the
    module's docstring)."""
    synchronizer.use_optimizers(list(optimizers))
    synchronizer.register_healed({f"lr_scheduler_{i}": scheduler for i, scheduler in enumerate(schedulers)})

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        synchronizer.after_optimizer_step()

    handles = [optimizer.register_step_post_hook(after_step) for optimizer in optimizers]
    handles.append(model.register_forward_pre_hook(lambda module, args: synchronizer.before_forward()))
    handles.append(model.register_forward_hook(lambda module, args, output: synchronizer.after_forward()))
    stepped = [CommitGate(o, synchronizer) if synchronizer.votes_on_commit else o for o in optimizers]
    return Attached(synchronizer, stepped, handles)
