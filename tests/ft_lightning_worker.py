"""One replica group of the Lightning fault-tolerance test (tests/sync/fault_tolerance/test_fault_tolerance.py): a
LightningModule trained by ``Trainer(strategy=GCFusedStrategy(..., fault_tolerance=...))``, the
ranks of one torchrun, each on its own shard of the data. With ``--die-at S`` every rank kills
itself (SIGKILL) in the first training step from global step ``S`` on that every group takes part
in, after a step they all took part in, before its backward (and so before its exchange). It
stops at a step from ``--steps`` on that every group took part in, and each rank writes its
parameters, optimizer and scheduler state, global step and a record of the steps to ``--out`` with
``.rank{r}.pt`` for ``.pt``. With ``--checkpoints DIR`` a checkpoint is saved at each epoch's end;
``--resume PATH`` starts from one. ``--inner-steps H`` trains with DiLoCo, stopping at an outer
step. ``--sharded``: ``GCFSDPStrategy``, FSDP2 over the group's ranks, each rank writing its shards."""

import argparse
import copy
import os
import signal

import lightning as L
import torch
from ft_worker import all_took_part, group_arguments, wait_for_groups
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gc_strategy import DiLoCo, FaultTolerance, GCFSDPStrategy, GCFusedStrategy
from gc_strategy.sync.fault_tolerance.shards import local


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
        #: per epoch: whether this group writes the checkpoint
        self.writers: list[bool] = []

    def on_train_start(self, trainer, module):
        wait_for_groups(self.args)  # the synchroniser (its manager) exists: the groups start together

    def on_before_backward(self, trainer, module, loss):
        sync = trainer.strategy.synchronizer
        together = all_took_part(self.record, self.args.groups)
        if 0 <= self.args.die_at <= trainer.global_step and sync.participants == self.args.groups and together:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        sync = trainer.strategy.synchronizer
        report = sync.last_round
        self.record.append(
            {
                "global_step": trainer.global_step,
                "batches_per_epoch": trainer.num_training_batches,
                "participants": report.participants,
                "committed": report.committed,
            }
        )
        # DiLoCo: an outer step that every group took part in and contributed to, with no inner step since
        every = report.committed and report.participants == self.args.groups
        together = sync.together if self.args.inner_steps else every
        if together and trainer.global_step >= self.args.steps:
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, module):
        self.writers.append(trainer.strategy.synchronizer.writes_checkpoints)


def main() -> None:
    parser = group_arguments()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--checkpoints", help="a folder: a checkpoint at each epoch's end")
    parser.add_argument("--resume", help="a checkpoint to resume from")
    parser.add_argument("--inner-steps", type=int, default=0, help="DiLoCo's (0: every step)")
    parser.add_argument("--sharded", action="store_true", help="GCFSDPStrategy: FSDP2 over the group's ranks")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 12, generator=g), torch.randn(args.samples, 3, generator=g))
    options = FaultTolerance(
        args.lighthouse, args.group, groups=args.groups, min_replicas=args.min_replicas, timeout_s=10, host="127.0.0.1"
    )
    sync = DiLoCo(inner_steps=args.inner_steps) if args.inner_steps else "every_step"
    kind = GCFSDPStrategy if args.sharded else GCFusedStrategy
    strategy = kind(compressor="topk", memory="residual", density=0.3, sync=sync, fault_tolerance=options)
    watch = Watch(args)
    every_epoch = ModelCheckpoint(args.checkpoints, "{epoch}", save_top_k=-1, enable_version_counter=False)
    saving = [every_epoch] if args.checkpoints else []
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),  # torchrun's ranks: the group's
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=bool(saving),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[watch, *saving],
    )
    module = Regression()
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=args.resume)
    optimizer = trainer.optimizers[0]
    torch.save(
        {
            "params": local({n: p.detach().clone() for n, p in module.named_parameters()}),
            "optimizer": local(copy.deepcopy(optimizer.state_dict())),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "batches_per_epoch": trainer.num_training_batches,
            "record": watch.record,
            "writers": watch.writers,
        },
        args.out.replace(".pt", f".rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
