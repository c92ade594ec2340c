"""PowerSGD vs ACP-SGD on ResNet shapes: bytes per step, compression ratio, encode+decode time.

Runs the gradient synchroniser in one process (the collectives are then no-ops, so the timings are
the compression cost alone) on torchvision ResNet-18 with the CIFAR stem (3x3 conv, no max-pool) and
ResNet-50, fused in 25 MB buckets, for ranks 1, 2, 4, 8. Reports medians over the measured steps
(``--steps``) after ``start_iter`` and one warm-up step.

    python benchmarks/powersgd_costs.py --steps 10
"""

from __future__ import annotations

import argparse
import statistics

import torch
from cli import integer_at_least
from torch import nn

from gc_strategy import GradientSynchronizer, build_components


def resnet(name: str) -> nn.Module:
    from torchvision import models

    model = getattr(models, name)(num_classes=10)
    if name == "resnet18":  # the CIFAR stem
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


def measure(model_name: str, compressor: str, rank: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = resnet(model_name)
    c = build_components(compressor, rank=rank, start_iter=0, fusion="bucket_mb:25")
    synchronizer = GradientSynchronizer(model, c)
    x = torch.randn(2, 3, 32, 32)
    times, sent = [], []
    for step in range(steps + 2):
        model.zero_grad()
        model(x).sum().backward()
        t = synchronizer.telemetry.last
        if step >= 2:
            times.append(t.encode_s + t.decode_s)
            sent.append(t.sent_bytes)
    raw = synchronizer.telemetry.last.raw_bytes
    return {
        "ms": 1000 * statistics.median(times),
        "sent": statistics.median(sent),
        "ratio": raw / statistics.median(sent),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=integer_at_least(1), default=10)
    parser.add_argument("--threads", type=integer_at_least(1), default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| model | rank | PowerSGD bytes/step | ratio | ACP-SGD bytes/step (mean of P and Q steps) | ratio "
        "| PowerSGD enc+dec (ms) | ACP-SGD enc+dec (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model_name in ("resnet18", "resnet50"):
        for rank in (1, 2, 4, 8):
            power = measure(model_name, "powersgd", rank, args.steps)
            acp = measure(model_name, "acpsgd", rank, args.steps)
            print(
                f"| {model_name} | {rank} | {power['sent']:,.0f} | {power['ratio']:.0f} | {acp['sent']:,.0f} | "
                f"{acp['ratio']:.0f} | {power['ms']:.1f} | {acp['ms']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
