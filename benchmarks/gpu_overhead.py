"""The synchroniser's overhead on one GPU (world size 1, NCCL), and what the side stream gains.

ResNet-50 (torchvision, 224x224, batch ``--batch``, SGD) trains with: no synchronisation at all
(``plain``), torch's DistributedDataParallel, and the gradient synchroniser with ``compressor=none``
and with ``efsignsgd`` + residual memory over fused buckets, each with its exchanges on the side
stream and on the compute stream. One process holds every configuration (same initial weights);
they run interleaved round by round (A B C ... A B C ...) so that clock and thermal drift hit all
alike; a step is timed from its start to ``torch.cuda.synchronize`` after the optimizer step.
Reported: median step time, its ratio to ``plain``, and the exposed time (median minus plain's).

    python benchmarks/gpu_overhead.py --rounds 10 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchvision import models

from gc_strategy import GradientSynchronizer, build_components

#: name -> (compressor, memory, fusion, side stream); None: no synchroniser
CONFIGS = {
    "plain": None,
    "ddp": None,
    "gc none": ("none", "none", "bucket_mb:25", True),
    "gc none, compute stream": ("none", "none", "bucket_mb:25", False),
    "gc efsignsgd": ("efsignsgd", "residual", "bucket_mb:25", True),
    "gc efsignsgd, compute stream": ("efsignsgd", "residual", "bucket_mb:25", False),
    "gc efsignsgd single bucket": ("efsignsgd", "residual", "single", True),
}


def build(name: str, reference: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = copy.deepcopy(reference)
    keep = None
    if name == "ddp":
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    elif CONFIGS[name] is not None:
        compressor, memory, fusion, side = CONFIGS[name]
        c = build_components(compressor, memory, fusion=fusion)
        keep = GradientSynchronizer(model, c.compressor, c.memory, c.communicator, c.fusion, side_stream=side)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    reference = models.resnet50(num_classes=1000).cuda()
    x = torch.randn(args.batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    runs = {name: build(name, reference) for name in args.configs}
    times: dict[str, list[float]] = {name: [] for name in args.configs}

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for name, (model, optimizer, _) in runs.items():
        for _ in range(args.warmup):
            step(model, optimizer)
    for _ in range(args.rounds):
        for name, (model, optimizer, _) in runs.items():
            times[name] += [step(model, optimizer) for _ in range(args.steps)]
    plain = statistics.median(times["plain"]) if "plain" in times else None
    print(f"\nResNet-50, batch {args.batch}, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"{args.rounds} rounds x {args.steps} steps\n")
    print("| configuration | median step (ms) | / plain | exposed (ms) |")
    print("|---|---|---|---|")
    for name, samples in times.items():
        median = statistics.median(samples)
        ratio = f"{median / plain:.3f}" if plain else "-"
        exposed = f"{1000 * (median - plain):.2f}" if plain else "-"
        print(f"| {name} | {1000 * median:.2f} | {ratio} | {exposed} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
