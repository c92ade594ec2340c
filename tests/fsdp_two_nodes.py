"""One rank of a 2 nodes x 2 ranks run of ``strategy="gc_fsdp"`` (or of native HSDP through
Lightning's ``ModelParallelStrategy``), started by torchrun: ``python fsdp_two_nodes.py KIND OUT``
with KIND ``native``, ``none`` or ``topk``. Each rank writes its full parameters to ``OUT/rankR.pt``."""

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gc_strategy import GCFSDPStrategy


class TwoNodes(pl.LightningModule):
    def __init__(self, out, native):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.out, self.native = out, native

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh if self.native else self.device_mesh["shard"]  # 2-D: HSDP
        for layer in (self.net[0], self.net[2], self.net[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g))
        return DataLoader(data, batch_size=8, shuffle=False)

    def on_train_end(self):
        flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in self.parameters()])
        torch.save(flat, os.path.join(self.out, f"rank{self.global_rank}.pt"))


class NativeHSDP(ModelParallelStrategy):
    """Lightning's FSDP2 strategy on a (nodes, devices) mesh, every rank reading its own data, as in
    HSDP (``ModelParallelStrategy`` gives the ranks of its second dimension, meant for tensor
    parallelism, the same batches)."""

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": self.world_size, "rank": self.global_rank}


def main(kind: str, out: str) -> None:
    if kind == "native":
        strategy = NativeHSDP(data_parallel_size=2, tensor_parallel_size=2)
    else:
        options = dict(compressor="topk", memory="residual", density=0.1) if kind == "topk" else {}
        strategy = GCFSDPStrategy(**options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TwoNodes(out, kind == "native"))
    torch.distributed.destroy_process_group()  # Lightning leaves gloo groups to the interpreter's exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
