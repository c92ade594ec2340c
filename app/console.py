"""What the app prints: a progress bar of optimizer steps (of tokens, for a language model), and no
third-party message a user cannot act on."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import BatchesProcessedColumn, ProcessingSpeedColumn
from rich.progress import ProgressColumn
from rich.text import Text

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


def _short(count: float) -> str:
    """``1234567`` as ``1.23M``."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= size:
            return f"{count / size:.2f}{unit}"
    return f"{count:.0f}"


class _InTokens(ProgressColumn):
    """Lightning's ``column``, or for the training task of a bar that counts tokens, ``text(task)``."""

    def __init__(self, bar: StepProgressBar, column: Any, text: Callable[[Any], str]) -> None:
        super().__init__()
        self.bar, self.column, self.text = bar, column, text

    def render(self, task: Any) -> Text:
        if not self.bar.counts_tokens(task):
            return self.column.render(task)
        return Text(self.text(task), style=self.column.style)


class StepProgressBar(RichProgressBar):
    """Rich's progress bar counting optimizer steps towards ``max_steps``, where training is
    bounded by steps. Lightning's counts each epoch's batches against ``max_epochs``, which reads
    ``Epoch 0/-2`` when only ``max_steps`` is set.

    With ``tokens_per_batch`` (a language model: a batch's sequences times their length) the
    training bar counts tokens instead, those of every rank: ``W·B·L`` for each batch of ``W``
    ranks' batches of ``B`` sequences of ``L`` tokens, towards the run's tokens (``max_steps``
    optimizer steps of ``accumulate_grad_batches`` batches each) or the epoch's, and its speed in
    tokens per second."""

    def __init__(self, tokens_per_batch: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.tokens_per_batch = tokens_per_batch

    def _bounded_by_steps(self) -> bool:
        return self.trainer.max_steps > 0

    def _unit(self) -> int:
        """What one counted step (bounded by steps) or batch (an epoch) stands for: 1, or its tokens."""
        if self.tokens_per_batch is None:
            return 1
        trainer = self.trainer
        batches = trainer.accumulate_grad_batches if self._bounded_by_steps() else 1
        return self.tokens_per_batch * trainer.world_size * batches

    def counts_tokens(self, task: Any) -> bool:
        """Whether ``task`` is the training bar and counts tokens."""
        return self.tokens_per_batch is not None and task.id == self.train_progress_bar_id

    def configure_columns(self, trainer: Any) -> list:
        texts = {
            BatchesProcessedColumn: lambda task: f"{_short(task.completed)}/{_short(task.total)} tokens",
            ProcessingSpeedColumn: lambda task: f"{_short(task.speed or 0.0)} tokens/s",
        }
        columns = super().configure_columns(trainer)
        return [_InTokens(self, c, texts[type(c)]) if type(c) in texts else c for c in columns]

    @property
    def total_train_batches(self) -> int | float:
        total = self.trainer.max_steps if self._bounded_by_steps() else super().total_train_batches
        return total * self._unit()

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._bounded_by_steps():
            return super()._get_train_description(current_epoch)
        return f"{'Tokens' if self.tokens_per_batch else 'Step'} (epoch {current_epoch})"

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        done = trainer.global_step if self._bounded_by_steps() else batch_idx + 1
        if self._bounded_by_steps() and self.progress is not None and self.train_progress_bar_id is not None:
            # replica groups that finish together may take steps past max_steps (FinishTogether)
            total = max(trainer.max_steps, trainer.global_step) * self._unit()
            self.progress.update(self.train_progress_bar_id, total=total)
        # Lightning's bar shows batch_idx + 1 as done
        super().on_train_batch_end(trainer, pl_module, outputs, batch, done * self._unit() - 1)
