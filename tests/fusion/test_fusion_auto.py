"""fusion=auto: the timeline model, the exact search, the profiler and plan files (docs/algorithms.md §8)."""

import itertools
import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from models import SmallCNN

from gc_strategy import GCFusedStrategy, GradientSynchronizer, build_components
from gc_strategy.fusion import AutoPlanner, Cost, CostModel, FilePlanner, best_plan, parse_fusion, simulate
from gc_strategy.fusion.timeline import Node
from gc_strategy.tools.ranks import run_ranks

FREE = Cost.linear(0.0, 0.0)


def all_plans(count: int):
    """Every contiguous partition of ``count`` tensors: 2^(count-1) plans."""
    for cuts in itertools.product([False, True], repeat=count - 1):
        groups, size = [], 1
        for cut in cuts:
            if cut:
                groups.append(size)
                size = 1
            else:
                size += 1
        yield groups + [size]


def random_curve(rng: random.Random, scale: float, flat: float) -> Cost:
    """Rising through up to 4 points; each step is level with probability ``flat`` (as measured
    communication costs often are: many plans then take the same time)."""
    sizes = sorted(rng.sample(range(1, 200_000), rng.randint(1, 4)))
    steps = [0.0 if rng.random() < flat else rng.uniform(0, scale) for _ in sizes]
    return Cost.measured(sizes, list(itertools.accumulate(steps)))


@pytest.mark.parametrize("advance_at", [None, 60_000])
@pytest.mark.parametrize("flat", [0.0, 0.5])
@pytest.mark.parametrize("seed", range(40))
def test_search_matches_exhaustive_enumeration(seed, flat, advance_at):
    rng = random.Random(seed)
    count = rng.randint(1, 12)
    ready = sorted(rng.uniform(0, 0.1) for _ in range(count))
    model = CostModel(
        tuple(r - ready[0] for r in ready),
        tuple(rng.randint(1, 100_000) for _ in range(count)),
        random_curve(rng, 0.01, flat),
        random_curve(rng, 0.03, flat),
        random_curve(rng, 0.01, flat),
        other=rng.uniform(0, 0.1),
        between=random_curve(rng, 0.01, flat) if seed % 2 else FREE,
        advance_at=advance_at,
    )
    exhaustive = min(simulate(model, plan) for plan in all_plans(count))
    groups, predicted = best_plan(model)
    assert sum(groups) == count
    assert simulate(model, groups) == pytest.approx(exhaustive, rel=1e-12)
    assert predicted == pytest.approx(exhaustive, rel=1e-12)


def test_simulation_of_a_two_bucket_plan_by_hand():
    # tensors ready at 0, 1, 2 s with 10, 20, 30 elements; encode 0.1 + 0.01/elem, communicator 1 + 0.1/elem,
    # decode 0.5 flat; plan [2, 1]
    model = CostModel(
        (0.0, 1.0, 2.0), (10, 20, 30), Cost.linear(0.1, 0.01), Cost.linear(1.0, 0.1), Cost.linear(0.5, 0.0), other=3.0
    )
    # bucket 1 (30 elements): ready at 1, encode 0.4 -> launch 1.4, communicator 4 -> ends 5.4
    # bucket 2 (30 elements): ready at 2 + 0.4, encode 0.4 -> launch 2.8, communicator starts 5.4 -> ends 9.4
    # end: max(backward 2.8 + decodes 1.0, 9.4 + last decode 0.5) = 9.9, + other 3
    assert simulate(model, [2, 1]) == pytest.approx(12.9)


def test_work_between_rounds_occupies_the_device_and_delays_the_next_round():
    # as above, with 0.2 s of device work between each bucket's rounds
    slow = CostModel(
        (0.0, 1.0, 2.0),
        (10, 20, 30),
        Cost.linear(0.1, 0.01),
        Cost.linear(1.0, 0.1),
        Cost.linear(0.5, 0.0),
        other=3.0,
        between=Cost.linear(0.2, 0.0),
    )
    # network bound: bucket 1 ends at 1.4 + 4 + 0.2 = 5.6, bucket 2 at 5.6 + 4.2 = 9.8; + last decode 0.5 + other 3
    assert simulate(slow, [2, 1]) == pytest.approx(13.3)
    # device bound (a cheap network): backward 2 + encodes 0.8 + between 0.4 + decodes 1.0, + other 3
    fast = CostModel(slow.ready, slow.numels, slow.encode, Cost.linear(0.01, 0.0), slow.decode, 3.0, slow.between)
    assert simulate(fast, [2, 1]) == pytest.approx(7.2)
    assert CostModel.from_dict(fast.to_dict()) == fast


def test_an_exchange_waiting_on_an_eager_round_starts_at_a_later_large_launch():
    # the model above, one tensor per bucket: buckets of 10, 20 and 30 elements launch at 0.2, 1.5, 2.9
    model = CostModel(
        (0.0, 1.0, 2.0), (10, 20, 30), Cost.linear(0.1, 0.01), Cost.linear(1.0, 0.1), Cost.linear(0.5, 0.0), other=3.0
    )
    # at once: communicators end at 0.2 + 2 = 2.2, 2.2 + 3 = 5.2, 5.2 + 4 = 9.2; + last decode 0.5 + other 3
    assert simulate(model, [1, 1, 1]) == pytest.approx(12.7)
    # buckets of 15 elements or more advance the waiting ones: the first goes at 1.5 (ends 3.5), the
    # second at 2.9 (ends 6.5), the last at the end of backward (2.9): ends 10.5
    assert simulate(replace(model, advance_at=15), [1, 1, 1]) == pytest.approx(14.0)
    # only the last bucket advances: the first two go at 2.9 (end 4.9, 7.9), the last after them (11.9)
    assert simulate(replace(model, advance_at=25), [1, 1, 1]) == pytest.approx(15.4)
    assert CostModel.from_dict(replace(model, advance_at=25).to_dict()).advance_at == 25


def test_on_a_node_each_bucket_is_coded_by_its_owner_and_the_step_is_the_latest_ranks():
    # the model above, one tensor per bucket, on a node of 2 ranks that each reduce 1 ms per element
    # and broadcast in 0.05 s; the buckets of 10, 20, 30 elements are owned by ranks 0, 1, 0
    model = CostModel(
        (0.0, 1.0, 2.0), (10, 20, 30), Cost.linear(0.1, 0.01), Cost.linear(1.0, 0.1), Cost.linear(0.5, 0.0), other=3.0
    )
    node = Node(2, Cost.linear(0.0, 0.001), Cost.linear(0.05, 0.0))
    # rank 0: reduces 0.01 + encode 0.2, 0.02, 0.03 + encode 0.4 -> launches at 0.21 and 2 + 0.66;
    # rank 1: 0.01, 0.02 + encode 0.3 -> launch 1 + 0.33. Communicators end 2.21, 5.21, 9.21;
    # + the owner's decode 0.5 + the broadcast 0.05 + other 3
    assert simulate(model, [1, 1, 1], node) == pytest.approx(12.76)
    # a cheap network: rank 0's device, backward 2 + 0.66 + its decodes 1.0 + three broadcasts 0.15, + other 3
    cheap = CostModel(model.ready, model.numels, model.encode, Cost.linear(0.01, 0.0), model.decode, 3.0)
    assert simulate(cheap, [1, 1, 1], node) == pytest.approx(6.81)
    # the plan search's costs: each rank's mean
    mean = node.mean(cheap)
    for n in (5, 20, 100):
        assert mean.encode(n) == pytest.approx(0.001 * n + (0.1 + 0.01 * n) / 2)
        assert mean.decode(n) == pytest.approx(0.05 + 0.5 / 2)
        assert mean.comm(n) == pytest.approx(0.01)


def test_costs_add_exactly():
    a, b = Cost.measured([10, 100], [1.0, 2.0]), Cost.measured([50, 200, 400], [0.5, 0.7, 3.0])
    for n in (0, 10, 30, 50, 99, 150, 300, 400, 1000):
        assert (a + b)(n) == pytest.approx(a(n) + b(n))


def test_free_network_gives_one_bucket():
    model = CostModel(
        tuple(float(i) for i in range(8)), (1000,) * 8, Cost.linear(0.01, 1e-6), FREE, Cost.linear(0.01, 1e-6)
    )
    assert best_plan(model)[0] == [8]


def test_free_compression_and_costly_startup_give_one_bucket():
    model = CostModel(tuple(0.001 * i for i in range(10)), (1000,) * 10, FREE, Cost.linear(5.0, 1e-9), FREE)
    assert best_plan(model)[0] == [10]


def test_costly_bytes_and_cheap_startup_give_layerwise():
    # each tensor's collective (0.9 s) ends before the next tensor is ready (1 s later): send at once
    model = CostModel(
        tuple(float(i) for i in range(6)),
        (1000,) * 6,
        Cost.linear(1e-6, 0.0),
        Cost.linear(1e-6, 9e-4),
        Cost.linear(1e-6, 0.0),
    )
    assert best_plan(model)[0] == [1] * 6


def test_cost_curves_interpolate_and_extrapolate():
    cost = Cost.measured([100, 10, 1000, 100], [3.0, 1.0, 5.0, 2.0])  # unsorted, a repeated size
    assert cost.sizes == (10.0, 100.0, 1000.0)
    assert cost.seconds == (1.0, 2.5, 5.0)  # the median of the repeated size
    assert cost(0) == 1.0 and cost(55) == pytest.approx(1.75) and cost(1900) == pytest.approx(7.5)
    assert Cost.linear(2.0, 0.5)(10) == pytest.approx(7.0)


def test_measured_costs_that_fall_as_the_size_grows_are_pooled():
    """Isotonic regression of the medians, weighted by the measurements per size."""
    assert Cost.measured([1, 2, 3], [1.0, 3.0, 2.0]).seconds == pytest.approx((1.0, 2.5, 2.5))
    # size 2 measured three times (median 3.0) outweighs size 3 measured once (2.0): (3·3 + 2) / 4
    assert Cost.measured([1, 2, 2, 2, 3], [1.0, 3.0, 2.9, 3.1, 2.0]).seconds == pytest.approx((1.0, 2.75, 2.75))
    assert Cost.measured([1, 2, 3], [1.0, 2.0, 4.0]).seconds == (1.0, 2.0, 4.0)


@pytest.mark.parametrize("columns", [3, 4])
@pytest.mark.parametrize("chunk", [3, 128])
def test_pareto_keeps_exactly_the_undominated_rows(chunk, columns):
    """Against the definition, on labels with many ties (a row equal to an earlier one is dropped)
    and more rows than one chunk."""
    from gc_strategy.fusion.timeline import _pareto

    rng = np.random.default_rng(chunk)
    labels = rng.integers(0, 6, size=(400, columns)).astype(float)
    kept = set(_pareto(labels).tolist())
    for i, row in enumerate(labels):
        dominated = any(
            np.all(labels[j] <= row) and (np.any(labels[j] < row) or j < i) for j in range(len(labels)) if j != i
        )
        assert (i not in kept) == dominated, (i, row)


def test_search_on_314_tensors_is_consistent_and_beats_single_and_layerwise():
    """Its time is reported by benchmarks/fusion_auto.py, not asserted here."""
    rng = random.Random(0)
    count = 314
    numels = tuple(rng.randint(64, 2_400_000) for _ in range(count))
    model = CostModel(
        tuple(sorted(rng.uniform(0, 0.5) for _ in range(count))),
        numels,
        Cost.measured([1e3, 1e6, 1e7, 4e7], [2e-4, 4e-3, 0.15, 0.9]),
        Cost.measured([1e3, 1e7], [5e-4, 0.04]),
        Cost.measured([1e3, 1e6, 1e7], [1e-4, 5e-3, 0.2]),
    )
    groups, predicted = best_plan(model)
    assert predicted == pytest.approx(simulate(model, groups))
    assert predicted <= min(simulate(model, [count]), simulate(model, [1] * count))


def test_fit_recovers_the_scales_of_compression_and_communication():
    from gc_strategy.sync.every_step.autotune import fit_scales

    profiled = CostModel(
        ready=tuple(0.02 * i for i in range(8)),
        numels=tuple(1000 * (i + 1) for i in range(8)),
        encode=Cost.linear(0.001, 3e-6),
        comm=Cost.linear(0.004, 2e-6),
        decode=Cost.linear(0.0005, 2e-6),
        other=0.05,
    )
    truth = CostModel(
        profiled.ready,
        profiled.numels,
        Cost.linear(0.002, 6e-6),
        Cost.linear(0.001, 5e-7),
        Cost.linear(0.001, 4e-6),
        other=0.05,
    )  # compression 2x, communication 1/4
    trials = [[1] * 8, [2] * 4, [4, 4], [8], [3, 5]]
    measured = {tuple(g): simulate(truth, g) for g in trials}
    (a, b), fitted = fit_scales(profiled, measured)
    assert a == pytest.approx(2.0, rel=0.03) and b == pytest.approx(0.25, rel=0.03)
    for groups in ([1, 7], [2, 2, 2, 2], [5, 1, 1, 1]):  # plans not in the fit
        assert simulate(fitted, groups) == pytest.approx(simulate(truth, groups), rel=0.02)
    (a, b), _ = fit_scales(profiled, {tuple(g): 1e-6 for g in trials})  # out of range: clamped
    assert a == pytest.approx(1 / 8) and b == pytest.approx(1 / 8)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("auto:0", "fusion = 'auto:0' is invalid"),
        ("auto:x", "fusion = 'auto:x' is invalid"),
        ("file:/nonexistent/plan.json", "fusion = 'file:/nonexistent/plan.json': not a readable plan file"),
    ],
)
def test_bad_auto_and_file_specs_are_refused(spec, message):
    with pytest.raises(ValueError) as error:
        GCFusedStrategy(fusion=spec)
    assert message in str(error.value)


def test_auto_spec_forms():
    assert isinstance(parse_fusion("auto"), AutoPlanner) and parse_fusion("auto").profile_steps == 5
    assert parse_fusion("auto:3").profile_steps == 3 and parse_fusion("auto:3").describe() == "auto:3"


def _train(model, synchronizer, steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 3, 8, 8, generator=generator)
        torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,), generator=generator)).backward()
        optimizer.step()


def test_the_profile_times_compression_on_raw_local_gradients_not_on_averages(monkeypatch):
    """After a synchronised step ``.grad`` holds the (here sparse) average; the cost samples must be
    the gradients the compressor sees in training: those of a plain backward, computed here alone."""
    import copy

    from gc_strategy.sync.every_step import autotune as auto

    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    expected = torch.autograd.grad(torch.nn.functional.cross_entropy(reference(x), y), list(reference.parameters()))
    seen = {}

    def capture(synchronizer, gradients):
        seen.update(gradients=dict(gradients), names=list(synchronizer.names))
        raise KeyboardInterrupt  # stop here: the samples are what is checked

    monkeypatch.setattr(auto, "measure_costs", capture)
    c = build_components("topk", "residual", density=0.05, fusion="auto:2")
    synchronizer = GradientSynchronizer(model, c)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):  # no optimizer step: the same gradient every step
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
    assert synchronizer.tuner.phase == "profile"  # stopped where the profile takes its samples
    names = [name for name, _ in reference.named_parameters()]
    assert sorted(seen["gradients"]) == sorted(names)
    for name, want in zip(names, expected):
        torch.testing.assert_close(seen["gradients"][name], want.flatten())
    assert (model.conv1.weight.grad == 0).float().mean() > 0.5  # the averages are sparse: not what was timed


@pytest.mark.parametrize("compressor, waits", [("powersgd", True), ("none", False)])
def test_the_planner_knows_which_exchanges_wait_for_an_eager_round(compressor, waits):
    """PowerSGD's P is an eager round: its Q waits for the synchroniser to advance it, and the searched
    plan's model says so (the sizes of the buckets whose launch advances it, in elements)."""
    from gc_strategy.communicators import EAGER_AFTER_BYTES

    torch.manual_seed(0)
    model = SmallCNN()
    c = build_components(compressor, "none", fusion="auto:1")
    synchronizer = GradientSynchronizer(model, c)
    while synchronizer.tuner.phase != "done":
        _train(model, synchronizer, 1)
    assert synchronizer.plan_report["cost_model"]["advance_at"] == (EAGER_AFTER_BYTES / 4 if waits else None)


def _auto_plans_agree_and_survive(rank, world_size, plan_path):
    torch.manual_seed(0)
    model = SmallCNN()
    c = build_components("topk", "residual", density=0.1, fusion="auto:2")
    synchronizer = GradientSynchronizer(model, c)
    planning_steps = 0
    while synchronizer.tuner.phase != "done":  # order, settle, profile, trials, verify
        _train(model, synchronizer, 1, seed=rank + 100 * planning_steps)
        planning_steps += 1
    _train(model, synchronizer, 1, seed=rank)
    report = synchronizer.plan_report
    if rank == 0:
        synchronizer.export_plan(plan_path)
    state = synchronizer.state_dict()
    # resume: a fresh synchroniser with fusion=auto restores the plan instead of profiling again
    restored_model = SmallCNN()
    c2 = build_components("topk", "residual", density=0.1, fusion="auto:2")
    restored = GradientSynchronizer(restored_model, c2)
    restored.load_state_dict(state)
    torch.distributed.barrier()
    from_file_model = SmallCNN()
    c3 = build_components("topk", "residual", density=0.1, fusion=f"file:{plan_path}")
    from_file = GradientSynchronizer(from_file_model, c3)
    _train(from_file_model, from_file, 2, seed=rank)
    return {
        "groups": synchronizer.layout.tensors_per_bucket,
        "order": synchronizer.layout.order,
        "report": {
            k: report[k]
            for k in (
                "groups",
                "predicted_step_s",
                "measured_step_s",
                "predicted_fp32_allreduce_s",
                "trials",
                "searched_groups",
                "searched_measured_step_s",
            )
        },
        "planning_steps": planning_steps,
        "restored": (
            restored.layout.tensors_per_bucket,
            restored.layout.order,
            restored.tuner.phase,
            restored.plan_report["groups"],
        ),
        "from_file": (from_file.layout.tensors_per_bucket, from_file.layout.order),
    }


@pytest.mark.slow
def test_auto_plan_is_the_same_on_every_rank_and_survives_resume_and_files(tmp_path):
    plan_path = str(tmp_path / "plan.json")
    results = run_ranks(_auto_plans_agree_and_survive, 2, plan_path)
    first = results[0]
    assert all(r["groups"] == first["groups"] and r["order"] == first["order"] for r in results)
    report = first["report"]
    assert report["groups"] == first["groups"]
    assert report["predicted_step_s"] > 0 and report["measured_step_s"] > 0 and report["predicted_fp32_allreduce_s"] > 0
    # SmallCNN's 8 tensors: the default plan (1 bucket), layerwise, groups:2, groups:4 (8 and 16 are layerwise)
    assert [len(t["groups"]) for t in report["trials"]] == [1, 8, 2, 4]
    assert (
        first["planning_steps"] == 2 + 2 + 3 * 2 + 2
    )  # settle (the first records the order), profile, 3 trials, verify
    # the plan kept is the fastest measured one
    candidates = {tuple(t["groups"]): t["measured_step_s"] for t in report["trials"]}
    candidates[tuple(report["searched_groups"])] = report["searched_measured_step_s"]  # verified
    assert report["measured_step_s"] == min(candidates.values())
    assert candidates[tuple(report["groups"])] == report["measured_step_s"]
    for r in results:
        assert r["restored"] == (first["groups"], first["order"], "done", first["groups"])
        assert r["from_file"] == (first["groups"], first["order"])
    with open(plan_path) as f:
        saved = json.load(f)
    assert saved["groups"] == first["groups"] and saved["order"] == first["order"]


def test_a_plan_file_for_another_model_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    model = SmallCNN()
    names = [name for name, _ in reversed(list(model.named_parameters()))]
    numels = [p.numel() for _, p in reversed(list(model.named_parameters()))]
    path.write_text(
        json.dumps({"format": 1, "order": names[:-1] + ["other.weight"], "numels": numels, "groups": [len(names)]})
    )
    c = build_components(fusion=f"file:{path}")
    with pytest.raises(ValueError) as error:
        GradientSynchronizer(model, c)
    message = str(error.value)
    assert "does not match this model" in message and "other.weight" in message and names[-1] in message
    path.write_text(json.dumps({"format": 1, "order": names, "numels": numels, "groups": [1, 1]}))
    with pytest.raises(ValueError, match="do not cover its"):
        FilePlanner(str(path))
