"""How much of a collective inside a node hides behind the backward, on CPU ranks.

The timeline model (``gc_strategy/fusion/timeline.py``) and the hierarchy (``hierarchy="node"``)
assume that a collective runs beside the backward: on GPU nodes the copies run on NVLink and the
NIC while the SMs compute. CPU ranks under gloo move their bytes with the cores that compute (socket
copies on loopback, and the reduction's additions). This script measures what that costs.

For each layout ``N x L`` (``N`` emulated nodes of ``L`` ranks, all processes on this machine, one
thread each, as in ``benchmarks/bench.py``'s netbed) and each collective the hierarchy runs inside a
node (a reduce onto the node's first rank, a broadcast from it) and, for comparison, an allreduce in
the node, every rank times, ``--runs`` times:

- ``step``: one forward and backward of torchvision ResNet-18 (32×32 images, ``--batch`` per rank),
  alone;
- ``collective``: the collective of ``--megabytes`` in the node's gloo group, alone;
- ``step beside it``: the step, with the collective issued just before it (asynchronous, as the
  synchroniser issues it).

``lost`` is ``step beside it − step``: the compute time the collective took. ``hidden`` is ``1 −
lost / collective``: the share of the collective that overlapped the step (1: all of it; 0: none, as
if the two ran one after the other). Medians over runs, then over ranks.

    python benchmarks/overlap_cost.py --layouts 1x2 2x2 2x4 --megabytes 128 --runs 15
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cli import integer_at_least

from gc_strategy.advise import model_and_batch

COLLECTIVES = ("reduce", "broadcast", "allreduce")


def _layout(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; allowed: NODESxRANKS, nodes >= 1 and ranks per node >= 2 (e.g. 2x2)"
        )
    return int(match[1]), int(match[2])


def _issue(collective: str, tensor: torch.Tensor, root: int, group) -> dist.Work:
    if collective == "reduce":
        return dist.reduce(tensor, root, group=group, async_op=True)
    if collective == "broadcast":
        return dist.broadcast(tensor, root, group=group, async_op=True)
    return dist.all_reduce(tensor, group=group, async_op=True)


def _rank(rank: int, world_size: int, per_node: int, init_file: str, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        nodes = [list(range(n * per_node, (n + 1) * per_node)) for n in range(world_size // per_node)]
        group, _ = dist.new_subgroups_by_enumeration(nodes)
        root = rank - rank % per_node
        torch.manual_seed(rank)
        model, make_batch, loss = model_and_batch("resnet18", args.batch, 32)

        def step() -> None:
            loss(model, make_batch()).backward()

        tensor = torch.zeros(args.megabytes << 18)  # fp32: 2**18 elements per MB
        step()  # warm-up
        rows = {}
        for collective in COLLECTIVES:
            runs = []
            for _ in range(args.runs):
                dist.barrier()
                start = time.perf_counter()
                step()
                alone = time.perf_counter() - start
                dist.barrier()
                start = time.perf_counter()
                _issue(collective, tensor, root, group).wait()
                communication = time.perf_counter() - start
                dist.barrier()
                work = _issue(collective, tensor, root, group)
                start = time.perf_counter()
                step()
                beside = time.perf_counter() - start
                work.wait()
                runs.append((alone, communication, beside))
            rows[collective] = [statistics.median(column) for column in zip(*runs)]
        queue.put((rank, rows))
    finally:
        dist.destroy_process_group()


def measure(nodes: int, per_node: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """{collective: [step, collective, step beside it]}: medians over runs, then over ranks."""
    world_size = nodes * per_node
    context = mp.get_context("fork")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        processes = [
            context.Process(target=_rank, args=(r, world_size, per_node, init_file, args, queue))
            for r in range(world_size)
        ]
        for process in processes:
            process.start()
        per_rank = [queue.get(timeout=900)[1] for _ in processes]
        for process in processes:
            process.join(60)
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError(f"a rank failed: exit codes {[process.exitcode for process in processes]}")
    return {
        collective: [statistics.median(rank[collective][i] for rank in per_rank) for i in range(3)]
        for collective in COLLECTIVES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", type=_layout, nargs="+", default=[(1, 2), (2, 2), (2, 4)], help="e.g. 2x2")
    parser.add_argument("--megabytes", type=integer_at_least(1), default=128, help="size of each collective")
    parser.add_argument("--batch", type=integer_at_least(1), default=32, help="samples per rank")
    parser.add_argument("--runs", type=integer_at_least(1), default=15)
    args = parser.parse_args()
    print(f"ResNet-18, 32x32, batch {args.batch} per rank; collectives of {args.megabytes} MB fp32; {args.runs} runs")
    print()
    print("| layout | collective | step (s) | collective (s) | step beside it (s) | lost (s) | hidden |")
    print("|---|---|---|---|---|---|---|")
    for nodes, per_node in args.layouts:
        for collective, (alone, communication, beside) in measure(nodes, per_node, args).items():
            lost = beside - alone
            print(
                f"| {nodes} x {per_node} | {collective} | {alone:.3f} | {communication:.3f} | {beside:.3f} | "
                f"{lost:.3f} | {1 - lost / communication:.0%} |"
            )


if __name__ == "__main__":
    main()
