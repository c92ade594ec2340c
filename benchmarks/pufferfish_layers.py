"""Pufferfish low-rank models: parameter counts, and the training-step time of the low-rank vs the
vanilla model on this machine (forward + backward + SGD step, one process, interleaved rounds,
medians). Run: ``python benchmarks/pufferfish_layers.py [--ratio 0.25] [--rounds 5] [--steps 10]``."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli import integer_at_least  # noqa: E402

from gc_strategy.pufferfish import factorize  # noqa: E402
from recipes.bert import BertMaskedLM  # noqa: E402
from recipes.lstm import LSTMLanguageModel  # noqa: E402
from recipes.resnet import build_resnet  # noqa: E402


def parameter_counts(ratio: float) -> list[tuple[str, int, int, int]]:
    """(model, vanilla, low-rank, factorised layers) for the recipe models at their paper sizes."""
    models = {
        "ResNet-18 (CIFAR stem, 10 classes)": lambda: build_resnet("resnet18", 10, cifar_stem=True),
        "ResNet-18 (ImageNet stem, 10 classes)": lambda: build_resnet("resnet18", 10, cifar_stem=False),
        "ResNet-50 (ImageNet, 1000 classes)": lambda: build_resnet("resnet50", 1000, cifar_stem=False),
        "LSTM LM (WikiText-2 vocab 33,278, 2x1500, tied)": lambda: LSTMLanguageModel(33278, 1500, 1500, 2, tied=True),
        "BERT-base masked LM (vocab 30,522)": lambda: BertMaskedLM(30522, 512, size="base"),
    }
    rows = []
    for name, build in models.items():
        report = factorize(build(), ratio)
        rows.append((name, report.params_before, report.params_after, len(report.ranks)))
    return rows


def step_times(ratio: float, cifar_stem: bool, batch: int, rounds: int, steps: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    vanilla = build_resnet("resnet18", 10, cifar_stem)
    low_rank = build_resnet("resnet18", 10, cifar_stem)
    factorize(low_rank, ratio)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    models = {"vanilla": vanilla, "low-rank": low_rank}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}

    def step(name: str) -> None:
        optimizers[name].zero_grad(set_to_none=True)
        nn.functional.cross_entropy(models[name](x), y).backward()
        optimizers[name].step()

    for name in models:  # warm-up
        step(name)
    for _ in range(rounds):
        for name in models:
            for _ in range(steps):
                start = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--rounds", type=integer_at_least(1), default=5)
    parser.add_argument("--steps", type=integer_at_least(1), default=10)
    parser.add_argument("--batch", type=integer_at_least(1), default=32)
    parser.add_argument("--threads", type=integer_at_least(1), default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"| model | vanilla params | low-rank params (ratio {args.ratio:g}) | share | factorised layers |")
    print("|---|---|---|---|---|")
    for name, before, after, layers in parameter_counts(args.ratio):
        print(f"| {name} | {before:,} | {after:,} | {after / before:.1%} | {layers} |")

    print(
        f"\nResNet-18 training step, batch {args.batch} of 32x32, {args.threads} thread(s), "
        f"median of {args.rounds}x{args.steps} steps (interleaved rounds)\n"
    )
    print("| stem | vanilla s/step | low-rank s/step | low-rank / vanilla |")
    print("|---|---|---|---|")
    for cifar_stem in (True, False):
        times = step_times(args.ratio, cifar_stem, args.batch, args.rounds, args.steps)
        vanilla, low = statistics.median(times["vanilla"]), statistics.median(times["low-rank"])
        print(
            f"| {'CIFAR 3x3' if cifar_stem else 'ImageNet 7x7/2'} | {vanilla:.4f} | {low:.4f} | {low / vanilla:.2f} |"
        )


if __name__ == "__main__":
    main()
