"""Convergence of every compressor on a real data set: scikit-learn's handwritten digits.

A small CNN trains on ``sklearn.datasets.load_digits`` (1,797 8x8 images, no download; the last 360
images are the test set) with 2 CPU ranks over gloo for a fixed budget, once uncompressed and once
per compressor at its usual setting. Prints a markdown table: test accuracy, bytes sent per step and
compression ratio (from the synchroniser's telemetry).

    python benchmarks/convergence_digits.py --epochs 100

Learning rates are per method (the table prints them): randk's error feedback releases each
coordinate about once per 1/density steps, which needs no optimizer momentum and more steps than the
others; the scaled sign methods (onebit, efsignsgd) want a smaller step than the uncompressed
gradient.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import lightning.pytorch as pl
import torch
from cli import integer_at_least
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gc_strategy

#: (label, strategy options, learning rate, optimizer momentum)
METHODS = [
    ("none", dict(compressor="none"), 0.05, 0.9),
    ("fp16", dict(compressor="fp16"), 0.05, 0.9),
    ("bf16", dict(compressor="bf16"), 0.05, 0.9),
    ("topk 1% + residual", dict(compressor="topk", density=0.01, memory="residual"), 0.05, 0.9),
    ("randk 1% + residual", dict(compressor="randk", density=0.01, memory="residual"), 0.1, 0.0),
    ("dgc 1% + dgc memory", dict(compressor="dgc", density=0.01, memory="dgc"), 0.05, 0.0),
    ("threshold 0.002 + residual", dict(compressor="threshold", threshold=0.002, memory="residual"), 0.05, 0.9),
    ("sidco 1% + residual", dict(compressor="sidco", density=0.01, memory="residual", stages=2), 0.05, 0.9),
    ("qsgd s=127", dict(compressor="qsgd", levels=127), 0.05, 0.9),
    ("terngrad", dict(compressor="terngrad"), 0.05, 0.9),
    ("natural", dict(compressor="natural"), 0.05, 0.9),
    ("onebit + residual", dict(compressor="onebit", memory="residual"), 0.03, 0.9),
    ("efsignsgd + residual", dict(compressor="efsignsgd", memory="residual"), 0.03, 0.9),
    ("signsgd (majority vote)", dict(compressor="signsgd"), 0.002, 0.0),
    ("signum (majority vote)", dict(compressor="signum"), 0.002, 0.0),
]
#: methods with error feedback: they must come within 2 points of "none"
ERROR_FEEDBACK = {label for label, options, _, _ in METHODS if options.get("memory") in ("residual", "dgc")}


def digits(split: str) -> TensorDataset:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    part = slice(None, -360) if split == "train" else slice(-360, None)
    return TensorDataset(images[part], labels[part])


class DigitsCNN(pl.LightningModule):
    def __init__(self, lr: float, momentum: float, epochs: int, report: str) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 16, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        self.lr, self.momentum, self.epochs, self.report = lr, momentum, epochs, report

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.epochs)]

    def train_dataloader(self):
        return DataLoader(digits("train"), batch_size=32, shuffle=True)

    def on_train_end(self):
        if self.trainer.is_global_zero:
            test = digits("test")
            with torch.no_grad():
                accuracy = (self.net(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
            telemetry = self.trainer.strategy.synchronizer.telemetry
            with open(self.report, "w") as f:
                json.dump(
                    {
                        "accuracy": accuracy,
                        "sent_bytes_per_step": telemetry.total.sent_bytes / telemetry.steps,
                        "compression_ratio": telemetry.total.compression_ratio,
                    },
                    f,
                )


def train(options: dict, lr: float, momentum: float, epochs: int, seed: int) -> dict:
    report = tempfile.mktemp(suffix=".json")
    pl.seed_everything(seed, verbose=False)
    module = DigitsCNN(lr, momentum, epochs, report)
    strategy = gc_strategy.GCFusedStrategy(start_method="fork", **options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    with open(report) as f:
        result = json.load(f)
    os.remove(report)
    return result


def run_all(epochs: int, seed: int = 0, only: list[str] | None = None) -> dict[str, dict]:
    """Train "none" and every method whose label starts with one of ``only`` (all when None)."""
    chosen = [m for m in METHODS if only is None or m[0] == "none" or any(m[0].startswith(o) for o in only)]
    return {
        label: dict(train(options, lr, momentum, epochs, seed), lr=lr, momentum=momentum)
        for label, options, lr, momentum in chosen
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=integer_at_least(1), default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", metavar="LABEL", help="methods whose label starts with these")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run_all(args.epochs, args.seed, args.only)
    baseline = results["none"]["accuracy"]
    print("\n| method | lr, momentum | test accuracy | Δ vs none (points) | bytes sent / step | compression ratio |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        delta = 100 * (r["accuracy"] - baseline)
        verdict = (" ✓" if delta >= -2 else " ✗ (> 2 points below none)") if label in ERROR_FEEDBACK else ""
        print(
            f"| {label} | {r['lr']}, {r['momentum']} | {100 * r['accuracy']:.1f}% | {delta:+.1f}{verdict} | "
            f"{r['sent_bytes_per_step']:,.0f} | {r['compression_ratio']:.1f} |"
        )


if __name__ == "__main__":
    main()
