"""Overhead of the gradient synchroniser against Lightning's DDP (both uncompressed fp32).

Runs torchvision ResNet-18 (10 classes) on synthetic 32x32 images with Lightning ``ddp`` and with
``gc_fused compressor=none``, on 2 CPU ranks over gloo (one thread per rank), alternating the two
configurations round by round so that machine noise hits both alike. Prints the median step time of
each and the ratio ``gc_fused / ddp`` (the target is <= 1.05).

    python benchmarks/ddp_overhead.py --rounds 3 --steps 20 --fusion bucket_mb:25
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gc_strategy


class StepTimer(pl.Callback):
    """Rank 0 writes the wall time of every training step (after ``warmup`` steps) to ``path``."""

    def __init__(self, path: str, warmup: int) -> None:
        self.path, self.warmup, self.times, self._start = path, warmup, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump(self.times, f)


class ResNetOnNoise(pl.LightningModule):
    def __init__(self, batch_size: int, steps: int) -> None:
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(num_classes=10)
        self.batch_size, self.steps = batch_size, steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        n = self.batch_size * self.steps * 2  # two ranks
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        return DataLoader(data, batch_size=self.batch_size)


def run(strategy, args) -> list[float]:
    path = tempfile.mktemp(suffix=".json")
    pl.seed_everything(0, verbose=False)
    module = ResNetOnNoise(args.batch_size, args.warmup + args.steps)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[StepTimer(path, args.warmup)],
    )
    trainer.fit(module)
    with open(path) as f:
        times = json.load(f)
    os.remove(path)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fusion", default="bucket_mb:25")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    configs = {
        "ddp": lambda: "ddp_fork",
        f"gc_fused none {args.fusion}": lambda: gc_strategy.GCFusedStrategy(fusion=args.fusion, start_method="fork"),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, make in configs.items():
            times[name] += run(make(), args)
            print(f"round {r + 1}/{args.rounds} {name}: median so far {statistics.median(times[name]):.4f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print("\n| configuration | median step (s) | steps |")
    print("|---|---|---|")
    for name, median in medians.items():
        print(f"| {name} | {median:.4f} | {len(times[name])} |")
    base, ours = medians["ddp"], medians[f"gc_fused none {args.fusion}"]
    print(f"\nratio gc_fused / ddp = {ours / base:.3f}")


if __name__ == "__main__":
    main()
