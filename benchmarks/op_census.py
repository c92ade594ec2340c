"""Kernel-launching ops per synchronised step, for each compressor, along the accelerator's code path.

A GPU step costs the host one launch per kernel, a few microseconds each; a compressor whose work
per bucket grows with the tensors in it launches hundreds of small kernels per step. On the CPU,
with the kernels forced to their accelerator variants (``kernels.forced("torch")``), the same ops
run, so :class:`op_recorder.OpRecorder` counts them without a GPU (views, metadata and allocations
left out). One process, world size 1 (the collectives launch nothing), ``bucket_mb:25``:

- per model (torchvision ResNet-50, ``transformers`` BERT-base): the ops of plain backward, and
  what each compressor with its usual memory adds to them (the mean over ``--steps`` steps after
  the two that record the gradient order and build the buckets), with the ops that make a GPU host
  wait; and what ``none`` adds where the gradients are kept from step to step, which then
  accumulate in their buckets;
- growth with the tensor count: the ops ``none`` and each compressor add for MLPs of 8, 32 and 128
  layers (the last fills two buckets: the first bucket is small, as DDP's), and per bucket the ops
  beyond the one copy per tensor that gathers the gradients: the same at every size where the work
  per bucket does not grow with its tensors.

    python benchmarks/op_census.py
    python benchmarks/op_census.py --models resnet50 --compressors none topk --out ops.md
"""

from __future__ import annotations

import argparse
import time

import torch
from cli import integer_at_least
from compression_costs import USUAL, model_and_loss
from op_recorder import OpRecorder
from torch import nn

from gc_strategy import COMPRESSORS, GradientSynchronizer, build_components, kernels

MODELS = ("resnet50", "bert-base")
LAYERS = (8, 32, 128)
#: steps left out: the first records the gradient order, the second builds the buckets in that order
#: and their metadata (once per plan, not per step)
WARMUP = 2


def census(
    model: nn.Module, loss_fn, compressor: str | None, steps: int, keep_grads: bool = False
) -> tuple[float, dict[str, int], int]:
    """Mean kernel-launching ops per step of backward with ``compressor`` synchronising (None: plain
    backward), the waits seen, and the synchroniser's bucket count; the gradients set to None
    before each backward, or zeroed in place (``keep_grads``)."""
    synchronizer = None
    if compressor is not None:
        memory, options = USUAL.get(compressor, ("none", {}))
        roles = build_components(compressor, memory, "auto", "bucket_mb:25", **options)
        synchronizer = GradientSynchronizer(model, roles)
    counts, waits = [], {}
    for step in range(WARMUP + steps):
        model.zero_grad(set_to_none=not keep_grads)
        loss = loss_fn()
        with OpRecorder() as ops:
            loss.backward()
        if step >= WARMUP:
            counts.append(sum(ops.launches.values()))
            waits.update(ops.waits)
    buckets = 0
    if synchronizer is not None:
        buckets = len(synchronizer.buckets)
        synchronizer.close()
    return sum(counts) / len(counts), waits, buckets


def mlp(layers: int) -> tuple[nn.Module, object]:
    """``layers`` linear layers of 64 (2 tensors each), on a fixed batch."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    return model, lambda: model(x).square().mean()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--compressors", nargs="+", default=COMPRESSORS.names(), choices=COMPRESSORS.names())
    parser.add_argument("--steps", type=integer_at_least(1), default=2, help="counted steps per configuration")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lines = []
    with kernels.forced("torch"):
        for name in args.models:
            model, loss_fn = model_and_loss(name, batch=2, image_size=64, device=torch.device("cpu"))
            tensors = sum(p.requires_grad for p in model.parameters())
            plain, _, _ = census(model, loss_fn, None, args.steps)
            lines += [
                f"\n### {name}: {tensors} tensors; plain backward launches {plain:.0f} ops\n",
                "| compressor | memory | ops added per step | over `none` | ops that make a GPU host wait |",
                "|---|---|---|---|---|",
            ]
            added = {}
            for compressor in ["none", *[c for c in args.compressors if c != "none"]]:
                started = time.perf_counter()
                ops, waits, _ = census(model, loss_fn, compressor, args.steps)
                added[compressor] = ops - plain
                memory = USUAL.get(compressor, ("none", {}))[0]
                waiting = ", ".join(f"{op} ×{n}" for op, n in sorted(waits.items())) or "none"
                lines.append(
                    f"| `{compressor}` | `{memory}` | {added[compressor]:.0f} | "
                    f"{added[compressor] - added['none']:+.0f} | {waiting} |"
                )
                print(lines[-1], f"({time.perf_counter() - started:.1f} s)", flush=True)
            kept = census(model, loss_fn, "none", args.steps, keep_grads=True)[0]
            kept -= census(model, loss_fn, None, args.steps, keep_grads=True)[0]
            lines.append(f"\n`none` with the gradients kept (`zero_grad(set_to_none=False)`) adds {kept:.0f} ops.")
            print(lines[-1], flush=True)
        lines += [
            f"\n### Growth with the tensor count: MLPs of {', '.join(map(str, LAYERS))} layers\n",
            "| compressor | ops added at " + " / ".join(f"{2 * n}" for n in LAYERS) + " tensors | buckets "
            "| per bucket, beyond one copy per tensor |",
            "|---|---|---|---|",
        ]
        for compressor in ["none", *[c for c in args.compressors if c != "none"]]:
            counts, buckets = [], []
            for layers in LAYERS:
                model, loss_fn = mlp(layers)
                plain, _, _ = census(model, loss_fn, None, 1)
                ops, _, made = census(model, loss_fn, compressor, 1)
                counts.append(ops - plain)
                buckets.append(made)
            per_bucket = [(c - 2 * n) / b for c, n, b in zip(counts, LAYERS, buckets)]
            lines.append(
                f"| `{compressor}` | {' / '.join(f'{c:.0f}' for c in counts)} | {' / '.join(map(str, buckets))} "
                f"| {' / '.join(f'{c:.1f}' for c in per_bucket)} |"
            )
            print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
