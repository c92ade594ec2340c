"""One replica group of tests/sync/fault_tolerance/test_fault_tolerant_mode.py: docs/extending.md's fault-tolerant toy
sync mode (``local_odd_steps``, registered by the page's blocks) trains ft_worker's MLP on the
group's own batches for ``--steps`` steps, in a plain loop (``attach``), under Lightning
(``GCFusedStrategy``) or under Accelerate (``prepare``), each selecting it by name. Writes the
final parameters and each step's round report to ``--out``."""

import argparse

import lightning.pytorch as L
import torch
from ft_worker import batch, model
from test_extending import _examples
from torch.utils.data import DataLoader

from gc_strategy import SYNC_MODES, FaultTolerance, GCFusedStrategy, Replicated, attach, build_components

_examples()  # registers the page's sync modes


def loss_of(net: torch.nn.Module, group: int, step: int) -> torch.Tensor:
    x, y = batch(group, step)
    return (net(x) - y).square().mean()


class Regression(L.LightningModule):
    """The MLP; batch ``i`` of the loader is step ``i``'s index."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.net, self.group, self.reports = model(), group, []

    def training_step(self, step, index):
        return loss_of(self.net, self.group, int(step))

    def on_train_batch_end(self, *args):
        self.reports.append(self.trainer.strategy.synchronizer.last_round)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--lighthouse", "--out", "--via"):
        parser.add_argument(name, required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    options = FaultTolerance(args.lighthouse, args.group, groups=2, min_replicas=2, timeout_s=10, host="127.0.0.1")
    reports = []
    if args.via == "lightning":
        module = Regression(args.group)
        strategy = GCFusedStrategy(sync="local_odd_steps", fault_tolerance=options)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_steps=args.steps,
            use_distributed_sampler=False,  # item i of the loader is step i's index; the batch is the group's own
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(range(args.steps), batch_size=None))
        net, reports = module.net, module.reports
    else:
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        if args.via == "accelerate":
            from accelerate import Accelerator

            from gc_strategy.accelerate import prepare

            net, optimizer = prepare(
                Accelerator(cpu=True), net, optimizer, sync="local_odd_steps", fault_tolerance=options
            )
            sync = net.gc_synchronizer
        else:
            mode = SYNC_MODES.get("local_odd_steps")()
            sync = mode.build(net, build_components("none"), Replicated(fault_tolerance=options))
            (optimizer,) = attach(sync, net, [optimizer]).optimizers
        for step in range(args.steps):
            loss_of(net, args.group, step).backward()
            optimizer.step()  # where the round commits (every step: both groups are always there)
            optimizer.zero_grad()
            reports.append(sync.last_round)
        sync.close()
    params = {name: p.detach().clone() for name, p in net.named_parameters()}
    records = [(r.participants, r.committed, r.failed_rounds) for r in reports]
    torch.save({"params": params, "reports": records}, args.out)


if __name__ == "__main__":
    main()
