"""Small models and data shared by the tests (deterministic, no downloads)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SmallCNN(nn.Module):
    def __init__(self, with_unused: bool = False, frozen_stem: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)
        self.unused = nn.Linear(4, 4) if with_unused else None
        if frozen_stem:
            self.conv1.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def synthetic_images(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


class ParityModule(pl.LightningModule):
    """SGD with momentum on SmallCNN; at the end of training every rank checks it holds the same
    parameters as rank 0 (the data-parallel invariant) and raises otherwise."""

    def __init__(self, lr: float = 0.1, batch_size: int = 8, n: int = 64, **model_kwargs) -> None:
        super().__init__()
        self.net = SmallCNN(**model_kwargs)
        self.lr, self.batch_size, self.n = lr, batch_size, n

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(synthetic_images(self.n), batch_size=self.batch_size, shuffle=False)

    def on_train_end(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            flat = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, flat)
            for rank, other in enumerate(gathered):
                if not torch.equal(other, gathered[0]):
                    raise AssertionError(f"rank {rank} parameters differ from rank 0 after training")


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def fit(module: pl.LightningModule, strategy, devices: int = 2, ckpt_path=None, **trainer_kwargs) -> pl.Trainer:
    """Fit on CPU with quiet defaults; returns the trainer (``module`` holds rank 0's weights after)."""
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(trainer_kwargs)
    trainer = pl.Trainer(strategy=strategy, **defaults)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer
