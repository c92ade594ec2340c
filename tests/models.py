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


class ShardedMLP(pl.LightningModule):
    """An MLP trained with SGD and momentum. ``configure_model`` shards its layers, then itself,
    over the strategy's ``device_mesh[mesh_dim]`` (``"*"``: the whole mesh, HSDP on a 2-D one), or
    leaves sharding to the strategy (``mesh_dim=None``), with ``shard_options`` (``mp_policy``).
    At the end every rank writes the full
    parameters to ``out/rank<R>.pt``."""

    def __init__(self, out, mesh_dim: str | None = None, samples: int = 128, **shard_options) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.out, self.mesh_dim, self.samples, self.shard_options = out, mesh_dim, samples, shard_options

    def configure_model(self) -> None:
        if self.mesh_dim is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh if self.mesh_dim == "*" else self.device_mesh[self.mesh_dim]
        for layer in (self.net[0], self.net[2], self.net[4]):
            fully_shard(layer, mesh=mesh, **self.shard_options)
        fully_shard(self, mesh=mesh, **self.shard_options)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(self.samples, 16, generator=g), torch.randint(0, 4, (self.samples,), generator=g)
        )
        return DataLoader(data, batch_size=8, shuffle=False)

    def on_train_end(self) -> None:
        flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in self.parameters()])
        torch.save(flat, f"{self.out}/rank{self.global_rank}.pt")


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
