"""Does compression pay on this cluster? Predicted step times of each configuration against a bf16
allreduce, from the topology-aware timeline model.

    python -m gc_strategy.tools.advise --model resnet18 --nodes 2 --ranks-per-node 2 --inter 1gbit \\
        --configs compressor=topk,memory=residual,density=0.01 compressor=qsgd,hierarchy=node

Compression is no free win: in a survey of 200 published set-ups it sped training up in only a
handful (Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
MLSys 2022), because encode and decode cost device time and a gathered payload grows with the
number of ranks. The advisor predicts, for each configuration, the step time of the timeline model
(:mod:`gc_strategy.fusion.timeline`) with its communication term from the cluster's topology
(:mod:`gc_strategy.fusion.topology`), and recommends the fastest, or plain bf16 allreduce when no
configuration beats it.

What it measures here, on the model's own tensor shapes and random gradients, bucketed as the
synchroniser buckets them (``fusion``, default 25 MB buckets; with ``fusion=auto``, as the
synchroniser's planner keeps it, the fastest of the model's searched plan and the plans it tries):

- **payload bytes and rounds** of each compressor's exchange, and its **encode and decode time** at
  the world size it will run at: the exchange runs through a
  :class:`~gc_strategy.tools.advise_measure.Replicas` communicator, which
  hands back the payloads of ``W`` ranks (this rank's, ``W`` times) without a network, so that a
  gathered payload is decoded ``W`` times as in training;
- **the backward's gradient-ready times** (one short run of the model).

With ``--intra measure`` the cluster is one of CPU ranks like this machine's, whose collectives move
their bytes with the cores that compute: the link inside a node is measured here, and so is what each
collective takes from the backward beside it (:mod:`gc_strategy.tools.contention`), a node's reduce and
broadcast and the exchanges over all ranks and across nodes; each bucket's collectives are then
priced with that compute as well (:func:`predict`).

The compute time of a step at the target (forward, backward, optimizer: everything but
synchronisation) is given (``--compute-s``), or measured here. Encode and decode run on the same
device as the compute and are scaled with it: by ``compute_s / (the step measured here)``, which is
1 when the target is this device. With ``hierarchy="node"`` each bucket is encoded and decoded by
its owner, one rank of each node, for the ``N`` nodes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..communicators import EAGER_AFTER_BYTES
from ..components import build_components, parse_options
from ..fusion.plans import FusionPlanner
from ..fusion.timeline import Cost, CostModel, Node, best_plan, simulate
from ..fusion.topology import Link, Topology, bytes_across_nodes, exchange_seconds, parse_rate
from ..sync.every_step.autotune import TRIAL_PLANS
from ..sync.paths.hierarchy import hierarchy_of
from .advise_measure import (
    EXCHANGE_BYTES,
    EXCHANGE_SPANS,
    INSIDE_BYTES,
    MODELS,
    Compute,
    CpuRanks,
    Profile,
    measure_compute,
    measure_cpu_ranks,
    model_and_batch,
    profile,
    roles,
)
from .advise_plots import check_can_plot, plot_predictions, plot_projection

BASELINE = "compressor=bf16"


def predict(
    profile: Profile,
    numels: list[int],
    cut: list[int] | None,
    compute: Compute,
    topology: Topology,
    codec_scale: float,
    cpu: CpuRanks | None = None,
) -> float:
    """The timeline model's step time of one profiled configuration on ``topology``, bucketed as
    ``cut`` (tensors per bucket; None: ``fusion="auto"``, which keeps the fastest measured of the
    plan it searches and the plans it tries (:mod:`gc_strategy.sync.every_step.autotune`), here the fastest simulated of
    the same plans), with encode and decode times times ``codec_scale``. With ``hierarchy="node"`` each
    bucket is coded by its owner alone, and the step is the latest rank's
    (:class:`~gc_strategy.fusion.timeline.Node`). On ``cpu`` ranks the collectives also take compute
    time. The exchange's is work between rounds on the rank that exchanges the bucket (its owner): it
    holds the bucket's exchange (gloo adds what a ring step received before it sends it on) and takes
    that rank's device time. The collectives inside a node take every rank's compute instead of the
    link's: the bucket's reduce before its launch, its broadcast with the decodes.

    The casts of ``node_precision="bf16"`` are device time: every rank rounds its bucket to bf16
    before the reduce and widens the average after the broadcast; the owner also widens the node's
    sum before it encodes and rounds the average before it broadcasts."""
    hierarchy = profile.options.get("hierarchy", "flat")
    dense_bytes_per_element = 2 if profile.options.get("node_precision") == "bf16" else 4
    on_device = cpu is not None and hierarchy == "node"
    span = "across" if hierarchy == "node" else "world"
    sizes = profile.sizes
    narrow, widen = (
        tuple(codec_scale * t for t in casts) or (0.0,) * len(sizes) for casts in (profile.narrow_s, profile.widen_s)
    )
    link, between, reduce, broadcast = [], [], [], []
    for n, payload, work, to_wire, from_wire in zip(sizes, profile.payload_bytes, profile.between_s, narrow, widen):
        dense = dense_bytes_per_element * n
        held = cpu.exchange[span, profile.sums](payload) if cpu is not None else 0.0
        link.append(exchange_seconds(topology, hierarchy, profile.sums, dense, payload, profile.rounds, not on_device))
        between.append(held + codec_scale * work)
        reduce.append((cpu.reduce(dense) if on_device else 0.0) + to_wire)
        broadcast.append((cpu.broadcast(dense) if on_device else 0.0) + from_wire)
    model = CostModel(
        compute.ready,
        tuple(numels),
        Cost.measured(sizes, [codec_scale * t + w for t, w in zip(profile.encode_s, widen)]),
        Cost.measured(sizes, link),
        Cost.measured(sizes, [codec_scale * t + w for t, w in zip(profile.decode_s, narrow)]),
        compute.other,
        Cost.measured(sizes, between),
        # fp32 buckets; the node's reduce is an eager round, so every hierarchical exchange waits
        EAGER_AFTER_BYTES / 4 if profile.eager or hierarchy == "node" else None,
    )
    node = None
    if hierarchy == "node":
        node = Node(topology.ranks_per_node, Cost.measured(sizes, reduce), Cost.measured(sizes, broadcast))
    if cut is None:  # the search is exact for one rank; over a node it searches a rank on average
        searched = best_plan(node.mean(model) if node else model)[0]
        tried = [_cut(planner, numels) for planner in TRIAL_PLANS]
        return min(simulate(model, plan, node) for plan in [searched, *tried])
    return simulate(model, cut, node)


def advise(
    configs: list[str],
    shapes: dict[str, torch.Size],
    compute: Compute,
    topology: Topology,
    codec_scale: float,
    cpu: CpuRanks | None = None,
) -> list[dict[str, Any]]:
    """One row per configuration, the bf16 allreduce first: predicted step time (:func:`predict`),
    speedup over bf16, payload bytes per rank and step (with ``hierarchy="node"``, the mean of a
    node's ranks, which each send the buckets they own) and bytes across nodes per step, summed over
    the nodes (:func:`~gc_strategy.fusion.topology.bytes_across_nodes`); sorted by predicted time
    after the baseline."""
    numels = [shape.numel() for shape in shapes.values()]
    rows, profiles = [], {}
    for spec in [BASELINE, *configs]:
        options = check_config(spec)
        hierarchy = options.get("hierarchy", "flat")
        world = topology.nodes if hierarchy == "node" else topology.world_size
        precision = options.get("node_precision", "full")  # bf16 casts are measured with the codec
        codec = (world, precision, *sorted((k, str(v)) for k, v in roles(options).items() if k != "fusion"))
        if codec not in profiles:  # configurations that differ only in fusion share one profile
            profiles[codec] = profile(options, shapes, world)
        measured = replace(profiles[codec], options=options)
        step = predict(measured, numels, _plan(options, numels), compute, topology, codec_scale, cpu)
        whole = Cost.measured(measured.sizes, measured.payload_bytes)(sum(numels))
        owners = topology.ranks_per_node if hierarchy == "node" else 1
        rows.append(
            {
                "configuration": spec,
                "predicted step (s)": step,
                "payload bytes / rank / step": whole / owners,
                "bytes across nodes / step": bytes_across_nodes(topology, hierarchy, measured.sums, whole),
            }
        )
    for row in rows:
        row["speedup vs bf16 allreduce"] = rows[0]["predicted step (s)"] / row["predicted step (s)"]
    return [rows[0], *sorted(rows[1:], key=lambda row: row["predicted step (s)"])]


#: predictions closer than this are a tie: on a shared machine they move by more from run to run
TIE = 0.02


def recommendation(rows: list[dict[str, Any]], margin: float = 1.05) -> str:
    """The fastest configuration when it beats the bf16 allreduce by ``margin``, naming those
    predicted within :data:`TIE` of it; else the baseline."""
    best = min(rows[1:], key=lambda row: row["predicted step (s)"], default=rows[0])
    if best["speedup vs bf16 allreduce"] < margin:
        return f"do not compress: no configuration beats the bf16 allreduce by {margin:.2f}x; use {BASELINE}"
    answer = f"compress: {best['configuration']} ({best['speedup vs bf16 allreduce']:.2f}x the bf16 allreduce)"
    close = best["predicted step (s)"] * (1 + TIE)
    ties = [row["configuration"] for row in rows[1:] if row is not best and row["predicted step (s)"] <= close]
    if ties:
        answer += f"; a tie within {TIE:.0%} (the model's run-to-run spread is larger), measure: " + ", ".join(ties)
    return answer


#: GPU assumptions of the projection (:func:`project`): encode + decode seconds per element of one
#: fused bucket with error feedback, measured on one H100 on ResNet-50 (docs/benchmarks/gpu_h100.md);
#: the effective compute rate of a ResNet-50 training step there (40 ms at batch 64, fp32, 3 × 4.1
#: GFLOP per image); and the memory bandwidth at which a gathered payload is decoded once more per rank
H100_CODEC_S_PER_ELEMENT = {
    name: ms * 1e-3 / 25_557_032
    for name, ms in {
        "bf16": 0.12,
        "fp16": 0.12,
        "topk": 1.28,
        "randk": 0.69,
        "dgc": 2.00,
        "efsignsgd": 0.70,
        "qsgd": 0.44,
        "powersgd": 4.85,
    }.items()
}
H100_FLOPS = 3 * 4.1e9 * 64 / 0.040
H100_MEMORY_BYTES_PER_S = 2.0e12
PROJECTION = {  # model: (batch, size, training FLOPs per sample)
    "resnet50": (64, 224, 3 * 4.1e9),
    "bert-base": (32, 128, 6 * 110e6 * 128),
}


@dataclass(frozen=True)
class Projection:
    """Predicted step seconds of the bf16 allreduce and of each configuration, per inter-node rate and
    GPU count: ``seconds[rate, gpus][spec]``."""

    title: str
    configs: list[str]
    seconds: dict[tuple[str, int], dict[str, float]]

    def speedups(self) -> dict[tuple[str, int], dict[str, float]]:
        """Each configuration's speedup over the bf16 allreduce, per inter-node rate and GPU count."""
        return {
            key: {spec: times[BASELINE] / times[spec] for spec in self.configs} for key, times in self.seconds.items()
        }

    def table(self) -> str:
        lines = [
            self.title,
            "",
            "| inter-node link | GPUs | bf16 allreduce (s) | " + " | ".join(self.configs) + " |",
            "|" + "---|" * (3 + len(self.configs)),
        ]
        for (rate, gpus), speedups in self.speedups().items():
            cells = [f"{speedup:.2f}" for speedup in speedups.values()]
            base = self.seconds[rate, gpus][BASELINE]
            lines.append(f"| {rate} | {gpus} | {base:.3f} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def project(name: str, configs: list[str], gpus: list[int], inter_rates: list[str], per_node: int = 8) -> Projection:
    """A projection, not a measurement: predicted step times on ``gpus`` H100s, ``per_node`` per node
    (NVLink inside, 2.4 Tbit/s; each node's link ``inter_rates``), from payloads measured here and the
    GPU assumptions above. A gathered payload's decode grows with the ranks: ``(W − 1)`` payload
    reads at :data:`H100_MEMORY_BYTES_PER_S` more than the measured world-size-1 codec."""
    batch, size, flops = PROJECTION[name]
    model, make_batch, loss = model_and_batch(name, 2, 64 if name.startswith("resnet") else 32)
    order, here = measure_compute(model, make_batch, loss, steps=1)
    compute = here.scaled(batch * flops / H100_FLOPS / here.step_s)
    parameters = dict(model.named_parameters())
    shapes = {n: parameters[n].shape for n in order}
    numels = [shape.numel() for shape in shapes.values()]
    title = (
        f"PROJECTION (model, not measurement): {name}, batch {batch} per GPU, {per_node} H100 per node, "
        f"compute {compute.step_s * 1e3:.0f} ms per step (assumed); speedup of each over a flat bf16 allreduce"
    )
    measured = {spec: profile(parse_options(spec), shapes, 2) for spec in [BASELINE, *configs]}
    plans = {spec: _plan(profiled.options, numels) for spec, profiled in measured.items()}
    seconds = {}
    for rate in inter_rates:
        for count in gpus:
            nodes = max(1, count // per_node)
            topology = Topology(nodes, min(count, per_node), Link(300e9, 5e-6), Link(parse_rate(rate), 10e-6))
            times = {}
            for spec, profiled in measured.items():
                options = profiled.options
                hierarchy = options.get("hierarchy", "flat")
                ranks = nodes if hierarchy == "node" else topology.world_size
                per_element = H100_CODEC_S_PER_ELEMENT[options["compressor"]]
                gathered = 0.0 if profiled.sums else 1.0
                decode = [
                    per_element * n / 2 + gathered * (ranks - 1) * b / H100_MEMORY_BYTES_PER_S
                    for n, b in zip(profiled.sizes, profiled.payload_bytes)
                ]
                # a cast to bf16 or back: half the bf16 compressor's codec, which is those two casts
                cast = tuple(H100_CODEC_S_PER_ELEMENT["bf16"] * n / 2 for n in profiled.sizes)
                gpu = replace(
                    profiled,
                    encode_s=tuple(per_element * n / 2 for n in profiled.sizes),
                    between_s=tuple(0.0 for _ in profiled.sizes),
                    decode_s=tuple(decode),
                    narrow_s=cast if profiled.narrow_s else (),
                    widen_s=cast if profiled.widen_s else (),
                )
                times[spec] = predict(gpu, numels, plans[spec], compute, topology, 1.0)
            seconds[rate, count] = times
    return Projection(title, list(configs), seconds)


def check_config(spec: str) -> dict[str, Any]:
    """The options of one ``--configs`` item, checked (raises ``ValueError`` naming what is wrong)."""
    options = parse_options(spec)
    try:
        hierarchy_of(options.get("hierarchy", "flat"), options.get("node_precision", "full"))
    except ValueError as error:
        raise ValueError(f"configs: {spec!r}: {error}") from None
    build_components(**roles(options))
    return options


def _plan(options: dict[str, Any], numels: list[int]) -> list[int] | None:
    """Tensors per bucket as the configuration's fusion planner cuts fp32 gradients of ``numels``
    elements; None for ``fusion=auto``, whose plan the model chooses (:func:`predict`)."""
    planner = build_components(**roles(options)).fusion
    return None if planner.measured else _cut(planner, numels)


def _cut(planner: FusionPlanner, numels: list[int]) -> list[int]:
    """Tensors per bucket as ``planner`` cuts fp32 gradients of ``numels`` elements."""
    return planner.plan([4 * n for n in numels])


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["configuration", "predicted step (s)", "speedup vs bf16 allreduce"]
    columns += ["payload bytes / rank / step", "bytes across nodes / step"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [row["configuration"], f"{row[columns[1]]:.3f}", f"{row[columns[2]]:.2f}"]
        cells += [f"{row[column]:,.0f}" for column in columns[3:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gc_strategy.advise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18", help=", ".join(MODELS))
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--size", type=int, default=32, help="image side (ResNets) or sequence length (BERT)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument(
        "--intra",
        default="100gbit",
        help="bandwidth inside a node, e.g. 100gbit or 10GB (collectives beside the compute, as over NVLink), or "
        "'measure': CPU ranks under gloo here, the link and what every collective takes from the backward",
    )
    parser.add_argument("--intra-latency-us", type=float, default=10.0)
    parser.add_argument("--inter", default="1gbit", help="bandwidth between nodes, per node")
    parser.add_argument(
        "--inter-latency-us",
        type=float,
        default=50.0,
        help="latency between nodes, per message; with --intra measure, CPU ranks' measured latency is added",
    )
    parser.add_argument(
        "--compute-s", type=float, help="a step without communication at the target (default: measured here)"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for the measurements")
    parser.add_argument("--configs", nargs="+", required=True, help="GCFusedStrategy options, key=value,...")
    parser.add_argument(
        "--project",
        action="store_true",
        help="print a projection for 8-1024 H100s (8 per node, 25 and 100 Gbit/s) of --model resnet50 or bert-base",
    )
    parser.add_argument("--plot", help="also draw the answer into this PNG file (needs matplotlib)")
    return parser


def _check_arguments(args: argparse.Namespace) -> tuple[list[dict[str, Any]], Link, Link | None]:
    """Every argument checked before any measurement (raises ``ValueError`` naming the option, the
    value and what is allowed): the options of each configuration, the link between nodes and the
    link inside a node (None: ``--intra measure``)."""
    for option in ("batch", "size", "nodes", "ranks_per_node", "threads"):
        if getattr(args, option) < 1:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} = {getattr(args, option)} is invalid; allowed: an integer >= 1")
    for option in ("intra_latency_us", "inter_latency_us"):
        if not getattr(args, option) >= 0:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{flag} = {getattr(args, option)} is invalid; allowed: microseconds >= 0")
    if args.compute_s is not None and not args.compute_s > 0:
        raise ValueError(f"--compute-s = {args.compute_s} is invalid; allowed: seconds > 0")
    inter = Link(parse_rate(args.inter, "--inter"), args.inter_latency_us * 1e-6)
    measure = args.intra == "measure"
    intra = None if measure else Link(parse_rate(args.intra, "--intra"), args.intra_latency_us * 1e-6)
    configs = [check_config(spec) for spec in args.configs]
    if args.model not in MODELS:
        raise ValueError(f"--model = {args.model!r} is invalid; allowed: {', '.join(MODELS)}")
    if args.project:
        if args.model not in PROJECTION:
            raise ValueError(f"--project: --model = {args.model!r} is invalid; allowed: {', '.join(PROJECTION)}")
        for options in configs:
            compressor = options.get("compressor", "none")
            if compressor not in H100_CODEC_S_PER_ELEMENT:
                raise ValueError(
                    f"--project: compressor = {compressor!r} has no GPU cost measured; allowed: "
                    + ", ".join(H100_CODEC_S_PER_ELEMENT)
                )
    if measure and args.ranks_per_node < 2:
        raise ValueError("--intra measure needs --ranks-per-node >= 2 (a node of one rank has no link inside)")
    if args.plot:
        check_can_plot(args.plot)
    return configs, inter, intra


def _describe_cpu_ranks(cpu: CpuRanks) -> str:
    """What the measured CPU ranks' collectives take from the backward, at the largest sizes measured."""
    dense, payload = INSIDE_BYTES[-1], EXCHANGE_BYTES[-1]
    lost = {key: cost(payload) for key, cost in cpu.exchange.items()}
    over = {"world": "over all ranks", "across": "over one rank per node"}
    exchanges = ", ".join(
        f"{where} {lost[span, True]:.3f} and {lost[span, False]:.3f} s"
        for span, where in over.items()
        if (span, True) in lost
    )
    return (
        f"CPU ranks, measured beside the backward: a node's reduce and broadcast of {dense >> 20} MB take "
        f"{cpu.reduce(dense):.3f} and {cpu.broadcast(dense):.3f} s of compute; an allreduce and an allgather of "
        f"{payload >> 20} MB per rank {exchanges}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        configs, inter, intra = _check_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.project:  # its clusters are given: nothing of this machine's links to measure
        projection = project(args.model, args.configs, [8, 32, 128, 512, 1024], ["25gbit", "100gbit"])
        print(projection.table())
        if args.plot:
            plot_projection(projection.title, projection.speedups(), args.plot)
            print(f"plot: {args.plot}")
        return
    model, make_batch, loss = model_and_batch(args.model, args.batch, args.size)
    order, here = measure_compute(model, make_batch, loss)  # first: nothing else running on this machine
    cpu = None
    if intra is None:
        hierarchical = any(options.get("hierarchy") == "node" for options in configs)
        spans = EXCHANGE_SPANS if hierarchical else ("world",)  # the baseline is flat

        def step() -> None:
            loss(model, make_batch()).backward()

        cpu = measure_cpu_ranks(args.nodes, args.ranks_per_node, step, spans=spans)
        # a message between nodes also waits for its CPU ranks, as one inside does
        inter = Link(inter.bandwidth, inter.latency + cpu.link.latency)
        intra = cpu.link
    topology = Topology(args.nodes, args.ranks_per_node, intra, inter)
    compute = here if args.compute_s is None else here.scaled(args.compute_s / here.step_s)
    parameters = dict(model.named_parameters())
    shapes = {name: parameters[name].shape for name in order}
    rows = advise(args.configs, shapes, compute, topology, compute.step_s / here.step_s, cpu)
    setting = f"{args.model}, batch {args.batch}, size {args.size}; {topology.describe()}"
    print(setting)
    if cpu is not None:
        print(_describe_cpu_ranks(cpu))
    print(f"compute per step {compute.step_s:.3f} s ({'given' if args.compute_s else 'measured here'}); predicted:")
    print(table(rows))
    print(recommendation(rows))
    if args.plot:
        plot_predictions(rows, args.plot, f"predicted (model): {setting}; compute {compute.step_s:.3f} s per step")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
