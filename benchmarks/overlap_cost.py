"""How much of a collective inside a node hides behind the backward, on CPU ranks.

The timeline model (``gc_strategy/fusion/timeline.py``) and the hierarchy (``hierarchy="node"``)
assume that a collective runs beside the backward: on GPU nodes the copies run on NVLink and the
NIC while the SMs compute. CPU ranks under gloo move their bytes with the cores that compute (socket
copies on loopback, and the reduction's additions). This script measures what that costs.

For each layout ``N x L`` (``N`` emulated nodes of ``L`` ranks, all processes on this machine, one
thread each, as in ``benchmarks/bench.py``'s netbed) and each collective the hierarchy runs inside a
node (a reduce onto the node's first rank, a broadcast from it) and, for comparison, an allreduce in
the node: the step alone (one forward and backward of torchvision ResNet-18, 32×32 images,
``--batch`` per rank), the collective of ``--megabytes`` alone, and the step with the collective
beside it; ``lost`` (the compute the collective took) and ``hidden`` (the share of it that ran
beside the step), as :mod:`gc_strategy.tools.contention` defines them.

    python benchmarks/overlap_cost.py --layouts 1x2 2x2 2x4 --megabytes 128 --runs 15
"""

from __future__ import annotations

import argparse
import re

from cli import integer_at_least

from gc_strategy.tools import contention
from gc_strategy.tools.advise_measure import model_and_batch


def _layout(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; allowed: NODESxRANKS, nodes >= 1 and ranks per node >= 2 (e.g. 2x2)"
        )
    return int(match[1]), int(match[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", type=_layout, nargs="+", default=[(1, 2), (2, 2), (2, 4)], help="e.g. 2x2")
    parser.add_argument("--megabytes", type=integer_at_least(1), default=128, help="size of each collective")
    parser.add_argument("--batch", type=integer_at_least(1), default=32, help="samples per rank")
    parser.add_argument("--runs", type=integer_at_least(1), default=15)
    args = parser.parse_args()
    model, make_batch, loss = model_and_batch("resnet18", args.batch, 32)

    def step() -> None:
        loss(model, make_batch()).backward()

    nbytes = args.megabytes << 20
    print(f"ResNet-18, 32x32, batch {args.batch} per rank; collectives of {args.megabytes} MB fp32; {args.runs} runs")
    print()
    print("| layout | collective | step (s) | collective (s) | step beside it (s) | lost (s) | hidden |")
    print("|---|---|---|---|---|---|---|")
    for nodes, per_node in args.layouts:
        collectives = ("reduce", "broadcast", "allreduce")
        measured = contention.measure(nodes, per_node, step, [nbytes], collectives, args.runs)
        for collective in collectives:
            m = measured[collective, nbytes]
            print(
                f"| {nodes} x {per_node} | {collective} | {m.step_s:.3f} | {m.collective_s:.3f} | {m.beside_s:.3f} | "
                f"{m.lost_s:.3f} | {m.hidden:.0%} |"
            )


if __name__ == "__main__":
    main()
