"""One rank of a 2 nodes x 2 ranks run of ``strategy="gc_fsdp"`` (or of native HSDP through
Lightning's ``ModelParallelStrategy``), started by torchrun: ``python fsdp_two_nodes.py KIND OUT``
with KIND ``native``, ``none`` or ``topk``. Each rank writes its full parameters to ``OUT/rankR.pt``."""

import sys

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from models import ShardedMLP, fit

from gc_strategy import GCFSDPStrategy


class NativeHSDP(ModelParallelStrategy):
    """Lightning's FSDP2 strategy on a (nodes, devices) mesh, every rank reading its own data, as in
    HSDP (``ModelParallelStrategy`` gives the ranks of its second dimension, meant for tensor
    parallelism, the same batches)."""

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": self.world_size, "rank": self.global_rank}


def main(kind: str, out: str) -> None:
    if kind == "native":
        strategy, mesh_dim = NativeHSDP(data_parallel_size=2, tensor_parallel_size=2), "*"  # the 2-D mesh: HSDP
    else:
        options = dict(compressor="topk", memory="residual", density=0.1) if kind == "topk" else {}
        strategy, mesh_dim = GCFSDPStrategy(**options), "shard"
    fit(ShardedMLP(out, mesh_dim), strategy, num_nodes=2, max_epochs=2)
    torch.distributed.destroy_process_group()  # Lightning leaves gloo groups to the interpreter's exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
