"""What fault tolerance costs, and what a failure costs: ``R`` replica groups (one process each, one
emulated node each) train ResNet-18 with and without ``fault_tolerance=``, then one group is killed
and started again.

Overhead: for each ``--compressors`` entry, each round runs ``plain`` (a ``GradientSynchronizer``
over a gloo group of the ``R`` processes, as ``gc_fused`` runs), ``plain, control`` (the same again:
its ratio to ``plain`` is the noise of the measurement) and ``ft`` (``FaultTolerantSynchronizer``
over torchft's quorum, the lighthouse on node 0), ``--steps`` steps each, in a new order each round;
the median step time of the steps after ``--warmup``, and the ratios to ``plain`` of the same round.
An entry ``diloco:C`` runs DiLoCo (``inner_steps`` = ``--inner-steps``, outer exchange through
``C``): ``DiLoCoSynchronizer`` against ``FaultTolerantDiLoCo``, its step time the median over the
inner phases of a phase's time (its outer step included) over ``inner_steps``.

Failure: ``R`` groups with fault tolerance and ``--failure-compressor``; group ``R-1`` kills itself
(SIGKILL) before its exchange at step ``--kill-at``, and is started again at once. Reported: the survivors' failed steps
(steps lost), the stall (the longest time between two committed steps of a survivor, less its
median step), the restarted group's start-up and the time from its first quorum request to its
first committed step (healing included), and whether every group ended bit-identical.

    python benchmarks/fault_tolerance.py --rate 1gbit --groups 3 --rounds 3 --steps 20 \\
        --compressors none topk+residual diloco:topk+residual
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import netns  # noqa: E402

LIGHTHOUSE_PORT = 29510
STORE_PORT = 29600


def worker(args: argparse.Namespace) -> None:
    """One replica group: train to committed step ``--steps`` (on, until every group takes part in
    a step) and write the timings to ``--out``."""
    import torch
    import torch.distributed as dist
    import torchvision

    from gc_strategy import DiLoCo, build_components
    from gc_strategy.sync.diloco import DiLoCoSynchronizer
    from gc_strategy.sync.every_step import GradientSynchronizer
    from gc_strategy.sync.fault_tolerant import FaultTolerantSynchronizer
    from gc_strategy.sync.fault_tolerant_diloco import FaultTolerantDiLoCo
    from gc_strategy.sync.quorum import FaultTolerance

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    diloco = DiLoCo(inner_steps=args.inner_steps) if args.compressor.startswith("diloco:") else None
    name, memory = (args.compressor.removeprefix("diloco:").split("+") + ["none"])[:2]
    roles = build_components(name, memory, density=0.01) if name == "topk" else build_components(name, memory)
    if args.mode == "plain":
        store = f"tcp://{args.store_host}:{STORE_PORT}"
        dist.init_process_group("gloo", init_method=store, rank=args.group, world_size=args.groups)
        sync = DiLoCoSynchronizer(model, roles, diloco) if diloco else GradientSynchronizer(model, roles)
    else:
        options = FaultTolerance(
            args.lighthouse, args.group, groups=args.groups, timeout_s=5, quorum_timeout_s=60, host=args.host
        )
        if diloco:
            sync = FaultTolerantDiLoCo(model, roles, diloco, options)
        else:
            sync = FaultTolerantSynchronizer(model, roles, options)
        sync.use_optimizers([optimizer])
    g = torch.Generator().manual_seed(args.group)
    x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    steps, first_request = [], None
    while True:
        begin = time.perf_counter()
        first_request = first_request or time.time()
        with sync.forward_pass():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        participants = getattr(sync, "participants", args.groups)
        if args.mode == "ft" and 0 <= args.die_at <= sync.committed_steps and participants == args.groups:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        committed = sync.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        sync.after_optimizer_step()  # DiLoCo's outer step every inner_steps
        end = time.perf_counter()
        steps.append({"s": end - begin, "end": time.time(), "committed": committed, "participants": participants})
        done = sync.committed_steps if args.mode == "ft" else len(steps)
        if committed and done >= args.steps and participants == args.groups:  # every group ends at one step
            break
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    result = {"steps": steps, "first_request": first_request, "digest": digest}
    Path(args.out).write_text(json.dumps(result))
    sync.close()
    if args.mode == "plain":
        dist.destroy_process_group()


def launch(node: netns.NodeNetwork, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    command = [*node.command, sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    return subprocess.Popen(command, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def run_groups(nodes, lighthouse, mode, compressor, steps, inner_steps, folder: Path, kill_at: int = -1) -> list[dict]:
    """One run of every group; with ``kill_at`` the last group dies there and is started again."""
    groups = len(nodes)

    def start(g: int, die_at: int) -> subprocess.Popen:
        args = ["--mode", mode, "--group", str(g), "--groups", str(groups), "--compressor", compressor]
        args += ["--inner-steps", str(inner_steps)]
        args += ["--steps", str(steps), "--lighthouse", lighthouse, "--host", nodes[g].address]
        args += ["--store-host", nodes[0].address, "--die-at", str(die_at), "--out", str(folder / f"{g}.json")]
        return launch(nodes[g], args, folder / f"{g}.log")

    processes = [start(g, kill_at if g == groups - 1 else -1) for g in range(groups)]
    restarted_at = None
    if kill_at >= 0:
        processes[-1].wait(timeout=600)
        restarted_at = time.time()
        processes[-1] = start(groups - 1, -1)
    for g, process in enumerate(processes):
        if process.wait(timeout=900) != 0:
            raise SystemExit(f"group {g} failed: {(folder / f'{g}.log').read_text()[-2000:]}")
    results = [json.loads((folder / f"{g}.json").read_text()) for g in range(groups)]
    if restarted_at is not None:
        results[-1]["restarted_at"] = restarted_at
    return results


@contextmanager
def lighthouse(node: netns.NodeNetwork, join_timeout_ms: int, folder: Path) -> Iterator[str]:
    """torchft's lighthouse on ``node`` (its address), alone on its port: a new one for each
    configuration."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    address = f"{node.address}:{LIGHTHOUSE_PORT}"
    command = [*node.command, str(binary), "--min_replicas", "1", "--join_timeout_ms", str(join_timeout_ms)]
    with (folder / "lighthouse.log").open("ab") as log:
        server = subprocess.Popen([*command, "--bind", address], stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.0)
        yield f"http://{address}"
    finally:
        server.kill()
        server.wait()


def median_step(results: list[dict], warmup: int, period: int = 1) -> float:
    """The median over the groups of each one's median step time after ``warmup`` steps, over the
    committed steps every group took part in (a group alone, before the others joined, is not
    held against plain synchronisation); for DiLoCo (``period`` inner steps between outer steps) of
    the median over its whole inner phases of a phase's time over ``period`` (a group that joined
    late, with no whole phase after the warm-up, left out)."""
    groups = len(results)

    def together(step: dict) -> bool:
        return step["committed"] and step["participants"] == groups

    if period == 1:
        return statistics.median(
            statistics.median(s["s"] for s in result["steps"][warmup:] if together(s)) for result in results
        )
    start = -(-warmup // period) * period
    medians = []
    for result in results:
        steps = result["steps"]
        phases = [
            sum(s["s"] for s in steps[i : i + period]) / period
            for i in range(start, len(steps) - period + 1, period)
            if all(together(s) for s in steps[i : i + period])
        ]
        medians += [statistics.median(phases)] if phases else []
    return statistics.median(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["plain", "ft"], default="ft", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--store-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--die-at", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compressor", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default=None, help="shape every group's link to this rate (tc tbf), e.g. 1gbit")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--compressors", nargs="+", default=["none", "topk+residual", "diloco:topk+residual"])
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--failure-compressor", default="topk+residual")
    parser.add_argument("--join-timeout-ms", type=int, default=2000, help="the lighthouse's, every step")
    parser.add_argument(
        "--diloco-join-timeout-ms", type=int, default=10000, help="the lighthouse's for DiLoCo: above an inner phase"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with ExitStack() as stack:
        nodes = stack.enter_context(
            netns.emulated_network(args.groups, args.rate) if args.rate else netns.loopback(args.groups)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gc_ft_bench")))
        rows = {}
        for compressor in args.compressors:
            join_ms = args.diloco_join_timeout_ms if compressor.startswith("diloco:") else args.join_timeout_ms
            times = {"plain": [], "plain, control": [], "ft": []}
            with lighthouse(nodes[0], join_ms, folder) as url:
                for r in range(args.rounds):
                    order = list(times)
                    random.Random(r).shuffle(order)
                    for mode in order:
                        plain_or_ft = mode.split(",")[0]
                        results = run_groups(nodes, url, plain_or_ft, compressor, args.steps, args.inner_steps, folder)
                        period = args.inner_steps if compressor.startswith("diloco:") else 1
                        times[mode].append(median_step(results, args.warmup, period))
                        line = f"{compressor} round {r} {mode}: {times[mode][-1]:.3f} s/step"
                        print(line, file=sys.stderr, flush=True)
            ratios = [f / p for f, p in zip(times["ft"], times["plain"])]
            control = [c / p for c, p in zip(times["plain, control"], times["plain"])]
            rows[compressor] = (statistics.median(times["plain"]), statistics.median(times["ft"]), ratios, control)
        kill_at, failing = args.kill_at, args.failure_compressor
        with lighthouse(nodes[0], args.join_timeout_ms, folder) as url:
            failure = run_groups(nodes, url, "ft", failing, args.steps * 2, args.inner_steps, folder, kill_at=kill_at)
    where = f"{args.groups} groups, {'links shaped to ' + args.rate if args.rate else 'loopback'}"
    print(f"\nResNet-18, 32x32, batch 32 per group, 1 thread per group; {where}")
    print(f"{args.rounds} rounds x {args.steps} steps per configuration, the modes in a new order each round")
    print(
        "\n| compressor | plain median step (s) | fault-tolerant (s) | ft / plain (median, range) | control / plain |"
    )
    print("|---|---|---|---|---|")
    for compressor, (plain, ft, ratios, control) in rows.items():
        print(
            f"| {compressor} | {plain:.3f} | {ft:.3f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f} to {max(ratios):.3f}) | {statistics.median(control):.3f} "
            f"({min(control):.3f} to {max(control):.3f}) |"
        )
    survivors, restarted = failure[:-1], failure[-1]
    killed = f"group {args.groups - 1} killed before its exchange at step {args.kill_at}"
    print(f"\nFailure ({args.failure_compressor}): {killed}")
    for g, res in enumerate(survivors):
        committed = [s for s in res["steps"] if s["committed"]]
        gaps = [b["end"] - a["end"] for a, b in zip(committed, committed[1:])]
        median = statistics.median(s["s"] for s in committed)
        lost = sum(not s["committed"] for s in res["steps"])
        print(f"- group {g}: {lost} step(s) not committed; stall {max(gaps) - median:.2f} s (longest gap between")
        print(f"  committed steps {max(gaps):.2f} s, median step {median:.3f} s)")
    first = next(s for s in restarted["steps"] if s["committed"])
    startup = restarted["first_request"] - restarted["restarted_at"]
    print(f"- group {args.groups - 1} restarted: {startup:.2f} s from its start to its first quorum request")
    print(f"  (imports, model), then {first['end'] - restarted['first_request']:.2f} s to its first committed step")
    print("  (the quorum, healing from a live peer, the step)")
    digests = {res["digest"] for res in failure}
    print(f"- parameters equal on every group at the end: {len(digests) == 1}")


if __name__ == "__main__":
    main()
