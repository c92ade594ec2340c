"""The app's progress bar: optimizer steps towards max_steps, or a language model's tokens."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from app.console import StepProgressBar


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=2)


class Seen(pl.Callback):
    """After the bar's own hook: the training bar's count, total and its columns as rendered."""

    def __init__(self, bar: StepProgressBar) -> None:
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        task = self.bar.progress.tasks[self.bar.train_progress_bar_id]
        columns = [str(c.render(task)) for c in self.bar.progress.columns[2:]]
        self.seen.append((task.description, task.completed, task.total, columns))


@pytest.mark.parametrize("tokens_per_batch", [None, 10])
def test_the_bar_counts_optimizer_steps_or_every_ranks_tokens(tmp_path, tokens_per_batch):
    """3 optimizer steps of 2 batches each: the bar ends at 3/3 steps, or at 3·2·10 = 60 of 60 tokens
    (one rank) shown as tokens and tokens per second."""
    bar = StepProgressBar(tokens_per_batch=tokens_per_batch)
    seen = Seen(bar)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        callbacks=[bar, seen],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny())
    description, completed, total, columns = seen.seen[-1]
    if tokens_per_batch is None:
        assert description.startswith("Step (epoch 0)") and (completed, total) == (3, 3)
        assert columns[0] == "3/3"
    else:
        assert description.startswith("Tokens (epoch 0)") and (completed, total) == (60, 60)
        assert columns[0] == "60/60 tokens" and columns[2].endswith(" tokens/s")
    # the count follows the optimizer steps: after each pair of batches one step more, of 2·10 tokens
    per_step = 1 if tokens_per_batch is None else 2 * tokens_per_batch
    assert [c for _, c, _, _ in seen.seen] == [steps * per_step for steps in (0, 1, 1, 2, 2, 3)]
