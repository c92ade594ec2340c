"""Time to accuracy on an emulated network: ``ddp``, per-step compression and DiLoCo, interleaved.

    python benchmarks/time_to_accuracy.py --rate 1gbit --target 0.95 --epochs 20 \
        --configs ddp gc_fused:compressor=topk,density=0.01,memory=residual \
                  gc_fused:sync=diloco,inner_steps=10,vectors=fp32

Each configuration trains the same task from the same seed in fresh processes, one per rank and
each rank its own emulated node (a network namespace whose link is shaped with ``tc tbf``,
``benchmarks/netns.py``; root only), round by round (A B C ... A B C ...). The task is an MLP
(64 → hidden → hidden → 10, 4.3 M parameters at hidden 2048) on scikit-learn's handwritten digits
(the last 360 of 1,797 images held out): real data, and a gradient of 17 MB against a few
milliseconds of compute per step, so that fp32 ``ddp`` at 1 Gbit/s spends most of each step
communicating. Rank 0 measures the held-out accuracy every ``--eval-every`` steps
(``benchmarks/time_to_accuracy_worker.py``). The report, in ``--out``: ``results.md`` (also
printed; per configuration the median over rounds of the training seconds to reach ``--target``, the
final accuracy and the bytes that left the nodes) and ``accuracy.png`` (accuracy against training
time, the first round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench import ROOT
from bench_worker import BASELINES, parse_config
from cli import integer_at_least
from curves import Runs, plot_curves, run_configuration, write_report
from netns import check_can_emulate, emulated_network, loopback

from gc_strategy import GCFusedStrategy

WORLD_SIZE = 2


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", required=True, help="ddp, or gc_fused:key=value,...")
    parser.add_argument("--rate", default="1gbit", help="each node's link rate (tc tbf), or 'none' for loopback")
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy to reach, in (0, 1]")
    parser.add_argument("--epochs", type=integer_at_least(1), default=20)
    parser.add_argument("--eval-every", type=integer_at_least(1), default=10, help="optimizer steps")
    parser.add_argument("--rounds", type=integer_at_least(1), default=1)
    parser.add_argument("--hidden", type=integer_at_least(1), default=2048)
    parser.add_argument("--batch-size", type=integer_at_least(1), default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="the inner (or only) SGD's learning rate")
    parser.add_argument("--timeout", type=integer_at_least(1), default=1200, help="seconds per configuration")
    parser.add_argument("--out", default=None, help="output folder (default: outputs/time_to_accuracy-<time>)")
    args = parser.parse_args(argv)
    if not 0 < args.target <= 1:
        parser.error(f"--target {args.target} is invalid; allowed: a number in (0, 1]")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr} is invalid; allowed: a number > 0")
    if len(set(args.configs)) != len(args.configs):
        parser.error(f"--configs {args.configs} repeats a configuration")
    for name in args.configs:
        if name not in ("ddp",) and name in BASELINES:
            parser.error(f"--configs: {name!r} is invalid; allowed: ddp, or gc_fused[:key=value,...]")
        try:
            options = parse_config(name)
            if name != "ddp":
                GCFusedStrategy(**options)  # names, options and values checked here
        except ValueError as error:
            parser.error(f"--configs: {error}")
    if args.rate != "none":
        check_can_emulate(args.rate)
    return args


def run(args: argparse.Namespace, out: Path) -> Runs:
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    settings = out / "settings.json"
    keys = ("epochs", "eval_every", "hidden", "batch_size", "lr")
    settings.write_text(
        json.dumps({**{k: getattr(args, k) for k in keys}, "seed": 0, "threads_per_rank": 1, "world_size": WORLD_SIZE})
    )
    runs: Runs = {name: [] for name in args.configs}
    network = emulated_network(WORLD_SIZE, args.rate) if args.rate != "none" else loopback(WORLD_SIZE)
    port = 29900 + os.getpid() % 90
    worker = str(ROOT / "benchmarks" / "time_to_accuracy_worker.py")
    with network as links:
        for round_index in range(args.rounds):
            for index, name in enumerate(args.configs):
                port += 1
                started = time.monotonic()
                per_rank, why = run_configuration(
                    [worker, str(settings), name], out, f"r{round_index}-c{index}", links, 1, port, args.timeout
                )
                if why is None:
                    result = {**per_rank[0], "sent_bytes": sum(r["sent_bytes"] for r in per_rank)}
                    state = f"final accuracy {result['points'][-1]['accuracy']:.3f}"
                else:
                    result, state = {"failed": why}, f"failed: {why}"
                print(f"[round {round_index + 1}/{args.rounds}] {name}: {state} ({time.monotonic() - started:.0f} s)")
                runs[name].append(result)
    return runs


def time_to_target(points: list[dict[str, float]], target: float) -> float | None:
    """Training seconds at the first measurement at or above ``target`` (None: never reached)."""
    return next((p["train_s"] for p in points if p["accuracy"] >= target), None)


def report(args: argparse.Namespace, runs: Runs) -> str:
    reference = [time_to_target(r["points"], args.target) for r in runs.get("ddp", []) if "failed" not in r]
    ddp_time = statistics.median(reference) if reference and None not in reference else None
    lines = [
        f"| configuration | time to {args.target:.0%} (s) | vs ddp | final accuracy | training time (s) "
        "| bytes across nodes | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, results in runs.items():
        done = [r for r in results if "failed" not in r]
        if not done:
            lines.append(f"| {name} | failed: {results[0]['failed'][:120]} | | | | | |")
            continue
        times = [time_to_target(r["points"], args.target) for r in done]
        reached = None if None in times else statistics.median(times)
        ratio = f"{reached / ddp_time:.2f}×" if reached is not None and ddp_time else "–"
        final = statistics.median(r["points"][-1]["accuracy"] for r in done)
        total = statistics.median(r["points"][-1]["train_s"] for r in done)
        sent = statistics.median(r["sent_bytes"] for r in done)
        shown = "not reached" if reached is None else f"{reached:.1f}"
        lines.append(f"| {name} | {shown} | {ratio} | {final:.1%} | {total:.1f} | {sent:,.0f} | {done[0]['steps']} |")
    return "\n".join(lines)


def plot(args: argparse.Namespace, runs: Runs, path: Path) -> None:
    def decorate(axis) -> None:
        axis.axhline(args.target, color="black", linewidth=0.8, linestyle=":", label=f"target {args.target:.0%}")
        axis.set_ylim(max(0.0, args.target - 0.3), 1.0)

    title = f"time to accuracy, 2 ranks, {args.rate} links (first round)"
    plot_curves(runs, path, "accuracy", "held-out accuracy (digits)", title, decorate)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    out = Path(args.out or ROOT / "outputs" / f"time_to_accuracy-{time.strftime('%Y%m%d-%H%M%S')}")
    runs = run(args, out)
    write_report(out, runs, report(args, runs), lambda path: plot(args, runs, path), "accuracy.png")


if __name__ == "__main__":
    main()
