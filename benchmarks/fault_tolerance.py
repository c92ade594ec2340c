"""What fault tolerance costs, and what a failure costs: ``R`` replica groups (one process each, one
emulated node each) train ResNet-18 with and without ``fault_tolerance=``, then one group is killed
and started again.

Overhead: for each ``--compressors`` entry, each run starts the ``R`` groups, each holding three
models started alike: ``plain`` (a ``GradientSynchronizer`` over a gloo group of the ``R``
processes, as ``gc_fused`` runs), ``plain, control`` (the same again: its ratio to ``plain`` is the
noise of the measurement) and ``ft`` (``FaultTolerantSynchronizer`` over torchft's quorum, the
lighthouse on node 0). Block by block every mode trains a block, the modes in an order drawn anew
for each block (the same on every group), so that whatever else the machine does falls on all three
alike. A block is a step, or for an entry ``diloco:C`` an inner phase of DiLoCo (``inner_steps`` =
``--inner-steps``, outer exchange through ``C``; ``DiLoCoSynchronizer`` against
``FaultTolerantDiLoCo``) with its outer step. Reported per run: the median over the groups of each
one's median time per step of a block after ``--warmup`` blocks (``ft``: of the blocks whose steps
all committed with every group), the ratios to ``plain``, and ``ft``'s median quorum request and
commit vote.

Failure: ``R`` groups with fault tolerance and ``--failure-compressor``; group ``R-1`` kills itself
(SIGKILL) before its exchange at step ``--kill-at``, and is started again at once. Reported: the
survivors' failed steps (steps lost), the stall (the longest time between two committed steps of a
survivor, less its median step), the restarted group's start-up and the time from its first quorum
request to its first committed step (healing included), and whether every group ended bit-identical.

    python benchmarks/fault_tolerance.py --rate 1gbit --groups 3 --rounds 5 --steps 30 \\
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
from cli import integer_at_least  # noqa: E402

LIGHTHOUSE_PORT = 29510
STORE_PORT = 29600


MODES = ("plain", "plain, control", "ft")


def roles_of(entry: str):
    """The roles of a ``--compressors`` entry ``[diloco:]COMPRESSOR[+MEMORY]`` (``topk`` at density 0.01)."""
    from gc_strategy import build_components

    name, memory = (entry.removeprefix("diloco:").split("+") + ["none"])[:2]
    return build_components(name, memory, density=0.01) if name == "topk" else build_components(name, memory)


def configuration(text: str) -> str:
    """An argparse ``type``: a ``--compressors`` entry whose roles can be built."""
    try:
        roles_of(text)
    except (KeyError, ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid ({error}); allowed: [diloco:]COMPRESSOR[+MEMORY], e.g. topk+residual"
        ) from None
    return text


def build(args: argparse.Namespace, mode: str) -> tuple:
    """ResNet-18 (the same start in every mode), its optimizer and the synchroniser of ``mode``:
    ``plain`` over the default gloo group of the ``R`` processes, ``ft`` over torchft's quorum."""
    import torch
    import torchvision

    from gc_strategy import DiLoCo, FaultTolerance
    from gc_strategy.sync.diloco.synchronizer import DiLoCoSynchronizer
    from gc_strategy.sync.every_step.synchronizer import GradientSynchronizer
    from gc_strategy.sync.fault_tolerance.diloco import FaultTolerantDiLoCo
    from gc_strategy.sync.fault_tolerance.every_step import FaultTolerantSynchronizer

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    diloco = DiLoCo(inner_steps=args.inner_steps) if args.compressor.startswith("diloco:") else None
    roles = roles_of(args.compressor)
    if mode != "ft":
        sync = DiLoCoSynchronizer(model, roles, diloco) if diloco else GradientSynchronizer(model, roles)
        return model, optimizer, sync
    options = FaultTolerance(
        args.lighthouse, args.group, groups=args.groups, timeout_s=5, quorum_timeout_s=60, host=args.host
    )
    sync = (
        FaultTolerantDiLoCo(model, roles, diloco, options)
        if diloco
        else FaultTolerantSynchronizer(model, roles, options)
    )
    sync.use_optimizers([optimizer])
    return model, optimizer, sync


def shard(model, shape: tuple[int, int], unit: type | None = None):
    """``model`` sharded by FSDP2 over the ``shard`` dimension of a ``("replicate", "shard")``
    mesh of ``shape`` over the default process group: each module of type ``unit`` a unit (None:
    ResNet-18's residual blocks), then the whole; the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchvision.models.resnet import BasicBlock

    from gc_strategy.sync.sharded.synchronizer import MESH_DIMS

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
    for block in [m for m in model.modules() if isinstance(m, unit or BasicBlock)]:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return mesh


def train_step(model, optimizer, sync, batch, before_backward=lambda: None) -> bool:
    """One step of the training loop every integration runs; whether it committed."""
    import torch

    x, y = batch
    with sync.forward_pass():
        loss = torch.nn.functional.cross_entropy(model(x), y)
    before_backward()
    loss.backward()
    committed = sync.should_commit()
    if committed:
        optimizer.step()
    optimizer.zero_grad()
    sync.after_optimizer_step()  # DiLoCo's outer step every inner_steps
    return committed


def timed(calls: list[float], function):
    """``function``, each call's seconds appended to ``calls``."""

    def call(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - begin)

    return call


def batch_of(group: int) -> tuple:
    import torch

    g = torch.Generator().manual_seed(group)
    return torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)


def interleaved_worker(args: argparse.Namespace) -> None:
    """One replica group holding a model per mode, all started alike: block by block (a step, or
    DiLoCo's inner phase with its outer step), every mode runs a block, in an order drawn anew for
    each block (the same on every group). Writes each block's time per step to ``--out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    runs = {"ft": build(args, "ft")}  # a group of one process: before the plain modes' process group
    store = f"tcp://{args.store_host}:{STORE_PORT}"
    dist.init_process_group("gloo", init_method=store, rank=args.group, world_size=args.groups)
    runs |= {mode: build(args, mode) for mode in MODES if mode != "ft"}
    quorum = runs["ft"][2].round.quorum
    calls: dict[str, list[float]] = {"quorum": [], "vote": []}
    quorum.start, quorum.vote = timed(calls["quorum"], quorum.start), timed(calls["vote"], quorum.vote)
    period = args.inner_steps if args.compressor.startswith("diloco:") else 1
    batch = batch_of(args.group)
    blocks: dict[str, list[dict]] = {mode: [] for mode in MODES}
    dist.barrier()
    for block in range(args.warmup + args.steps):
        if block == args.warmup:  # the calls of the measured blocks only
            for timings in calls.values():
                timings.clear()
        for mode in random.Random(block).sample(MODES, len(MODES)):
            model, optimizer, sync = runs[mode]
            together, begin = True, time.perf_counter()
            for _ in range(period):
                committed = train_step(model, optimizer, sync, batch)
                together &= committed and getattr(sync, "participants", args.groups) == args.groups
            if block >= args.warmup:
                blocks[mode].append({"s": (time.perf_counter() - begin) / period, "together": together})
    Path(args.out).write_text(json.dumps({"blocks": blocks, "calls": calls}))
    for _, _, sync in runs.values():
        sync.close()
    dist.destroy_process_group()


def failure_worker(args: argparse.Namespace) -> None:
    """One replica group with fault tolerance: train to committed step ``--steps`` (on, until
    every group takes part in a step), killing itself before its exchange at step ``--die-at``;
    write the timings to ``--out``."""
    import torch

    torch.set_num_threads(1)
    model, optimizer, sync = build(args, "ft")
    batch = batch_of(args.group)

    def maybe_die() -> None:
        if 0 <= args.die_at <= sync.committed_steps and sync.participants == args.groups:
            os.kill(os.getpid(), signal.SIGKILL)

    steps, first_request = [], time.time()
    while True:
        begin = time.perf_counter()
        committed = train_step(model, optimizer, sync, batch, maybe_die)
        steps.append({"s": time.perf_counter() - begin, "end": time.time(), "committed": committed})
        if committed and sync.committed_steps >= args.steps and sync.participants == args.groups:
            break  # every group ends at one step
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    Path(args.out).write_text(json.dumps({"steps": steps, "first_request": first_request, "digest": digest}))
    sync.close()


def launch(node: netns.NodeNetwork, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    command = [*node.command, sys.executable, str(Path(__file__).resolve()), *args]
    return subprocess.Popen(command, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def run_groups(nodes, lighthouse, args: argparse.Namespace, compressor: str, folder: Path, kill_at: int = -1) -> list:
    """One run of every group: interleaved, or with ``kill_at`` the failure run (the last group
    dies there and is started again)."""
    groups = len(nodes)

    def start(g: int, die_at: int) -> subprocess.Popen:
        worker = "failure" if kill_at >= 0 else "interleaved"
        steps = args.steps * 2 if kill_at >= 0 else args.steps
        options = ["--worker", worker, "--group", str(g), "--groups", str(groups), "--compressor", compressor]
        options += ["--inner-steps", str(args.inner_steps), "--steps", str(steps), "--warmup", str(args.warmup)]
        options += ["--lighthouse", lighthouse, "--host", nodes[g].address, "--store-host", nodes[0].address]
        options += ["--die-at", str(die_at), "--out", str(folder / f"{g}.json")]
        return launch(nodes[g], options, folder / f"{g}.log")

    processes = [start(g, kill_at if g == groups - 1 else -1) for g in range(groups)]
    restarted_at = None
    if kill_at >= 0:
        processes[-1].wait(timeout=600)
        restarted_at = time.time()
        processes[-1] = start(groups - 1, -1)
    for g, process in enumerate(processes):
        if process.wait(timeout=1800) != 0:
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


def median_step(results: list[dict], mode: str) -> float:
    """The median over the groups of each one's median time per step of ``mode``'s blocks after
    the warm-up; for ``ft`` over the blocks whose steps all committed with every group taking part."""
    return statistics.median(
        statistics.median(b["s"] for b in result["blocks"][mode] if b["together"]) for result in results
    )


def median_call_ms(results: list[dict], name: str) -> float:
    """The median over the groups of each one's median ``name`` call (quorum, vote), in ms."""
    return 1000 * statistics.median(statistics.median(result["calls"][name]) for result in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["interleaved", "failure"], help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--store-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--die-at", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compressor", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default=None, help="shape every group's link to this rate (tc tbf), e.g. 1gbit")
    parser.add_argument("--groups", type=integer_at_least(2), default=3)
    parser.add_argument("--rounds", type=integer_at_least(1), default=3, help="runs of the groups per configuration")
    parser.add_argument("--steps", type=integer_at_least(1), default=20, help="measured blocks per mode and round")
    parser.add_argument("--warmup", type=integer_at_least(0), default=3, help="blocks per mode not measured")
    parser.add_argument("--kill-at", type=integer_at_least(-1), default=8, help="the failure run's step (-1: none)")
    parser.add_argument(
        "--compressors", type=configuration, nargs="+", default=["none", "topk+residual", "diloco:topk+residual"]
    )
    parser.add_argument("--inner-steps", type=integer_at_least(1), default=5)
    parser.add_argument("--failure-compressor", type=configuration, default="topk+residual")
    parser.add_argument("--join-timeout-ms", type=integer_at_least(1), default=2000, help="the lighthouse's")
    parser.add_argument(
        "--diloco-join-timeout-ms",
        type=integer_at_least(1),
        default=10000,
        help="the lighthouse's for DiLoCo: above an inner phase",
    )
    args = parser.parse_args()
    if args.worker:
        (interleaved_worker if args.worker == "interleaved" else failure_worker)(args)
        return
    if args.failure_compressor.startswith("diloco:"):
        allowed = "COMPRESSOR[+MEMORY] (the failure run synchronises every step)"
        parser.error(f"argument --failure-compressor: {args.failure_compressor!r} is invalid; allowed: {allowed}")
    with ExitStack() as stack:
        nodes = stack.enter_context(
            netns.emulated_network(args.groups, args.rate) if args.rate else netns.loopback(args.groups)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gc_ft_bench")))
        rows = {}
        for compressor in args.compressors:
            join_ms = args.diloco_join_timeout_ms if compressor.startswith("diloco:") else args.join_timeout_ms
            rounds = []
            with lighthouse(nodes[0], join_ms, folder) as url:
                for r in range(args.rounds):
                    results = run_groups(nodes, url, args, compressor, folder)
                    medians = {mode: median_step(results, mode) for mode in MODES}
                    calls = {name: median_call_ms(results, name) for name in ("quorum", "vote")}
                    rounds.append((medians, calls))
                    figures = ", ".join(f"{mode} {t:.3f}" for mode, t in medians.items())
                    print(f"{compressor} round {r}: s/step {figures}", file=sys.stderr, flush=True)
            rows[compressor] = rounds
        if args.kill_at >= 0:
            with lighthouse(nodes[0], args.join_timeout_ms, folder) as url:
                failure = run_groups(nodes, url, args, args.failure_compressor, folder, kill_at=args.kill_at)
    where = f"{args.groups} groups, {'links shaped to ' + args.rate if args.rate else 'loopback'}"
    print(f"\nResNet-18, 32x32, batch 32 per group, 1 thread per group; {where}")
    print(f"{args.rounds} runs x {args.steps} blocks per mode, the modes interleaved block by block")
    print(
        "\n| compressor | plain (s/step) | ft (s/step) | ft / plain (median, range) | control / plain | quorum, vote |"
    )
    print("|---|---|---|---|---|---|")
    for compressor, rounds in rows.items():
        ratios = [m["ft"] / m["plain"] for m, _ in rounds]
        control = [m["plain, control"] / m["plain"] for m, _ in rounds]
        plain, ft = (statistics.median(m[mode] for m, _ in rounds) for mode in ("plain", "ft"))
        quorum, vote = (statistics.median(c[name] for _, c in rounds) for name in ("quorum", "vote"))
        print(
            f"| {compressor} | {plain:.3f} | {ft:.3f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f} to {max(ratios):.3f}) | {statistics.median(control):.3f} "
            f"({min(control):.3f} to {max(control):.3f}) | {quorum:.1f} ms, {vote:.1f} ms |"
        )
        each = ", ".join(f"{f:.3f} / {c:.3f}" for f, c in zip(ratios, control))
        print(f"  per run (ft / plain, control / plain): {each}")
    if args.kill_at >= 0:
        report_failure(args, failure)


def report_failure(args: argparse.Namespace, failure: list[dict]) -> None:
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
