"""What the app prints: a progress bar of optimizer steps, and no third-party message a user cannot act on."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar

#: warnings raised inside third-party code that a user of the app cannot act on
HARMLESS_WARNINGS = (
    # torch deprecates isinstance checks against LeafSpec, which Lightning's own _pytree makes
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)
#: the start of Lightning's advertisement for another logger, printed at every fit
LOGGER_TIP = "💡 Tip:"


class _DropLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LOGGER_TIP)


def quiet_harmless_messages() -> None:
    """Filter the known harmless third-party messages in this process and the ranks it forks."""
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropLoggerTip())


class StepProgressBar(RichProgressBar):
    """Rich's progress bar counting optimizer steps towards ``max_steps``, where training is
    bounded by steps. Lightning's counts each epoch's batches against ``max_epochs``, which reads
    ``Epoch 0/-2`` when only ``max_steps`` is set."""

    def _bounded_by_steps(self) -> bool:
        return self.trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._bounded_by_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._bounded_by_steps():
            return super()._get_train_description(current_epoch)
        return f"Step (epoch {current_epoch})"

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        done = trainer.global_step - 1 if self._bounded_by_steps() else batch_idx
        if self._bounded_by_steps() and self.progress is not None and self.train_progress_bar_id is not None:
            # replica groups that finish together may take steps past max_steps (FinishTogether)
            self.progress.update(self.train_progress_bar_id, total=max(trainer.max_steps, trainer.global_step))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, done)
