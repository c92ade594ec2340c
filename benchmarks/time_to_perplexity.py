"""Time to perplexity of a decoder language model on an emulated network, every way of synchronising
side by side.

    python benchmarks/time_to_perplexity.py --rate 1gbit --nodes 2 --per-node 2 --steps 300

Each configuration (``benchmarks/time_to_perplexity_worker.py``'s ``CONFIGURATIONS``: ``ddp``,
DDP with torch's ``powerSGD_hook``, ``topk`` + residual, ``powersgd``, compressed HSDP, DiLoCo,
DiLoCo with SparseLoCo's outer step, the SparseLoCo preset, Streaming DiLoCo) trains ``model=gpt``
on ``data=text``'s default corpus from the same seed, in fresh processes: ``--nodes`` emulated
nodes (network namespaces whose links are shaped with ``tc tbf``, ``benchmarks/netns.py``; root
only) of ``--per-node`` CPU ranks, one thread each. Within a round the configurations run one after
the other, ``ddp`` first and again last (the control: how much the machine drifted within the
round). ``ddp`` trains a fixed budget of ``--steps`` optimizer steps; its final validation loss in
the first round is the *target*. Every other configuration trains at least as many steps (its loss
at equal tokens), then on, up to ``--max-factor`` times as many, until a validation reaches the
target.

The report, in ``--out``: ``results.md`` (also printed; per configuration the median over rounds of
the training seconds to the target, validations left out; the validation loss at ``--steps``, i.e.
at equal tokens; the bytes that left the nodes per step) and ``loss.png`` (validation loss against
training time, the first round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench import ROOT
from cli import integer_at_least
from curves import Runs, plot_curves, run_configuration, write_report
from netns import check_can_emulate, emulated_network, loopback
from time_to_perplexity_worker import CONFIGURATIONS, INNER_STEPS

REFERENCE, CONTROL = "ddp", "ddp (control)"
SETTINGS = ("steps", "max_factor", "eval_every", "width", "layers", "heads", "context", "batch_size", "lr")


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = [name for name in CONFIGURATIONS if name != REFERENCE]
    parser.add_argument("--configs", nargs="+", default=names, help=f"beside ddp: some of {', '.join(names)}")
    parser.add_argument("--rate", default="1gbit", help="each node's link rate (tc tbf), or 'none' for loopback")
    parser.add_argument("--nodes", type=integer_at_least(2), default=2)
    parser.add_argument("--per-node", type=integer_at_least(1), default=2, help="CPU ranks per node")
    parser.add_argument("--steps", type=integer_at_least(1), default=300, help="ddp's budget, optimizer steps")
    parser.add_argument("--max-factor", type=float, default=2.0, help="the others' budget, in ddp's steps")
    parser.add_argument("--eval-every", type=integer_at_least(1), default=20, help="optimizer steps")
    parser.add_argument("--val-tokens", type=integer_at_least(1), default=65536)
    parser.add_argument("--rounds", type=integer_at_least(1), default=1)
    parser.add_argument("--width", type=integer_at_least(1), default=512)
    parser.add_argument("--layers", type=integer_at_least(1), default=2)
    parser.add_argument("--heads", type=integer_at_least(1), default=4)
    parser.add_argument("--context", type=integer_at_least(2), default=128)
    parser.add_argument("--batch-size", type=integer_at_least(1), default=4, help="sequences per rank")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's (DiLoCo: the inner one's)")
    parser.add_argument("--timeout", type=integer_at_least(1), default=1800, help="seconds per configuration")
    parser.add_argument("--out", default=None, help="output folder (default: outputs/time_to_perplexity-<time>)")
    args = parser.parse_args(argv)
    for name in args.configs:
        if name not in names:
            parser.error(f"--configs: {name!r} is invalid; allowed: {', '.join(names)}")
    if len(set(args.configs)) != len(args.configs):
        parser.error(f"--configs {args.configs} repeats a configuration")
    if not args.max_factor >= 1:
        parser.error(f"--max-factor {args.max_factor} is invalid; allowed: a number >= 1")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr} is invalid; allowed: a number > 0")
    if args.width % args.heads:
        parser.error(f"--width {args.width} is invalid with --heads {args.heads}; allowed: a multiple of it")
    if args.eval_every % INNER_STEPS:
        parser.error(f"--eval-every {args.eval_every} is invalid; allowed: a multiple of DiLoCo's {INNER_STEPS}")
    if args.steps % args.eval_every:
        parser.error(f"--steps {args.steps} is invalid; allowed: a multiple of --eval-every ({args.eval_every})")
    if args.rate != "none":
        check_can_emulate(args.rate)
    return args


def run(args: argparse.Namespace, out: Path) -> Runs:
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    settings = out / "settings.json"
    chosen = {key: getattr(args, key) for key in (*SETTINGS, "val_tokens", "nodes", "per_node")}
    settings.write_text(json.dumps({**chosen, "seed": 0, "threads_per_rank": 1}))
    order = [REFERENCE, *args.configs, CONTROL]
    runs: Runs = {name: [] for name in order}
    network = emulated_network(args.nodes, args.rate) if args.rate != "none" else loopback(args.nodes)
    port = 29800 + os.getpid() % 90
    worker = str(ROOT / "benchmarks" / "time_to_perplexity_worker.py")
    target = "none"
    with network as links:
        for round_index in range(args.rounds):
            for index, name in enumerate(order):
                port += 1
                started = time.monotonic()
                configuration = REFERENCE if name == CONTROL else name
                goal = "none" if configuration == REFERENCE else target
                arguments = [worker, str(settings), configuration, goal]
                tag = f"r{round_index}-c{index}"
                per_rank, why = run_configuration(arguments, out, tag, links, args.per_node, port, args.timeout)
                if why is None:
                    counted = [r["sent_bytes"] for r in per_rank if r["local_rank"] == 0]  # one rank a node
                    result = {**per_rank[0], "sent_bytes": sum(counted)}
                    if name == REFERENCE and target == "none":
                        target = f"{result['points'][-1]['val_loss']:.6f}"
                    state = f"{result['steps']} steps, validation loss {result['points'][-1]['val_loss']:.4f}"
                else:
                    result, state = {"failed": why}, f"failed: {why}"
                elapsed = time.monotonic() - started
                print(f"[round {round_index + 1}/{args.rounds}] {name}: {state} ({elapsed:.0f} s)", flush=True)
                runs[name].append(result)
    return runs


def time_to_target(points: list[dict[str, float]], target: float) -> float | None:
    """Training seconds at the first validation at or below ``target`` (None: never reached)."""
    return next((p["train_s"] for p in points if p["val_loss"] <= target), None)


def loss_at(points: list[dict[str, float]], step: int) -> float:
    """The validation loss at ``step``."""
    return next(p["val_loss"] for p in points if p["step"] == step)


def target_of(runs: Runs, steps: int) -> float | None:
    """The loss to reach: ddp's at its budget, in the first round (None where it failed)."""
    first = runs[REFERENCE][0]
    return None if "failed" in first else loss_at(first["points"], steps)


def report(args: argparse.Namespace, runs: Runs) -> str:
    target = target_of(runs, args.steps)
    reference = [time_to_target(r["points"], target) for r in runs[REFERENCE] if "failed" not in r and target]
    ddp_time = statistics.median(reference) if reference and None not in reference else None
    losses = [loss_at(r["points"], args.steps) for r in runs[REFERENCE] if "failed" not in r]
    ddp_loss = statistics.median(losses) if losses else None
    shown_target = "–" if target is None else f"{target:.4f}"
    lines = [
        f"| configuration | time to loss {shown_target} (s) | vs ddp | loss at {args.steps} steps | vs ddp's "
        "| steps run | training time (s) | bytes across nodes / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, results in runs.items():
        done = [r for r in results if "failed" not in r]
        if not done:
            lines.append(f"| {name} | failed: {results[0]['failed'][:120]} | | | | | | |")
            continue
        times = [time_to_target(r["points"], target) for r in done] if target is not None else [None]
        reached = None if None in times else statistics.median(times)
        ratio = f"{reached / ddp_time:.2f}×" if reached is not None and ddp_time else "–"
        loss = statistics.median(loss_at(r["points"], args.steps) for r in done)
        total = statistics.median(r["points"][-1]["train_s"] for r in done)
        steps = statistics.median(r["steps"] for r in done)
        per_step = statistics.median(r["sent_bytes"] / r["steps"] for r in done)
        shown = "not reached" if reached is None else f"{reached:.1f}"
        against = f"{loss / ddp_loss - 1:+.1%}" if ddp_loss else "–"
        lines.append(
            f"| {name} | {shown} | {ratio} | {loss:.4f} | {against} | {steps:.0f} | {total:.1f} | {per_step:,.0f} |"
        )
    return "\n".join(lines)


def plot(args: argparse.Namespace, runs: Runs, path: Path) -> None:
    target = target_of(runs, args.steps)

    def decorate(axis) -> None:
        if target is not None:
            label = f"target: ddp at {args.steps} steps"
            axis.axhline(target, color="black", linewidth=0.8, linestyle=":", label=label)

    title = (
        f"GPT ({args.width}×{args.layers}) on the standard library's source, {args.nodes} nodes × {args.per_node} "
        f"CPU ranks, {args.rate} links (first round)"
    )
    plot_curves(runs, path, "val_loss", "validation loss (nats per byte)", title, decorate)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    out = Path(args.out or ROOT / "outputs" / f"time_to_perplexity-{time.strftime('%Y%m%d-%H%M%S')}")
    runs = run(args, out)
    write_report(out, runs, report(args, runs), lambda path: plot(args, runs, path), "loss.png")


if __name__ == "__main__":
    main()
