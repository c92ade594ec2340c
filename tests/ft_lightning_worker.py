"""One replica group of the Lightning fault-tolerance test (tests/test_fault_tolerance.py): a
LightningModule trained by ``Trainer(strategy=GCFusedStrategy(..., fault_tolerance=...))``, the
ranks of one torchrun, each on its own shard of the data. With ``--die-at S`` every rank kills
itself (SIGKILL) in the first training step from global step ``S`` on that every group takes part
in, after a step they all took part in, before its backward (and so before its exchange). It
stops at a step from ``--steps`` on that every group took part in, and each rank writes its
parameters, optimizer and scheduler state, global step and a record of the steps to ``--out`` with
``.rank{r}.pt`` for ``.pt``."""

import argparse
import copy
import os
import signal

import lightning as L
import torch
from ft_worker import all_took_part, group_arguments, wait_for_groups
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gc_strategy import GCFusedStrategy
from gc_strategy.sync.quorum import FaultTolerance


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_index):
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Watch(L.Callback):
    """Records each step; kills this group or stops the run as the arguments say."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.record = args, []

    def on_train_start(self, trainer, module):
        wait_for_groups(self.args)  # the synchroniser (its manager) exists: the groups start together

    def on_before_backward(self, trainer, module, loss):
        sync = trainer.strategy.synchronizer
        together = all_took_part(self.record, self.args.groups)
        if 0 <= self.args.die_at <= trainer.global_step and sync.participants == self.args.groups and together:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        sync = trainer.strategy.synchronizer
        extra = sync.telemetry.last.extra
        self.record.append(
            {
                "global_step": trainer.global_step,
                "batches_per_epoch": trainer.num_training_batches,
                "participants": extra["participants"],
                "committed": bool(extra["committed"]),
            }
        )
        if extra["committed"] and trainer.global_step >= self.args.steps and sync.participants == self.args.groups:
            trainer.should_stop = True


def main() -> None:
    args = group_arguments().parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 12, generator=g), torch.randn(4096, 3, generator=g))
    options = FaultTolerance(args.lighthouse, args.group, groups=args.groups, timeout_s=10, host="127.0.0.1")
    strategy = GCFusedStrategy(compressor="topk", memory="residual", density=0.3, fault_tolerance=options)
    watch = Watch(args)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),  # torchrun's ranks: the group's
        max_epochs=100,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[watch],
    )
    module = Regression()
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True))
    optimizer = trainer.optimizers[0]
    torch.save(
        {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "batches_per_epoch": trainer.num_training_batches,
            "record": watch.record,
        },
        args.out.replace(".pt", f".rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
