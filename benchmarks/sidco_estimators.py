"""SIDCo's threshold estimators next to exact top-k and DGC's sampled threshold (after the
microbenchmark of Abdelmoniem et al., MLSys 2021).

For one gradient-like vector and the target densities 0.1, 0.01 and 0.001 it prints, per method, the
achieved density (selected / n), its ratio to the target, and the median encode time (selection +
gather of values and indices) over ``--repeats`` runs on this device.

The vector is the real flattened gradient of torchvision ResNet-18 (CIFAR stem, random batch of 32;
11.2M elements) by default, or i.i.d. ``laplace`` / ``normal`` samples of ``--size`` elements.

    python benchmarks/sidco_estimators.py --source resnet18 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cli import add_device_option, integer_at_least
from torch import nn

from gc_strategy import COMPRESSORS
from gc_strategy.bucket import Bucket

DENSITIES = (0.1, 0.01, 0.001)
#: (label, compressor name, options besides density)
METHODS = [
    ("topk (exact)", "topk", {}),
    ("dgc (sampled)", "dgc", {}),
    ("sidco exponential, 1 stage", "sidco", dict(estimator="exponential", stages=1, adapt_every=0)),
    ("sidco exponential, 3 stages", "sidco", dict(estimator="exponential", stages=3, adapt_every=0)),
    ("sidco gpareto, 1 stage", "sidco", dict(estimator="gpareto", stages=1, adapt_every=0)),
    ("sidco gpareto, 3 stages", "sidco", dict(estimator="gpareto", stages=3, adapt_every=0)),
    ("sidco gamma+gpareto, 1 stage", "sidco", dict(estimator="gamma", stages=1, adapt_every=0)),
    ("sidco gamma+gpareto, 3 stages", "sidco", dict(estimator="gamma", stages=3, adapt_every=0)),
]


def resnet18_gradients() -> list[torch.Tensor]:
    """Each parameter's gradient of torchvision ResNet-18 (CIFAR stem, 10 classes) on a random batch of 32."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    loss = nn.functional.cross_entropy(model(torch.randn(32, 3, 32, 32)), torch.randint(10, (32,)))
    loss.backward()
    return [p.grad.flatten() for p in model.parameters()]


def resnet18_gradient() -> torch.Tensor:
    return torch.cat(resnet18_gradients())


def gradient(source: str, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if source == "resnet18":
        return resnet18_gradient()
    if source == "normal":
        return torch.randn(size, generator=generator)
    u = torch.rand(size, generator=generator) - 0.5  # Laplace(0, 1) by inverse CDF
    return -u.sign() * torch.log1p(-2 * u.abs())


def measure(name: str, options: dict, density: float, g: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(achieved density, median encode seconds)."""
    compressor = COMPRESSORS.build(name, density=density, **options)
    bucket = Bucket(0, ["g"], [g.shape], g.dtype, g.device)
    times, selected = [], 0
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        values, _ = compressor.encode(g, bucket)
        if g.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        # what the threshold selected (a fixed-capacity payload also holds empty slots)
        selected = int(compressor.above) if hasattr(compressor, "above") else values.numel()
    return selected / g.numel(), statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=("resnet18", "laplace", "normal"), default="resnet18")
    parser.add_argument("--size", type=integer_at_least(1), default=1 << 24, help="elements for laplace/normal")
    parser.add_argument("--repeats", type=integer_at_least(1), default=5)
    add_device_option(parser)
    args = parser.parse_args()
    g = gradient(args.source, args.size).to(args.device)
    print(f"{args.source} gradient: {g.numel():,} elements on {args.device}, median of {args.repeats} runs\n")
    print("| method | target density | achieved density | achieved / target | encode time (ms) |")
    print("|---|---|---|---|---|")
    for density in DENSITIES:
        for label, name, options in METHODS:
            achieved, seconds = measure(name, options, density, g, args.repeats)
            print(
                f"| {label} | {density:g} | {achieved:.5f} | {achieved / density:.2f} | {1000 * seconds:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
