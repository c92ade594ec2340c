"""One rank of one time-to-perplexity configuration (started by ``benchmarks/time_to_perplexity.py``).

    python benchmarks/time_to_perplexity_worker.py SETTINGS.json NAME TARGET RESULT.json

The rank and rendezvous come from the environment, as for ``bench_worker.py``; the ranks of a node
share its emulated link. The task: ``model=gpt`` (recipes/gpt.py, AdamW) on ``data=text``'s default
corpus (recipes/corpus.py: the standard library's source, byte by byte, split by file). Every rank
takes part in each validation (every ``eval_every`` optimizer steps, over the first ``val_tokens``
of the validation stream, split over the ranks) and measures the training wall time so far with the
validations left out. The run trains ``steps`` steps; where ``TARGET`` is a loss (not ``none``) it
goes on, up to ``max_factor`` times as many, until a validation reaches it. Rank 0 writes the
validation points; every rank the bytes its node's interface sent while training (one rank a node
counts them, as the node's ranks share the interface).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from bench_worker import make_strategy
from netns import sent_bytes

from gc_strategy import DiLoCo, GCFSDPStrategy, GCFusedStrategy, sparseloco
from gc_strategy.integrations.lightning_glue import end_process_group

#: DiLoCo's inner steps in every DiLoCo configuration (a divisor of the validation interval, so that
#: each validation sees the replicas just after an outer step)
INNER_STEPS = 10

#: the configurations by name: what builds each one's strategy
CONFIGURATIONS: dict[str, Callable[[], Any]] = {
    "ddp": lambda: make_strategy("ddp", warmup=0),
    "ddp+powersgd": lambda: make_strategy("ddp+powersgd-1bucket", warmup=0),
    "topk+residual": lambda: GCFusedStrategy(
        process_group_backend="gloo", compressor="topk", density=0.01, memory="residual"
    ),
    "powersgd": lambda: GCFusedStrategy(process_group_backend="gloo", compressor="powersgd", rank=4),
    "hsdp topk+residual": lambda: GCFSDPStrategy(
        process_group_backend="gloo", compressor="topk", density=0.01, memory="residual"
    ),
    "diloco": lambda: GCFusedStrategy(process_group_backend="gloo", sync=DiLoCo(inner_steps=INNER_STEPS)),
    # DiLoCo's outer step without momentum at lr 1, SparseLoCo's: the mean of the replicas every H steps
    "diloco (outer SGD, lr 1)": lambda: GCFusedStrategy(
        process_group_backend="gloo", sync=DiLoCo(inner_steps=INNER_STEPS, outer_lr=1.0, outer_momentum=0.0)
    ),
    "sparseloco": lambda: GCFusedStrategy(process_group_backend="gloo", **sparseloco(inner_steps=INNER_STEPS)),
    "streaming diloco": lambda: GCFusedStrategy(
        process_group_backend="gloo", sync=DiLoCo(inner_steps=INNER_STEPS, fragments=2, overlap_steps=1)
    ),
}


class LossClock(pl.Callback):
    """Each validation's loss against the training seconds before it (validations left out), and
    the bytes this node sent while training; stops the run at the first validation from ``steps``
    on whose loss is at most ``target`` (the same decision on every rank: the loss is reduced over
    all of them)."""

    def __init__(self, interface: str, steps: int, target: float | None) -> None:
        self.interface, self.steps, self.target = interface, steps, target
        self.points: list[dict[str, float]] = []
        self.start = self.paused_at = self.paused = 0.0
        self.sent = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.sent = -sent_bytes(self.interface)
        self.start = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.paused_at = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        loss = float(trainer.callback_metrics["val/loss"])
        step = trainer.global_step
        train_s = self.paused_at - self.start - self.paused
        self.points.append({"step": step, "train_s": train_s, "val_loss": loss})
        if step >= self.steps and (self.target is None or loss <= self.target):
            trainer.should_stop = True
        self.paused += time.perf_counter() - self.paused_at

    def on_train_end(self, trainer, pl_module) -> None:
        self.sent += sent_bytes(self.interface)


def main(settings_path: str, name: str, target: str, result_path: str) -> None:
    from recipes.corpus import CorpusDataModule  # the repository's root is on the ranks' PYTHONPATH
    from recipes.gpt import GPTLanguageModel

    with open(settings_path) as f:
        settings = json.load(f)
    torch.set_num_threads(settings["threads_per_rank"])
    pl.seed_everything(settings["seed"], verbose=False)
    data = CorpusDataModule(
        context=settings["context"], batch_size=settings["batch_size"], val_tokens=settings["val_tokens"]
    )
    module = GPTLanguageModel(
        data.vocab_size,
        settings["context"],
        width=settings["width"],
        layers=settings["layers"],
        heads=settings["heads"],
        lr=settings["lr"],
    )
    goal = None if target == "none" else float(target)
    steps = settings["steps"]
    clock = LossClock(os.environ.get("GLOO_SOCKET_IFNAME", "lo"), steps, goal)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=settings["per_node"],
        num_nodes=settings["nodes"],
        strategy=CONFIGURATIONS[name](),
        max_steps=steps if goal is None else int(steps * settings["max_factor"]),
        val_check_interval=settings["eval_every"],
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module, datamodule=data)
    result: dict[str, Any] = {"local_rank": trainer.local_rank, "sent_bytes": clock.sent}
    if trainer.is_global_zero:
        result.update(points=clock.points, steps=trainer.global_step)
    with open(result_path, "w") as f:
        json.dump(result, f)
    end_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:5])
