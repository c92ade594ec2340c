"""One rank of one time-to-accuracy configuration (started by ``benchmarks/time_to_accuracy.py``).

    python benchmarks/time_to_accuracy_worker.py SETTINGS.json NAME RESULT.json

The rank and rendezvous come from the environment, as for ``bench_worker.py``; every rank is its own
emulated node. The task: an MLP (64 → hidden → hidden → 10) on scikit-learn's handwritten digits,
the last 360 images held out, trained with SGD (momentum 0.9) and a cosine learning-rate decay.
Rank 0 measures the held-out accuracy every ``eval_every`` optimizer steps and at the end, against
the training wall time so far (the evaluations excluded); every rank writes the bytes its node's
interface sent during training.
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from bench_worker import make_strategy
from convergence_digits import digits
from netns import sent_bytes
from torch import nn
from torch.utils.data import DataLoader

from gc_strategy.integrations.lightning_glue import end_process_group


class DigitsMLP(pl.LightningModule):
    def __init__(self, hidden: int, lr: float, batch_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )
        self.lr, self.batch_size = lr, batch_size

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        """SGD with momentum, the learning rate decayed to 0 over the run along a cosine."""
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(digits("train"), batch_size=self.batch_size, shuffle=True)

    def accuracy(self) -> float:
        test = digits("test")
        with torch.no_grad():
            return (self.net(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()


class AccuracyClock(pl.Callback):
    """Rank 0: held-out accuracy every ``every`` steps against training seconds (evaluation time
    left out); every rank: the bytes its node sent while training."""

    def __init__(self, every: int, interface: str) -> None:
        self.every, self.interface = every, interface
        self.points: list[dict[str, float]] = []
        self.start = self.paused = 0.0
        self.sent_at_start = 0
        self.sent = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.sent_at_start = sent_bytes(self.interface)
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self._measure(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.points or self.points[-1]["step"] != trainer.global_step:
            self._measure(trainer, pl_module)
        self.sent = sent_bytes(self.interface) - self.sent_at_start

    def _measure(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        paused = time.perf_counter()
        elapsed = paused - self.start - self.paused
        self.points.append({"step": trainer.global_step, "train_s": elapsed, "accuracy": pl_module.accuracy()})
        self.paused += time.perf_counter() - paused


def main(settings_path: str, name: str, result_path: str) -> None:
    with open(settings_path) as f:
        settings = json.load(f)
    torch.set_num_threads(settings["threads_per_rank"])
    pl.seed_everything(settings["seed"], verbose=False)
    module = DigitsMLP(settings["hidden"], settings["lr"], settings["batch_size"])
    clock = AccuracyClock(settings["eval_every"], os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=settings["world_size"],
        strategy=make_strategy(name, warmup=0),
        max_epochs=settings["epochs"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module)
    with open(result_path, "w") as f:
        json.dump({"points": clock.points, "sent_bytes": clock.sent, "steps": trainer.global_step}, f)
    end_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:4])
