"""Healing a large state over an emulated link: how fast a restarted replica group loads a live
peer's state, and what the survivors' steps cost meanwhile.

Two replica groups (one process each, one emulated node each, the lighthouse on node 0; links shaped
with ``tc tbf``, ``benchmarks/netns.py``; root only) train an MLP of ``--layers`` square layers of
``--width`` (1.07 GB of fp32 parameters at the default 16 × 4096) with PowerSGD through
``FaultTolerantSynchronizer`` (compressing from the first step): the gradients cross the link
compressed, the healed state is the parameters, the optimizer's and PowerSGD's. After ``--steps``
steps together group 1 is killed (SIGKILL) and started again at once; it heals from group 0
through torchft's HTTP checkpoint transport. With ``--ranks S`` each group is a torchrun of ``S``
ranks sharding the MLP with FSDP2 (each layer a unit) through ``FaultTolerantShardedSynchronizer``:
rank ``r`` heals from rank ``r`` of group 0, its shard only, and the ranks' transfers share the
node's link. Reported: the bytes each healing rank received, the transfers' seconds (torchft's
``recv_checkpoint``, from the first one's start to the last one's end) and their rate against the
link's, and group 0's steps before, during and after the heal (a step waits for the healing group,
which takes part in it once healed).

    python benchmarks/heal_large.py --rate 1gbit
    python benchmarks/heal_large.py --rate 1gbit --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
from fault_tolerance import shard  # noqa: E402
from ft_loop import launcher, records, together, torchrun_ranks, train_until_stopped, write_stop  # noqa: E402

from gc_strategy.fusion.topology import parse_rate  # noqa: E402

LIGHTHOUSE_PORT = 29510
GROUPS = 2


def worker(args: argparse.Namespace) -> None:
    """One rank of a replica group (the whole group where it has one): steps until ``--stop``
    names a step it reached with every group; each step's end and outcome (the group's rank 0), and
    each checkpoint this rank received (bytes, seconds), printed as JSON."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from gc_strategy import FaultTolerance, build_components
    from gc_strategy.sync.fault_tolerance.every_step import FaultTolerantSynchronizer
    from gc_strategy.sync.fault_tolerance.sharded import FaultTolerantShardedSynchronizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    options = FaultTolerance(args.lighthouse, args.group, groups=GROUPS, timeout_s=args.timeout_s, host=args.host)
    roles, rank = build_components("powersgd", start_iter=0), 0
    if "LOCAL_RANK" in os.environ:  # a group of several ranks, started by torchrun
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = shard(model, (1, dist.get_world_size()), unit=nn.Linear)
        sync = FaultTolerantShardedSynchronizer(model, roles, options, mesh)
    else:
        sync = FaultTolerantSynchronizer(model, roles, options)
    sync.use_optimizers([optimizer])
    transport = sync.round.quorum.manager._checkpoint_transport
    receive = transport.recv_checkpoint

    def timed_receive(*a, **k):
        begin = time.time()
        state = receive(*a, **k)
        tensors = [v for v in torch.utils._pytree.tree_leaves(state) if isinstance(v, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        print(json.dumps({"received": nbytes, "begin": begin, "end": time.time(), "rank": rank}), file=log, flush=True)
        return state

    transport.recv_checkpoint = timed_receive
    log = sys.stdout
    if rank:  # the group's step records are its rank 0's
        sys.stdout = open(os.devnull, "w")

    def loss_of(step: int) -> torch.Tensor:
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1000 * args.group + step))
        return model(x).square().mean()

    train_until_stopped(sync, optimizer, loss_of, GROUPS, Path(args.stop))
    sync.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--stop", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="1gbit", help="every node's link (tc tbf)")
    parser.add_argument("--width", type=integer_at_least(1), default=4096)
    parser.add_argument("--layers", type=integer_at_least(1), default=16)
    parser.add_argument("--ranks", type=integer_at_least(1), default=1, help="per group, sharded with FSDP2 where > 1")
    parser.add_argument("--batch", type=integer_at_least(1), default=8)
    parser.add_argument("--steps", type=integer_at_least(1), default=5, help="steps together before and after")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="fault_tolerance's timeout_s (> the heal)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    netns.check_can_emulate(args.rate)
    with ExitStack() as stack:
        nodes = stack.enter_context(netns.emulated_network(GROUPS, args.rate))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gc_heal")))
        binary = Path(sys.executable).with_name("torchft_lighthouse")
        address = f"{nodes[0].address}:{LIGHTHOUSE_PORT}"
        command = [*nodes[0].command, str(binary), "--min_replicas", "1", "--join_timeout_ms", "1000"]
        lighthouse = subprocess.Popen(
            [*command, "--bind", address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        stack.callback(lighthouse.kill)
        time.sleep(1.0)

        def start(group: int) -> subprocess.Popen:
            node = nodes[group]
            options = ["--worker", "--group", str(group), "--lighthouse", f"http://{address}", "--host", node.address]
            options += ["--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch)]
            options += ["--timeout-s", str(args.timeout_s), "--stop", str(folder / "stop")]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
            log = (folder / f"{group}.log").open("ab")
            command = [*node.command, *launcher(args.ranks), str(Path(__file__).resolve()), *options]
            return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.DEVNULL)

        def wait_for(steps: int, timeout: float = 1200) -> None:
            deadline = time.monotonic() + timeout
            while together(folder / "1.log", GROUPS) < steps:
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in processes):
                    raise SystemExit(
                        f"the groups did not take {steps} steps together: {(folder / '1.log').read_text()[-2000:]}"
                    )
                time.sleep(0.2)

        processes = [start(g) for g in range(GROUPS)]
        stack.callback(lambda: [p.kill() for p in processes])
        wait_for(args.steps)
        for pid in torchrun_ranks(processes[1]) if args.ranks > 1 else [processes[1].pid]:
            os.kill(pid, signal.SIGKILL)  # torchrun ends when its ranks are gone
        processes[1].wait(timeout=30)
        killed = time.time()
        processes[1] = start(1)
        wait_for(together(folder / "1.log", GROUPS) + args.steps)
        write_stop(folder / "stop", [folder / f"{g}.log" for g in range(GROUPS)])
        for g, process in enumerate(processes):
            if process.wait(timeout=600) != 0:
                raise SystemExit(f"group {g} failed")
        received = [r for r in records(folder / "1.log", "received") if r["begin"] > killed]
        survivor = records(folder / "0.log", "step")
    report(args, killed, received, survivor)


def report(args: argparse.Namespace, killed: float, received: list[dict], survivor: list[dict]) -> None:
    """The transfer (each healing rank's last, together: from the first one's start to the last
    one's end), and group 0's committed steps (the seconds since its previous one): before the
    kill, from the kill to its first step with the healed group, and after."""
    sharding = f", {args.ranks} ranks per group (FSDP2)" if args.ranks > 1 else ""
    print(f"\n{GROUPS} replica groups{sharding}, MLP {args.layers} x {args.width} (powersgd), links {args.rate}")
    heals = {r["rank"]: r for r in sorted(received, key=lambda r: r["rank"])}  # each rank's last
    if len(heals) < args.ranks:
        raise SystemExit(f"{len(heals)} of the restarted group's {args.ranks} ranks received a checkpoint")
    begin, end = min(h["begin"] for h in heals.values()), max(h["end"] for h in heals.values())
    total, seconds = sum(h["received"] for h in heals.values()), end - begin
    link, rate = parse_rate(args.rate), total / seconds  # bytes per second
    print(f"state received: {total / 1e9:.3f} GB ({total} bytes) in {seconds:.2f} s, ", end="")
    print(f"{8 * rate / 1e9:.3f} Gbit/s: ", end="")
    print(f"{rate / link:.2f} of the link's {8 * link / 1e9:g} Gbit/s")
    if args.ranks > 1:
        shares = [f"rank {r} {h['received']} bytes in {h['end'] - h['begin']:.2f} s" for r, h in heals.items()]
        print(f"by rank (each its shard): {'; '.join(shares)}")
    committed = [r for r in survivor if r["committed"]]
    gaps = [(b["end"] - a["end"], b) for a, b in zip(committed, committed[1:])]
    rejoined = next(r["end"] for r in committed if r["end"] > end and r["with"] == GROUPS)
    before = [s for s, r in gaps if r["end"] < killed]
    around = [(round(s, 2), r["with"]) for s, r in gaps if killed <= r["end"] <= rejoined]
    after = [s for s, r in gaps if r["end"] > rejoined]
    print(
        f"group 0's steps: before the kill median {statistics.median(before):.2f} s; from the kill to its first ",
        end="",
    )
    print(f"step with the healed group (seconds, groups): {around}; after median {statistics.median(after):.2f} s")


if __name__ == "__main__":
    main()
