"""``FinishTogether``: fault-tolerant replica groups under Lightning end their run at the same step
(docs/fault_tolerance.md)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class FinishTogether(pl.Callback):
    """End each replica group's run at the first step from ``Trainer(max_steps=N)`` on that every
    planned group took part in and committed, so that every group ends at the same step with the
    same parameters and a group that comes back late still finds a live peer to heal from; or
    ``quorum_timeout_s`` after ``max_steps`` where a group does not come back
    (:meth:`~gc_strategy.sync.base.Synchronizer.finished`). Steps past ``max_steps`` are allowed
    one at a time (an LR schedule made for ``max_steps`` goes on past its end). The run stops as
    an early stop does, with a last validation, so that every group reports the same final one.
    Needs ``max_steps``; without fault tolerance it ends at ``max_steps``, as without it."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.max_steps < 1:
            raise ValueError(
                f"FinishTogether: Trainer(max_steps = {trainer.max_steps}) is invalid with it; allowed: the number of "
                "steps to train (the groups end at the first step from it on that all of them took part in)"
            )
        self.steps = trainer.max_steps

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step < self.steps:
            return
        if trainer.strategy.synchronizer.finished(self.steps, trainer.global_step):
            trainer.should_stop = True
        else:
            trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + 1  # one more step
