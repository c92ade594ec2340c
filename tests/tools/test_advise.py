"""The compress-or-not advisor: its measurements, its timeline arithmetic, its command line."""

import builtins
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torchvision.models import resnet18

from gc_strategy.communicators import EAGER_AFTER_BYTES, RunningExchange
from gc_strategy.fusion.timeline import Cost
from gc_strategy.fusion.topology import Link, Topology
from gc_strategy.sync.every_step.autotune import TRIAL_PLANS
from gc_strategy.tools import advise, advise_measure, advise_plots, contention
from gc_strategy.tools.advise import predict, recommendation
from gc_strategy.tools.advise_measure import Compute, CpuRanks, Profile, Replicas, profile

SHAPES = {"fc.weight": torch.Size([64, 300]), "fc.bias": torch.Size([64]), "conv.weight": torch.Size([32, 16, 3, 3])}
ELEMENTS = sum(s.numel() for s in SHAPES.values())


def test_replicas_hand_back_the_payloads_of_every_rank_without_a_network():
    payload = [torch.arange(4.0), torch.ones(2, dtype=torch.int32)]
    gathered = RunningExchange(Replicas(3, sums=False).exchange(payload, variable_size=True)).finish()
    assert len(gathered) == 3 and all(torch.equal(g[0], torch.arange(4.0)) for g in gathered)
    summed = RunningExchange(Replicas(3, sums=True).exchange([torch.arange(4.0)], variable_size=False)).finish()
    assert torch.equal(summed[0], 3 * torch.arange(4.0))


def test_profiles_count_the_bytes_each_compressor_sends():
    whole = ELEMENTS  # the largest sample bucket is the whole model
    none = profile({"compressor": "none"}, SHAPES, 4)
    assert none.sums and none.rounds == 1 and none.sizes[-1] == whole
    assert none.payload_bytes[-1] == 4 * whole
    bf16 = profile({"compressor": "bf16"}, SHAPES, 4)
    assert bf16.payload_bytes[-1] == 2 * whole
    topk = profile({"compressor": "topk", "memory": "residual", "density": 0.01}, SHAPES, 4)
    assert not topk.sums
    kept = sum(max(1, int(0.01 * s.numel())) for s in SHAPES.values())  # per tensor, fp32 values + int32 indices
    assert topk.payload_bytes[-1] == pytest.approx(8 * kept, rel=0.1)
    powersgd = profile({"compressor": "powersgd", "rank": 2, "start_iter": 0}, SHAPES, 4)
    assert powersgd.rounds == 2  # P, then Q
    assert powersgd.eager  # P is an eager round
    dgc = profile({"compressor": "dgc", "memory": "residual"}, SHAPES, 4)
    assert dgc.rounds == 1 and not dgc.eager  # a fixed capacity: no lengths to exchange
    assert not (none.eager or topk.eager)  # one round, and a fixed size
    assert all(t >= 0 for t in powersgd.encode_s + powersgd.decode_s + powersgd.between_s)
    # the casts around the node's collectives are timed only where they run: node_precision="bf16"
    assert none.narrow_s == none.widen_s == ()
    node_bf16 = profile({"compressor": "none", "hierarchy": "node", "node_precision": "bf16"}, SHAPES, 2)
    assert len(node_bf16.narrow_s) == len(node_bf16.widen_s) == len(node_bf16.sizes)
    assert all(t > 0 for t in node_bf16.narrow_s + node_bf16.widen_s)


def test_a_one_bucket_prediction_is_the_timeline_written_out():
    sizes = (100, 1000)
    measured = Profile(
        {"compressor": "x"}, sizes, (0.01, 0.02), (0.0, 0.005), (0.03, 0.04), (400, 4000), 2, True, False
    )
    compute = Compute(ready=(0.0, 0.1, 0.2), other=0.05)
    topology = Topology(2, 2, Link(1e9, 0.0), Link(1e6, 1e-3))
    numels = [300, 300, 400]
    step = predict(measured, numels, [3], compute, topology, codec_scale=2.0)
    encode, decode = 2 * 0.02, 2 * 0.04
    network = 2 * 3 * (2 * 1e-3 + 4000 / 4 / 1e6) + 2 * 0.005  # flat allreduce over 4 ranks at 1 MB/s, 2 rounds
    assert step == pytest.approx(0.05 + 0.2 + encode + network + decode)
    # one bucket: its owner encodes and decodes all of it, and its work between rounds (codec times 2)
    # holds the exchange; it is launched when backward ends, so waiting for a later launch costs nothing
    node_step = predict(replace(measured, options={"hierarchy": "node"}), numels, [3], compute, topology, 2.0)
    inside = 2 * (2 * 1 * 4000 / (2 * 1e9))  # reduce onto the owner and broadcast back, dense fp32
    across = 2 * 1 * (2 * 1e-3 + 4000 / (2 * 1e6))  # allreduce over the 2 nodes, 2 rounds
    assert node_step == pytest.approx(0.05 + 0.2 + encode + inside + across + 2 * 0.005 + decode)
    # node_precision="bf16": half the bytes inside the node, and device time for the casts (codec
    # times 2): every rank rounds to bf16 before the reduce and widens after the broadcast; the owner
    # widens the node's sum before it encodes and rounds the average before it broadcasts
    bf16 = replace(
        measured,
        options={"hierarchy": "node", "node_precision": "bf16"},
        narrow_s=(0.001, 0.002),
        widen_s=(0.0005, 0.003),
    )
    bf16_step = predict(bf16, numels, [3], compute, topology, 2.0)
    assert bf16_step == pytest.approx(node_step - inside / 2 + 2 * 2 * (0.002 + 0.003))
    # CPU ranks: the node's reduce (10 µs per byte) is compute before the launch, its broadcast (2 µs
    # per byte) compute with the decode; neither is on the link any more
    no_exchange = {(span, sums): Cost.linear(0.0, 0.0) for span in ("world", "across") for sums in (True, False)}
    reduce, broadcast = Cost.linear(0.0, 1e-5), Cost.linear(0.0, 2e-6)
    on_cpu = CpuRanks(Link(1e9, 0.0), reduce, broadcast, no_exchange)
    cpu_step = predict(replace(measured, options={"hierarchy": "node"}), numels, [3], compute, topology, 2.0, on_cpu)
    assert cpu_step == pytest.approx(0.05 + 0.2 + 1e-5 * 4000 + encode + across + 0.01 + decode + 2e-6 * 4000)
    assert predict(measured, numels, [3], compute, topology, 2.0, on_cpu) == pytest.approx(step)  # flat: no node


def test_on_cpu_ranks_an_exchange_holds_its_bucket_and_takes_the_compute_of_its_owner():
    """The exchange's compute on CPU ranks, 1 µs per byte over all ranks and 3 µs across nodes:
    device time that holds the bucket's exchange. Two buckets of 4000 and 1000 payload bytes on a
    free link: flat, every rank does both exchanges, the first while backward goes on. With the
    hierarchy the node's reduce is an eager round, and neither bucket is large enough for its
    launch to advance the rounds waiting (``EAGER_AFTER_BYTES``): both exchanges wait for the end of
    backward and hold the network in turn, each for the whole of its owner's work."""
    measured = Profile(
        {"compressor": "x"}, (100, 1000), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (400, 4000), 1, True, False
    )
    compute = Compute(ready=(0.0, 0.1, 0.2), other=0.05)
    free = Topology(2, 2, Link(1e15, 0.0), Link(1e15, 0.0))
    exchange = {
        (span, sums): Cost.linear(0.0, per_byte)
        for span, per_byte in (("world", 1e-6), ("across", 3e-6))
        for sums in (True, False)
    }
    on_cpu = CpuRanks(Link(1e15, 0.0), Cost.linear(0.0, 0.0), Cost.linear(0.0, 0.0), exchange)
    numels = [300, 700, 250]  # buckets of 1000 and 250 elements: 4000 and 1000 payload bytes
    flat = predict(measured, numels, [2, 1], compute, free, 1.0, on_cpu)
    assert flat == pytest.approx(0.05 + 0.2 + 1e-6 * (4000 + 1000))
    node = predict(replace(measured, options={"hierarchy": "node"}), numels, [2, 1], compute, free, 1.0, on_cpu)
    assert node == pytest.approx(0.05 + 0.2 + 3e-6 * (4000 + 1000))
    # a slow link: each bucket's allreduce over the 2 nodes, after the end of backward, one after the other
    slow = Topology(2, 2, Link(1e15, 0.0), Link(1e5, 0.0))
    link = 2 * 1 * (4000 + 1000) / (2 * 1e5)
    node = predict(replace(measured, options={"hierarchy": "node"}), numels, [2, 1], compute, slow, 1.0, on_cpu)
    assert node == pytest.approx(0.05 + 0.2 + link + 3e-6 * (4000 + 1000))


def test_an_exchange_with_an_eager_round_waits_for_a_later_large_launch():
    """An exchange whose round is eager (a gather's length handshake, PowerSGD's P, the node's
    reduce) goes on when the synchroniser advances it: at the launch of a later bucket of at least
    ``EAGER_AFTER_BYTES``, or at the end of backward. Two fp32 buckets of 1 MiB each, ready at 0 and
    0.1 s, with free codecs: the first bucket's exchange overlaps backward only if it does not wait."""
    quarter = EAGER_AFTER_BYTES // 4  # elements of a 1 MiB fp32 bucket
    measured = Profile(
        {"compressor": "x"}, (100, 1000), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (400, 4000), 1, True, False
    )
    topology = Topology(2, 2, Link(1e15, 0.0), Link(1e8, 0.0))
    alone = predict(measured, [quarter], [1], Compute(ready=(0.0,), other=0.0), topology, 1.0)  # one exchange
    assert 0 < alone < 0.1
    compute = Compute(ready=(0.0, 0.1), other=0.0)
    assert predict(measured, [quarter] * 2, [1, 1], compute, topology, 1.0) == pytest.approx(0.1 + alone)
    waiting = replace(measured, eager=True)
    assert predict(waiting, [quarter] * 2, [1, 1], compute, topology, 1.0) == pytest.approx(0.1 + 2 * alone)


def test_the_work_between_rounds_is_device_time():
    """PowerSGD orthogonalises between its rounds on the device that computes: with a free network,
    two buckets take the backward plus every encode, work between rounds and decode."""
    encode, between, decode = (0.01, 0.02), (0.005, 0.014), (0.03, 0.04)
    measured = Profile({"compressor": "x"}, (100, 1000), encode, between, decode, (400, 4000), 2, True, False)
    compute = Compute(ready=(0.0, 0.1, 0.2), other=0.05)
    free = Topology(2, 2, Link(1e15, 0.0), Link(1e15, 0.0))
    step = predict(measured, [300, 300, 400], [1, 2], compute, free, codec_scale=1.0)

    def at(points, n):  # linear between the sample buckets of 100 and 1000 elements
        return points[0] + (points[1] - points[0]) * (n - 100) / 900

    device = sum(at(points, n) for points in (encode, between, decode) for n in (300, 700))
    assert step == pytest.approx(0.05 + 0.2 + device)


def test_fusion_auto_is_predicted_with_the_best_plan_of_every_cut():
    """With ``fusion=auto`` the prediction is the synchroniser's search: the least simulated step over
    all 4 ways to cut 3 tensors, enumerated here."""
    sizes = (100, 1000)
    measured = Profile(
        {"compressor": "x"}, sizes, (0.01, 0.02), (0.0, 0.0), (0.001, 0.002), (400, 4000), 1, True, False
    )
    compute = Compute(ready=(0.0, 0.05, 0.1), other=0.05)
    topology = Topology(2, 1, Link(1e9, 0.0), Link(1e6, 1e-4))
    numels = [300, 300, 400]
    every_cut = [[3], [1, 2], [2, 1], [1, 1, 1]]
    times = [predict(measured, numels, groups, compute, topology, 1.0) for groups in every_cut]
    assert predict(measured, numels, None, compute, topology, 1.0) == pytest.approx(min(times))
    assert max(times) > min(times) * 1.05  # the cut matters here
    assert advise._plan({"compressor": "topk", "fusion": "auto"}, numels) is None
    assert advise._plan({"compressor": "topk", "fusion": "groups:3"}, numels) == [1, 1, 1]


def test_fusion_auto_over_a_node_is_never_predicted_slower_than_a_plan_it_tries():
    """Over a node the search sees one rank on average, the simulation the latest rank; the
    synchroniser keeps the fastest measured of its searched plan and the plans it tries, and so does
    the prediction. ResNet-18's tensors over 2 nodes × 4 CPU ranks: there the latest rank's plan is
    not the average rank's."""
    numels = [parameter.numel() for parameter in resnet18().parameters()][::-1]  # gradient-ready order
    sizes = (1000, 100_000, 2_000_000)
    measured = Profile(
        {"compressor": "x", "hierarchy": "node"}, sizes, (1e-4, 1e-3, 2e-2), (0.0,) * 3, (1e-4, 1e-3, 2e-2),
        (100, 10_000, 200_000), 1, True, False,
    )  # fmt: skip
    compute = Compute(ready=tuple(0.002 * i for i in range(len(numels))), other=0.01)
    topology = Topology(2, 4, Link(1e9, 1e-4), Link(1.25e8, 1e-3))
    on_cpu = CpuRanks(
        topology.intra, Cost.linear(5e-4, 2e-9), Cost.linear(5e-4, 1e-9),
        {("across", s): Cost.linear(0.0, 1e-9) for s in (True, False)},
    )  # fmt: skip
    tried = {
        plan.describe(): predict(measured, numels, plan.plan([4 * n for n in numels]), compute, topology, 1.0, on_cpu)
        for plan in TRIAL_PLANS
    }
    auto = predict(measured, numels, None, compute, topology, 1.0, on_cpu)
    assert auto <= min(tried.values()) + 1e-12, (auto, tried)


def test_configurations_that_differ_only_in_fusion_share_one_profile(monkeypatch):
    """Fusion does not change the codec: one profile serves every plan, so that ``fusion=auto``,
    the best plan of the model, is never predicted slower than a fixed plan by measurement noise."""
    calls = []
    monkeypatch.setattr(advise, "profile", lambda *args: calls.append(args) or profile(*args))
    compute = Compute(ready=(0.0, 0.01, 0.02), other=0.01)
    topology = Topology(2, 2, Link(1e9, 1e-5), Link(1e8, 1e-4))
    topk = "compressor=topk,memory=residual,density=0.1"
    configs = [topk, topk + ",fusion=auto", topk + ",fusion=groups:2", topk + ",hierarchy=node"]
    rows = {
        row["configuration"]: row["predicted step (s)"]
        for row in advise.advise(configs, SHAPES, compute, topology, 1.0)
    }
    assert len(calls) == 3  # the bf16 baseline, top-k among 4 ranks, top-k among the 2 nodes
    assert rows[topk + ",fusion=auto"] <= min(rows[topk], rows[topk + ",fusion=groups:2"]) + 1e-12


def test_rows_give_each_ranks_payload_and_the_bytes_across_nodes():
    """fp32 without compression sends 4 bytes per element: flat, every rank the whole model, and a
    ring of 4 ranks over 2 nodes crosses both boundaries with 2 (4 - 1) / 4 of it; with the hierarchy
    each of a node's 2 ranks sends half, and the 2 owners of a bucket exchange it whole."""
    compute = Compute(ready=(0.0, 0.01, 0.02), other=0.01)
    topology = Topology(2, 2, Link(1e9, 1e-5), Link(1e8, 1e-4))
    rows = {
        row["configuration"]: row
        for row in advise.advise(["compressor=none", "compressor=none,hierarchy=node"], SHAPES, compute, topology, 1.0)
    }
    flat, node = rows["compressor=none"], rows["compressor=none,hierarchy=node"]
    assert flat["payload bytes / rank / step"] == pytest.approx(4 * ELEMENTS)
    assert flat["bytes across nodes / step"] == pytest.approx(2 * 1.5 * 4 * ELEMENTS)
    assert node["payload bytes / rank / step"] == pytest.approx(2 * ELEMENTS)
    assert node["bytes across nodes / step"] == pytest.approx(2 * 4 * ELEMENTS)
    assert rows["compressor=bf16"]["bytes across nodes / step"] == pytest.approx(2 * 1.5 * 2 * ELEMENTS)
    assert "| bytes across nodes / step |" in advise.table(list(rows.values())).splitlines()[0]


def test_the_recommendation_is_the_fastest_only_where_it_pays():
    rows = [
        {"configuration": "compressor=bf16", "predicted step (s)": 1.0, "speedup vs bf16 allreduce": 1.0},
        {"configuration": "compressor=topk", "predicted step (s)": 0.5, "speedup vs bf16 allreduce": 2.0},
    ]
    assert recommendation(rows).startswith("compress: compressor=topk (2.00x")
    assert "tie" not in recommendation(rows)
    close = {"configuration": "compressor=powersgd", "predicted step (s)": 0.505, "speedup vs bf16 allreduce": 1.98}
    assert recommendation([*rows, close]).endswith(
        "a tie within 2% (the model's run-to-run spread is larger), measure: compressor=powersgd"
    )
    far = {**close, "predicted step (s)": 0.515}
    assert "tie" not in recommendation([*rows, far])
    rows[1].update({"predicted step (s)": 0.98, "speedup vs bf16 allreduce": 1.02})
    assert recommendation(rows).startswith("do not compress")


def _advise(*args):
    return subprocess.run(
        [sys.executable, "-m", "gc_strategy.advise", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0", "--configs", "compressor=none"], "--nodes = 0 is invalid"),
        (["--model", "resnet7", "--configs", "compressor=none"], "--model = 'resnet7' is invalid; allowed: resnet18"),
        (["--inter", "fast", "--configs", "compressor=none"], "--inter = 'fast' is invalid"),
        (["--inter-latency-us", "-1", "--configs", "compressor=none"], "--inter-latency-us = -1.0 is invalid"),
        (["--configs", "compressor=zip"], "unknown compressor 'zip'"),
        (["--configs", "compressor=none,hierarchy=ring"], "hierarchy = 'ring' is invalid"),
        (["--configs", "compressor=none,node_precision=bf16"], "node_precision = 'bf16' applies to the reduction"),
        (["--project", "--configs", "compressor=none"], "--project: --model = 'resnet18' is invalid"),
        (["--model", "resnet50", "--project", "--configs", "compressor=sidco"], "compressor = 'sidco' has no GPU"),
        (["--intra", "measure", "--ranks-per-node", "1", "--configs", "compressor=none"], "--ranks-per-node >= 2"),
        (["--plot", "/no/such/dir/a.png", "--configs", "compressor=none"], "allowed: a file in a folder that exists"),
    ],
)
def test_bad_input_is_refused_before_any_measurement(args, message, capsys, monkeypatch):
    monkeypatch.setattr(advise, "measure_compute", None)  # any measurement would fail differently
    with pytest.raises(SystemExit) as stop:
        advise.main(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_command_line_prints_the_table_and_a_recommendation_and_plots_them(tmp_path):
    topk = "compressor=topk,memory=residual,density=0.01"
    plot = tmp_path / "advice.png"
    done = _advise(
        "--batch", "2", "--size", "16", "--nodes", "2", "--ranks-per-node", "2", "--inter", "100mbit",
        "--configs", topk, f"{topk},hierarchy=node", "--plot", str(plot),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "2 node(s) x 2 rank(s)" in lines[0] and "| compressor=bf16 |" in done.stdout
    assert lines[-2].startswith("compress: compressor=topk")  # at 100 Mbit/s a 1% payload must win
    assert lines[-1] == f"plot: {plot}" and plot.read_bytes().startswith(b"\x89PNG")


def test_a_projection_grows_the_cluster_and_plots_the_speedups(monkeypatch, tmp_path):
    """ResNet-18 stands in for the projection's models (their shapes take longer to profile): fp16
    sends the bf16 allreduce's bytes at the same GPU cost, so it is the baseline's speed everywhere;
    flat top-k's gathered payload grows with the ranks while the allreduce's stays flat, so its
    speedup falls as the cluster grows. The casts of ``node_precision=bf16`` are priced at the
    GPU's speed, as the bf16 compressor's codec: about 0.1 ms a step here, where this CPU's would
    take 10 ms or more."""
    monkeypatch.setitem(advise.PROJECTION, "resnet18", (64, 224, 3 * 1.8e9))
    topk = "compressor=topk,memory=residual,density=0.01"
    node, bf16 = "compressor=fp16,hierarchy=node", "compressor=fp16,hierarchy=node,node_precision=bf16"
    configs = ["compressor=fp16", topk, f"{topk},hierarchy=node", node, bf16]
    projection = advise.project("resnet18", configs, [8, 64, 1024], ["25gbit"])
    for times in projection.seconds.values():
        assert abs(times[bf16] - times[node]) < 1e-3
    assert list(projection.seconds) == [("25gbit", 8), ("25gbit", 64), ("25gbit", 1024)]
    speedups = projection.speedups()
    for count in (8, 64, 1024):
        assert speedups["25gbit", count]["compressor=fp16"] == pytest.approx(1.0)
    assert speedups["25gbit", 1024][topk] < speedups["25gbit", 64][topk] / 2
    table = projection.table().splitlines()
    assert table[0].startswith("PROJECTION (model, not measurement): resnet18")
    assert len(table) == 4 + 3 and table[-1].startswith("| 25gbit | 1024 |")
    plot = tmp_path / "projection.png"
    advise_plots.plot_projection(projection.title, speedups, str(plot))
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_measured_cpu_ranks_price_every_collective_with_the_compute_it_takes():
    topk = "compressor=topk,memory=residual,density=0.01"
    done = _advise(
        "--batch", "2", "--size", "16", "--nodes", "1", "--ranks-per-node", "2", "--intra", "measure",
        "--configs", f"{topk},hierarchy=node", topk,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("CPU ranks, measured beside"))
    seconds = [float(word) for word in line.split() if word.replace(".", "", 1).isdigit() and "." in word]
    reduce, broadcast, allreduce, allgather, across_allreduce, across_allgather = seconds
    assert min(reduce, broadcast, allreduce, allgather) >= 0
    assert across_allreduce == across_allgather == 0.0  # one node: nothing across
    assert "| compressor=topk" in done.stdout
    setting = done.stdout.splitlines()[0]
    inside = _between(setting, "inside a node ", " Gbit/s")
    assert float(inside) > 0  # the link measured from the same broadcasts
    # a message between nodes waits as long as one inside, on top of the given 50 µs
    latency_inside = float(_between(setting, " Gbit/s, ", " µs;"))
    latency_between = float(_between(setting.split("between nodes")[1], " Gbit/s, ", " µs"))
    assert latency_between == pytest.approx(latency_inside + 50, rel=1e-3)


def _between(line: str, start: str, end: str) -> str:
    return line.split(start, 1)[1].split(end, 1)[0]


def test_cpu_ranks_are_measured_from_broadcasts_alone_and_what_each_collective_takes(monkeypatch):
    """Broadcasts alone of 4 MB and 32 MB taking 1 ms + n / (2 GB/s), and a small message's latency of
    1 ms + 4 KB / (2 GB/s) over the nodes asked for: a link of 2 GB/s and 1 ms. What
    the node's reduce and broadcast, and the exchanges over all ranks and across nodes, take from the
    step beside them is kept as a curve through zero; one node has no exchange across."""
    lost_per_byte = {("node", "reduce"): 4e-9, ("node", "broadcast"): 1e-9, ("world", "allreduce"): 2e-9}
    lost_per_byte |= {("world", "allgather"): 8e-9, ("across", "allreduce"): 3e-9, ("across", "allgather"): 5e-9}
    asked = []

    def measured(nodes, ranks_per_node, step, sizes, collectives, runs, span="node"):
        asked.append((span, collectives))
        assert sizes == (advise_measure.INSIDE_BYTES if span == "node" else advise_measure.EXCHANGE_BYTES)
        return {
            (c, n): contention.Beside(0.1, 1e-3 + n / 2e9, 0.1 + lost_per_byte[span, c] * n)
            for c in collectives
            for n in sizes
        }

    def latency(nodes, ranks_per_node):
        asked.append(("latency", (nodes, ranks_per_node)))
        return 1e-3 + contention.MESSAGE_BYTES / 2e9

    monkeypatch.setattr(contention, "measure", measured)
    monkeypatch.setattr(contention, "latency", latency)
    cpu = advise_measure.measure_cpu_ranks(2, 2, lambda: None)
    assert cpu.link.bandwidth == pytest.approx(2e9) and cpu.link.latency == pytest.approx(1e-3)
    assert cpu.reduce(32 << 20) == pytest.approx(4e-9 * (32 << 20)) and cpu.broadcast(1e6) == pytest.approx(1e-3)
    assert cpu.reduce(0) == 0.0
    for (span, collective), per_byte in lost_per_byte.items():
        if span != "node":
            assert cpu.exchange[span, collective == "allreduce"](3e6) == pytest.approx(per_byte * 3e6)
    assert asked[-1] == ("latency", (2, 2))
    assert [span for span, _ in asked] == ["node", "world", "across", "latency"]
    asked.clear()
    one_node = advise_measure.measure_cpu_ranks(1, 2, lambda: None)
    assert [span for span, _ in asked] == ["node", "world", "latency"]
    assert one_node.exchange["across", True](1e6) == 0.0 and one_node.exchange["world", False](1e6) > 0
    asked.clear()
    flat_only = advise_measure.measure_cpu_ranks(2, 2, lambda: None, spans=("world",))
    assert [span for span, _ in asked] == ["node", "world", "latency"]
    assert set(flat_only.exchange) == {("world", True), ("world", False)}
    with pytest.raises(ValueError, match=r"spans = \['nodes'\] are invalid; allowed: 'world', 'across'"):
        advise_measure.measure_cpu_ranks(2, 2, lambda: None, spans=("world", "nodes"))


def test_a_plot_without_matplotlib_is_refused_naming_the_extra(monkeypatch):
    real_import = builtins.__import__

    def without_matplotlib(name, *args, **kwargs):
        if name == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_matplotlib)
    message = r"--plot a.png: needs matplotlib; install it with pip install 'gc-strategy\[app\]'"
    with pytest.raises(ValueError, match=message):
        advise_plots.check_can_plot("a.png")
