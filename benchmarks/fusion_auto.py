"""``fusion=auto`` against fixed plans, measured side by side, with the timeline model's predictions.

On 2 CPU ranks over gloo (one thread each) it trains torchvision ResNet-18 (10 classes, standard
stem) on a fixed synthetic batch of 32x32 images, one model copy per fusion plan, all with the same
compressor and memory. After warm-up (``fusion=auto`` profiles and plans during it) the plans run
interleaved round by round (A B C ... A B C ...) so that machine noise hits all alike. Prints, per
plan: buckets, median measured step time, the time the auto plan's fitted cost model predicts for
that plan, and measured time relative to the best fixed plan; then what the auto run measured and
fitted while it planned, and the search time for ResNet-101's 314 tensors.

    python benchmarks/fusion_auto.py --compressor efsignsgd --memory residual --rounds 3 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from cli import integer_at_least
from torch import nn

from gc_strategy import COMPRESSORS, MEMORIES, GradientSynchronizer, build_components
from gc_strategy.fusion import CostModel, best_plan, simulate
from gc_strategy.tools.ranks import run_ranks

FIXED = ["layerwise", "groups:1", "groups:2", "groups:4", "groups:8", "groups:16", "bucket_mb:25"]


def train_steps(model, synchronizer, optimizer, batch, steps: int) -> list[float]:
    x, y = batch
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def rank_main(rank: int, world_size: int, args) -> dict | None:
    """Every plan trained side by side on this rank; on rank 0 the rows and the auto plan's report."""
    from torchvision.models import resnet18

    plans = ["auto", *FIXED]
    generator = torch.Generator().manual_seed(rank)
    batch = (
        torch.randn(args.batch_size, 3, 32, 32, generator=generator),
        torch.randint(0, 10, (args.batch_size,), generator=generator),
    )
    runs = {}
    for plan in plans:
        torch.manual_seed(0)
        model = resnet18(num_classes=10)
        c = build_components(args.compressor, args.memory, fusion=plan)
        synchronizer = GradientSynchronizer(model, c)
        runs[plan] = (model, synchronizer, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    auto_engine = runs["auto"][1]
    while auto_engine.tuner.phase != "done":  # settle, profile, trials, verify
        train_steps(*runs["auto"], batch, 1)
    for plan in plans:
        train_steps(*runs[plan], batch, 2)
        if rank == 0:
            print(f"warmed up {plan}", flush=True)
    times: dict[str, list[float]] = {plan: [] for plan in plans}
    for r in range(args.rounds):
        for plan in plans:
            times[plan] += train_steps(*runs[plan], batch, args.steps)
        if rank == 0:
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    if rank != 0:
        return None
    report = auto_engine.plan_report
    model = CostModel.from_dict(report["cost_model"])
    return {
        "report": report,
        "rows": {
            plan: (
                len(runs[plan][1].layout.tensors_per_bucket),
                statistics.median(times[plan]),
                simulate(model, runs[plan][1].layout.tensors_per_bucket),
            )
            for plan in plans
        },
    }


def resnet101_search_seconds(measured: CostModel) -> tuple[int, float]:
    """(tensors, seconds) of the exact search on ResNet-101's parameter sizes (314 tensors, in
    reverse registration order), with the cost curves measured here and ready times spread in
    proportion to the elements at the backward speed measured on ResNet-18."""
    from torchvision.models import resnet101

    numels = [p.numel() for p in reversed(list(resnet101().parameters()))]
    per_element = measured.ready[-1] / sum(measured.numels)
    ready, total = [], 0
    for n in numels:
        ready.append(total * per_element)
        total += n
    model = CostModel(tuple(ready), tuple(numels), measured.encode, measured.comm, measured.decode, measured.other)
    start = time.perf_counter()
    best_plan(model)
    return len(numels), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressor", default="efsignsgd", choices=COMPRESSORS.names())
    parser.add_argument("--memory", default="residual", choices=MEMORIES.names())
    parser.add_argument("--batch-size", type=integer_at_least(1), default=32)
    parser.add_argument("--rounds", type=integer_at_least(1), default=3)
    parser.add_argument("--steps", type=integer_at_least(1), default=5, help="measured steps per plan per round")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    out = run_ranks(rank_main, 2, args, timeout=3600)[0]
    rows, report = out["rows"], out["report"]
    best_fixed = min(measured for plan, (_, measured, _) in rows.items() if plan != "auto")
    print(
        f"\nResNet-18, 2 CPU ranks, compressor={args.compressor} memory={args.memory}, batch {args.batch_size}/rank, "
        f"{args.rounds} rounds x {args.steps} steps\n"
    )
    print(
        "| plan | buckets | measured step (s, median) | predicted (s) | predicted / measured | measured / best fixed |"
    )
    print("|---|---|---|---|---|---|")
    for plan, (buckets, measured, predicted) in rows.items():
        print(
            f"| {plan} | {buckets} | {measured:.3f} | {predicted:.3f} | {predicted / measured:.2f} "
            f"| {measured / best_fixed:.3f} |"
        )
    print(
        "\nInside the auto run, before the benchmark: the plans it tried and the fitted model's times "
        f"(compression costs x{report['compression_cost_scale']:.2f}, "
        f"communication x{report['communication_cost_scale']:.2f})\n"
    )
    print("| plan tried | buckets | measured step (s) | fitted model (s) |")
    print("|---|---|---|---|")
    for trial in report["trials"]:
        print(
            f"| {trial['plan']} | {len(trial['groups'])} | {trial['measured_step_s']:.3f} "
            f"| {trial['predicted_step_s']:.3f} |"
        )
    print(
        f"| searched plan | {len(report['searched_groups'])} | {report['searched_measured_step_s']:.3f} | "
        f"{simulate(CostModel.from_dict(report['cost_model']), report['searched_groups']):.3f} |"
    )
    print(
        f"\nauto kept the plan chosen by {report['chosen_by']}: "
        f"{report['buckets']} buckets of {report['bucket_mb']} MB; "
        f"profiling and fitting took {report['profile_s']:.1f} s, "
        f"the search {1000 * report['search_s']:.1f} ms; "
        f"predicted fp32 allreduce step: {report['predicted_fp32_allreduce_s']:.3f} s"
    )
    count, seconds = resnet101_search_seconds(CostModel.from_dict(report["cost_model"]))
    print(f"exact search over ResNet-101's {count} tensors with these costs: {1000 * seconds:.0f} ms")


if __name__ == "__main__":
    main()
