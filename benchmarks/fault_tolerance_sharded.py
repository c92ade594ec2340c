"""What fault tolerance costs replica groups that shard their model: ``R`` groups of ``S`` ranks (one
emulated node per group, its ranks on it; the lighthouse on node 0) train ResNet-18 sharded by FSDP2
over each group's ranks, with and without ``fault_tolerance=``.

Three modes, each a launch of every rank: ``plain`` (one world of the ``R × S`` ranks on an
``(R, S)`` mesh: ``ShardedSynchronizer``, compressed HSDP as ``gc_fsdp`` runs it; for an entry
``diloco:C``, ``ShardedDiLoCo``), ``plain, control`` (the same again: its ratio to ``plain`` is the
noise of the measurement) and ``ft`` (each group a world of its own on a ``(1, S)`` mesh:
``FaultTolerantShardedSynchronizer`` or ``FaultTolerantDiLoCo``, the exchange across groups shard by
shard over torchft's quorum). A process holds one world only, so the modes cannot share one as the
replicated benchmark's do (``fault_tolerance.py``): each run launches the three one after the other,
in an order drawn anew for each run, so that whatever else the machine does falls on all three
alike. A block is a step, or DiLoCo's inner phase (``--inner-steps``) with its outer step. Reported
per run: the median over the groups of each one's median time per step of its ``--steps`` blocks
after ``--warmup`` (``ft``: of the blocks whose steps all committed with every group), the ratios
to ``plain``, and over the runs their median and range. Needs root (network namespaces) with
``--rate``.

    python benchmarks/fault_tolerance_sharded.py --rate 1gbit --rounds 5 --steps 20 \\
        --compressors none topk+residual diloco:topk+residual
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import netns  # noqa: E402
from cli import integer_at_least  # noqa: E402
from fault_tolerance import MODES, batch_of, configuration, lighthouse, roles_of, shard, train_step  # noqa: E402

STORE_PORT = 29700


def worker(args: argparse.Namespace) -> None:
    """One rank of a group in ``--mode``: ``--warmup`` blocks with every group, then ``--steps``
    blocks, each block's time per step (and whether all its steps committed with every group)
    written to ``--out`` by the group's rank 0. A group that starts first trains alone until the
    others join (``ft``): those blocks are not counted, and since every group sees the same quorum,
    all of them begin to measure at the same block and end together."""
    import torch
    import torch.distributed as dist
    import torchvision

    from gc_strategy import DiLoCo, FaultTolerance, FaultTolerantDiLoCo
    from gc_strategy.sync.fault_tolerance.sharded import FaultTolerantShardedSynchronizer
    from gc_strategy.sync.sharded.diloco import ShardedDiLoCo
    from gc_strategy.sync.sharded.synchronizer import ShardedSynchronizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ft = int(os.environ["LOCAL_RANK"]), args.mode == "ft"
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    mesh = shard(model, (1 if ft else args.groups, args.ranks))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    diloco = DiLoCo(inner_steps=args.inner_steps) if args.compressor.startswith("diloco:") else None
    roles = roles_of(args.compressor)
    if ft:
        options = FaultTolerance(args.lighthouse, args.group, groups=args.groups, quorum_timeout_s=60, host=args.host)
        if diloco:
            sync = FaultTolerantDiLoCo(model, roles, diloco, options, mesh=mesh)
        else:
            sync = FaultTolerantShardedSynchronizer(model, roles, options, mesh)
        sync.use_optimizers([optimizer])
    else:
        sync = ShardedDiLoCo(model, roles, diloco, mesh) if diloco else ShardedSynchronizer(model, roles, mesh)
    batch, period = batch_of(args.group * args.ranks + rank), args.inner_steps if diloco else 1
    blocks, warm = [], 0
    while len(blocks) < args.steps:
        together, begin = True, time.perf_counter()
        for _ in range(period):
            committed = train_step(model, optimizer, sync, batch)
            together &= committed and getattr(sync, "participants", args.groups) == args.groups
        if warm >= args.warmup:
            blocks.append({"s": (time.perf_counter() - begin) / period, "together": together})
        warm += together
    if rank == 0:
        Path(args.out).write_text(json.dumps(blocks))
    sync.close()
    dist.destroy_process_group()


def run_mode(nodes: list, url: str, args: argparse.Namespace, compressor: str, mode: str, port: int, folder: Path):
    """Every rank of every group in ``mode`` (a world of all ranks, or one per group with ``ft``),
    the worlds' stores from ``port`` on; each group's blocks."""
    processes, ft = [], mode == "ft"
    for g, node in enumerate(nodes):
        for r in range(args.ranks):
            world = {
                "RANK": str(r if ft else g * args.ranks + r),
                "WORLD_SIZE": str(args.ranks if ft else len(nodes) * args.ranks),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(args.ranks),
                "MASTER_ADDR": node.address if ft else nodes[0].address,
                "MASTER_PORT": str(port + g if ft else port),
            }
            env = {**os.environ, **world, "GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1"}
            options = ["--worker", "--mode", mode, "--group", str(g), "--groups", str(len(nodes))]
            options += ["--ranks", str(args.ranks), "--compressor", compressor, "--inner-steps", str(args.inner_steps)]
            options += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--lighthouse", url]
            options += ["--host", node.address, "--out", str(folder / f"{g}.json")]
            command = [*node.command, sys.executable, str(Path(__file__).resolve()), *options]
            with (folder / f"{g}.{r}.log").open("ab") as log:
                processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
    try:
        for n, process in enumerate(processes):
            if process.wait(timeout=1800) != 0:
                log = folder / f"{n // args.ranks}.{n % args.ranks}.log"
                raise SystemExit(
                    f"{mode}: group {n // args.ranks} rank {n % args.ranks} failed: {log.read_text()[-2000:]}"
                )
    finally:
        for process in processes:
            process.kill()
    return [json.loads((folder / f"{g}.json").read_text()) for g in range(len(nodes))]


def median_step(groups: list[list[dict]]) -> float:
    """The median over the groups of each one's median time per step (``ft``: over the blocks
    whose steps all committed with every group)."""
    if not all(any(b["together"] for b in blocks) for blocks in groups):
        raise SystemExit("no measured block committed all its steps with every group: nothing to report")
    return statistics.median(statistics.median(b["s"] for b in blocks if b["together"]) for blocks in groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compressor", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default=None, help="shape every group's link to this rate (tc tbf), e.g. 1gbit")
    parser.add_argument("--groups", type=integer_at_least(2), default=2)
    parser.add_argument("--ranks", type=integer_at_least(2), default=2, help="per group: FSDP2 over them")
    parser.add_argument("--rounds", type=integer_at_least(1), default=3, help="runs of the three modes per entry")
    parser.add_argument("--steps", type=integer_at_least(1), default=20, help="measured blocks per mode and run")
    parser.add_argument(
        "--warmup", type=integer_at_least(1), default=3, help="blocks per mode with every group, not measured"
    )
    parser.add_argument("--compressors", type=configuration, nargs="+", default=["none", "topk+residual"])
    parser.add_argument("--inner-steps", type=integer_at_least(1), default=5)
    parser.add_argument("--join-timeout-ms", type=integer_at_least(1), default=2000, help="the lighthouse's")
    parser.add_argument(
        "--diloco-join-timeout-ms", type=integer_at_least(1), default=10000, help="the lighthouse's for DiLoCo"
    )
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rows, port = {}, STORE_PORT
    with ExitStack() as stack:
        nodes = stack.enter_context(
            netns.emulated_network(args.groups, args.rate) if args.rate else netns.loopback(args.groups)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gc_ft_sharded")))
        for compressor in args.compressors:
            join_ms = args.diloco_join_timeout_ms if compressor.startswith("diloco:") else args.join_timeout_ms
            runs = []
            with lighthouse(nodes[0], join_ms, folder) as url:
                for r in range(args.rounds):
                    medians = {}
                    for mode in random.Random(r).sample(MODES, len(MODES)):
                        medians[mode] = median_step(run_mode(nodes, url, args, compressor, mode, port, folder))
                        port += args.groups
                    runs.append(medians)
                    figures = ", ".join(f"{mode} {t:.3f}" for mode, t in medians.items())
                    print(f"{compressor} run {r}: s/step {figures}", file=sys.stderr, flush=True)
            rows[compressor] = runs
    report(args, rows)


def report(args: argparse.Namespace, rows: dict[str, list[dict]]) -> None:
    where = f"links shaped to {args.rate}" if args.rate else "loopback"
    print(f"\nResNet-18, 32x32, batch 32 per rank; {args.groups} groups of {args.ranks} ranks (FSDP2), {where}")
    print(f"{args.rounds} runs x {args.steps} blocks per mode, the modes launched in an order drawn for each run")
    print("\n| compressor | plain (s/step) | ft (s/step) | ft / plain (median, range) | control / plain |")
    print("|---|---|---|---|---|")
    for compressor, runs in rows.items():
        ratios = [m["ft"] / m["plain"] for m in runs]
        control = [m["plain, control"] / m["plain"] for m in runs]
        plain, ft = (statistics.median(m[mode] for m in runs) for mode in ("plain", "ft"))
        print(
            f"| {compressor} | {plain:.3f} | {ft:.3f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f} to {max(ratios):.3f}) | {statistics.median(control):.3f} "
            f"({min(control):.3f} to {max(control):.3f}) |"
        )
        each = ", ".join(f"{f:.3f} / {c:.3f}" for f, c in zip(ratios, control))
        print(f"  per run (ft / plain, control / plain): {each}")


if __name__ == "__main__":
    main()
