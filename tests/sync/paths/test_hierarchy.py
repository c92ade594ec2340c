"""hierarchy="node" on gloo ranks grouped into emulated nodes: the average equals the flat one for
compressor=none and torch's DDP's on real training patterns, the plain math for top-k, every
compressor keeps the replicas identical, an overflow on one rank reaches no rank's error-feedback
memory, and a bad layout fails with an error that names it on every rank."""

import contextlib
import re

import pytest
import torch
from compressor_helpers import SMALL_MODEL_OPTIONS
from models import SmallCNN
from torch.nn.parallel import DistributedDataParallel

from gc_strategy import COMPRESSORS, EveryStep, GCFusedStrategy, GradientSynchronizer, NodeHierarchy, build_components
from gc_strategy.fusion.timeline import bucket_owners
from gc_strategy.integrations.checkpoint import load_rank_states, save_rank_states
from gc_strategy.sync.modes import Replicated
from gc_strategy.sync.paths.hierarchy import hierarchy_of
from gc_strategy.tools.ranks import run_ranks

OPTIONS = {**SMALL_MODEL_OPTIONS, "powersgd": dict(start_iter=1), "acpsgd": dict(start_iter=1)}


def _synchronizer(
    model,
    name,
    ranks_per_node,
    hierarchy="node",
    memory=None,
    node_precision="full",
    fusion="groups:3",
    find_unused_parameters=False,
    **options,
):
    keeps_own = COMPRESSORS.get(name).OPTIONS.get("use_error_feedback") is not None
    memory = memory or ("none" if keeps_own or name == "none" else "residual")
    c = build_components(name, memory, "auto", fusion, **{**OPTIONS.get(name, {}), **options})
    if hierarchy == "node":
        hierarchy = NodeHierarchy(precision=node_precision, ranks_per_node=ranks_per_node)
    return EveryStep().build(model, c, Replicated(hierarchy=hierarchy, find_unused_parameters=find_unused_parameters))


def _batch(rank, step):
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_buckets_are_dealt_to_local_ranks_by_bytes():
    assert bucket_owners([100, 10, 10, 10, 50], 2) == [0, 1, 1, 1, 1]
    assert bucket_owners([5, 5, 5], 1) == [0, 0, 0]


def _none_against_flat(rank, world_size, ranks_per_node):
    torch.manual_seed(0)
    flat_model, node_model = SmallCNN(), SmallCNN()
    node_model.load_state_dict(flat_model.state_dict())
    flat, node = (
        _synchronizer(flat_model, "none", ranks_per_node, "flat"),
        _synchronizer(node_model, "none", ranks_per_node),
    )
    worst = 0.0
    for step in range(3):
        for model in (flat_model, node_model):
            model.zero_grad(set_to_none=True)
            model(_batch(rank, step)).square().mean().backward()
        a, b = _grads(flat_model), _grads(node_model)
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    sent = node.telemetry.last
    return (
        worst,
        flat.layout.tensors_per_bucket == node.layout.tensors_per_bucket,
        sent.raw_bytes,
        sent.sent_bytes,
        sent.node_bytes,
    )


@pytest.mark.slow
def test_none_averages_equal_the_flat_ones_on_two_nodes_of_two():
    """Sums in another order: equal to fp32 rounding, |Δ| ≤ 1e-6 · max|g|, on every rank. Each rank
    sends its buckets' share across nodes (the two ranks of a node together: every byte once) and
    reduces and broadcasts every bucket inside the node."""
    results = run_ranks(_none_against_flat, 4, 2)
    for worst, same_buckets, raw, _, inside in results:
        assert same_buckets and worst <= 1e-6
        assert inside == 2 * raw
    for node in (results[:2], results[2:]):
        assert sum(sent for *_, sent, _ in node) == node[0][2] > 0


class _Branchy(torch.nn.Module):
    """SmallCNN and a layer that a rank uses on some steps only."""

    def __init__(self):
        super().__init__()
        self.body, self.branch = SmallCNN(), torch.nn.Linear(10, 10)

    def forward(self, x, use_branch):
        out = self.body(x)
        return self.branch(out) if use_branch else out


def _against_torch_ddp(rank, world_size, ranks_per_node):
    """compressor=none over nodes against torch's DistributedDataParallel, for each training
    pattern: plain steps, 2 micro-batches accumulated under ``no_sync()``, and a layer each rank
    uses on a third of the steps (``find_unused_parameters=True``). SGD with momentum."""
    results = {}
    for pattern in ("plain", "accumulate", "unused"):
        torch.manual_seed(0)
        reference, model = _Branchy(), _Branchy()
        model.load_state_dict(reference.state_dict())
        ddp = DistributedDataParallel(reference, find_unused_parameters=True, broadcast_buffers=False)
        synchronizer = _synchronizer(model, "none", ranks_per_node, find_unused_parameters=True)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, model)]
        worst, same_none = 0.0, True
        for step in range(4):
            micro = 2 if pattern == "accumulate" else 1
            for m in range(micro):
                x = _batch(rank, 10 * step + m)
                use_branch = pattern == "unused" and (step + rank) % 3 == 0
                wait = m < micro - 1
                for net, sync in ((ddp, ddp), (model, synchronizer)):
                    with sync.no_sync() if wait else contextlib.nullcontext():
                        net(x, use_branch).square().mean().backward()
            pairs = list(zip(reference.parameters(), model.parameters()))
            same_none &= all((a.grad is None) == (b.grad is None) for a, b in pairs)
            both = [(a.grad, b.grad) for a, b in pairs if a.grad is not None and b.grad is not None]
            largest = max(float(a.abs().max()) for a, _ in both)
            worst = max(worst, max(float((a - b).abs().max()) for a, b in both) / largest)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        drift = max(float((a - b).abs().max()) for a, b in zip(reference.parameters(), model.parameters()))
        results[pattern] = same_none, worst, drift
    return results


@pytest.mark.slow
def test_none_over_nodes_trains_as_torch_ddp_with_accumulation_and_unused_layers():
    """Sums in another order: each gradient equal to DDP's within fp32 rounding (|Δ| ≤ 1e-6 · max|g|),
    None where DDP leaves None, and the parameters after 4 steps within 1e-6, on every rank."""
    for rank, results in enumerate(run_ranks(_against_torch_ddp, 4, 2)):
        for pattern, (same_none, worst, drift) in results.items():
            assert same_none and worst <= 1e-6 and drift <= 1e-6, (rank, pattern, worst, drift)


def _bf16_against_the_math(rank, world_size, ranks_per_node):
    """compressor=none with node_precision="bf16": bf16(Σ_nodes bf16(Σ_local bf16(g)) / W), the sum of
    a node's bf16 gradients rounded once more to bf16 and the average of the node means rounded for
    the broadcast; computed here from every rank's local gradient."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = SmallCNN()
    synchronizer = _synchronizer(model, "none", ranks_per_node, node_precision="bf16")
    with synchronizer.no_sync():
        model(_batch(rank, 0)).square().mean().backward()
    local = _grads(model)
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    model.zero_grad(set_to_none=True)
    model(_batch(rank, 0)).square().mean().backward()
    synced = _grads(model)
    nodes = world_size // ranks_per_node
    bf16 = [g.to(torch.bfloat16) for g in everyone]
    first = [n * ranks_per_node for n in range(nodes)]
    node_sums = [sum(bf16[start + 1 : start + ranks_per_node], bf16[start]) for start in first]
    expected = (sum(s.float() for s in node_sums) / world_size).to(torch.bfloat16).float()
    full = sum(everyone) / world_size
    return (
        float((synced - expected).abs().max() / full.abs().max()),
        float((synced - full).abs().max() / full.abs().max()),
        bool(torch.equal(synced, synced.to(torch.bfloat16).float())),
        synchronizer.telemetry.last.node_bytes,
        synchronizer.telemetry.last.raw_bytes,
    )


@pytest.mark.slow
def test_bf16_inside_the_node_is_one_bf16_sum_and_one_rounding_of_the_average():
    """2 nodes of 2: equal to the plain bf16 math within fp32 rounding of the division (1e-6 of max|g|,
    and the node sum of 2 bf16 values is exact in bf16 up to one rounding, as gloo sums it); within
    bf16 precision (3 · 2⁻⁸ of max|g|) of the full-precision average; every value representable in
    bf16 (replicas apply the rounded value, the owner too); half the bytes inside the node of a
    full-precision reduce and broadcast (2 × the fp32 bytes there, 1 × here)."""
    for to_math, to_full, rounded, inside, raw in run_ranks(_bf16_against_the_math, 4, 2):
        assert to_math <= 1e-6 and 0 < to_full <= 3 * 2**-8 and rounded
        assert inside == raw


def _bf16_against_torch_ddp(rank, world_size):
    """One node of 2 ranks, 4 SGD steps: torch DDP with its ``bf16_compress_hook`` (each gradient
    rounded to bf16 and halved, summed in bf16) against node_precision="bf16" (rounded, summed in
    bf16, halved: the same bits, since halving is exact)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    reference, ours = SmallCNN(), SmallCNN()
    ours.load_state_dict(reference.state_dict())
    ddp = DistributedDataParallel(reference)
    ddp.register_comm_hook(None, bf16_compress_hook)
    synchronizer = _synchronizer(ours, "none", world_size, node_precision="bf16")
    for model in (ddp, ours):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(4):
            optimizer.zero_grad(set_to_none=True)
            model(_batch(rank, step)).square().mean().backward()
            optimizer.step()
    return synchronizer.step, max(float((a - b).abs().max()) for a, b in zip(reference.parameters(), ours.parameters()))


@pytest.mark.slow
def test_bf16_inside_one_node_trains_as_torch_ddp_with_its_bf16_compress_hook():
    for steps, gap in run_ranks(_bf16_against_torch_ddp, 2):
        assert steps == 4 and gap == 0.0


def _topk_against_the_math(rank, world_size, ranks_per_node):
    """Top-k (no memory) hierarchical: (1/N) Σ_nodes decode(topk(node mean)), computed here from
    every rank's local gradient, per bucket."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = SmallCNN()
    synchronizer = _synchronizer(model, "topk", ranks_per_node, memory="none")
    model(_batch(rank, 9)).sum().backward()  # records the order
    model.zero_grad(set_to_none=True)
    with synchronizer.no_sync():
        model(_batch(rank, 0)).square().mean().backward()
    local = torch.cat([synchronizer.layout.parameter(n).grad.reshape(-1) for n in synchronizer.layout.order])
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    model.zero_grad(set_to_none=True)
    model(_batch(rank, 0)).square().mean().backward()
    synced = torch.cat([synchronizer.layout.parameter(n).grad.reshape(-1) for n in synchronizer.layout.order])
    nodes = world_size // ranks_per_node
    expected, offset = [], 0
    for bucket in synchronizer.buckets:
        total = torch.zeros(bucket.numel)
        for n in range(nodes):
            mean = sum(everyone[n * ranks_per_node + j][offset : offset + bucket.numel] for j in range(ranks_per_node))
            mean = mean / ranks_per_node
            k = max(1, int(0.1 * bucket.numel))  # top-k keeps floor(δ n)
            kept = torch.zeros_like(mean)
            top = torch.topk(mean.abs(), k).indices
            kept[top] = mean[top]
            total += kept
        expected.append(total / nodes)
        offset += bucket.numel
    return float((synced - torch.cat(expected)).abs().max())


@pytest.mark.slow
def test_topk_is_the_mean_over_nodes_of_each_nodes_compressed_mean():
    assert max(run_ranks(_topk_against_the_math, 4, 2)) <= 1e-6


def _exchanges_across_during_backward(rank, world_size, ranks_per_node):
    """Four 1 MB layers, a bucket each (buckets of >= 1 MB advance the earlier buckets' eager rounds);
    the order of this rank's exchanges across nodes and the input's gradient, which backward computes
    last, in the second step (the first records the order)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    c = build_components("topk", "residual", "auto", "groups:4", density=0.01)
    events = []
    exchange = c.communicator.exchange

    def logged(payload, variable_size, eager=False):
        events.append("across")
        return (yield from exchange(payload, variable_size, eager))

    c.communicator.exchange = logged
    hierarchy = NodeHierarchy(ranks_per_node=ranks_per_node)
    synchronizer = GradientSynchronizer(model, c, hierarchy=hierarchy)
    for step in range(2):
        events.clear()
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(10 * step + rank), requires_grad=True)
        x.register_hook(lambda grad: events.append("backward done"))
        model(x).square().mean().backward()
    return events, synchronizer.route.owners


@pytest.mark.slow
def test_the_exchange_across_nodes_overlaps_backward():
    """The reduce inside the node is an eager round: at the next large bucket's launch the owner encodes
    and sends its first bucket across nodes while backward goes on; the broadcasts wait for its end."""
    for rank, (events, owners) in enumerate(run_ranks(_exchanges_across_during_backward, 4, 2)):
        owned = [b for b, owner in enumerate(owners) if owner == rank % 2]
        assert len(owners) == 4 and events.count("across") == len(owned), events
        if 0 in owned:
            assert events.index("across") < events.index("backward done"), events


def _auto_plan(rank, world_size, ranks_per_node):
    torch.manual_seed(0)
    model = SmallCNN()
    synchronizer = _synchronizer(model, "topk", ranks_per_node, density=0.1, fusion="auto:2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 0
    while synchronizer.tuner.phase != "done":  # order, settle, profile, trials, verify; then one planned step
        steps += 1
        optimizer.zero_grad(set_to_none=True)
        model(_batch(rank, steps)).square().mean().backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model(_batch(rank, 0)).square().mean().backward()
    report = {
        k: synchronizer.plan_report[k] for k in ("groups", "predicted_bf16_allreduce_s", "compression_pays", "trials")
    }
    return synchronizer.layout.tensors_per_bucket, report, _grads(model), synchronizer.telemetry.last.node_bytes, steps


@pytest.mark.slow
def test_fusion_auto_plans_the_hierarchical_exchange():
    """fusion=auto profiles the node exchange itself (reduce, the owner's exchange across nodes,
    broadcast), tries plans, and keeps one: the same on every rank, the replicas identical after it,
    and a verdict against a predicted bf16 allreduce."""
    results = run_ranks(_auto_plan, 4, 2, timeout=300)
    groups, report, grads, inside, steps = results[0]
    assert steps == 2 + 2 + 3 * 2 + 2 and len(report["trials"]) == 4 and report["groups"] == groups
    assert report["predicted_bf16_allreduce_s"] > 0 and isinstance(report["compression_pays"], bool)
    for other_groups, _, other_grads, other_inside, _ in results[1:]:
        assert other_groups == groups and torch.equal(other_grads, grads) and other_inside == inside > 0


def _state_across_a_rebucket(rank, world_size, ranks_per_node):
    """Residuals by parameter, on this rank, before and after new buckets (owners change)."""
    torch.manual_seed(0)
    model = SmallCNN()
    synchronizer = _synchronizer(model, "topk", ranks_per_node)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        model(_batch(rank, step)).square().mean().backward()
    before = synchronizer.memory.state_by_parameter(synchronizer.buckets)["residual"]
    old_owners = {n: synchronizer.route.owners[b.index] for b in synchronizer.buckets for n in b.names}
    synchronizer.layout.rebucket([1] * len(synchronizer.layout.order))
    after = synchronizer.memory.state_by_parameter(synchronizer.buckets)["residual"]
    new_owners = {n: synchronizer.route.owners[b.index] for b in synchronizer.buckets for n in b.names}
    return before, after, old_owners, new_owners


@pytest.mark.slow
def test_new_buckets_hand_each_parameters_state_to_its_new_owner():
    """After new buckets (fusion=auto's trials, the first step's order) each parameter's residual is
    on its new owner, exactly the one its old owner held."""
    results = run_ranks(_state_across_a_rebucket, 4, 2)
    _, _, old_owners, new_owners = results[0]
    moved = [n for n in new_owners if new_owners[n] != old_owners[n]]
    assert moved, "the new plan should move some parameters to another local rank"
    for node in (results[:2], results[2:]):
        for name in new_owners:
            (held_before,) = [before[name] for before, *_ in node if name in before]
            holders = [local for local, (_, after, *_) in enumerate(node) if name in after]
            assert holders == [new_owners[name]]
            assert float(held_before.abs().max()) > 0 and torch.equal(node[holders[0]][1][name], held_before)


def _replicas(rank, world_size, ranks_per_node, node_precision="full"):
    results = {}
    for name in COMPRESSORS.names():
        torch.manual_seed(0)
        model = SmallCNN()
        synchronizer = _synchronizer(model, name, ranks_per_node, node_precision=node_precision)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            model(_batch(rank, step)).square().mean().backward()
        results[name] = (_grads(model), synchronizer.step)
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, ranks_per_node, node_precision",
    [(4, 2, "full"), (8, 4, "full"), (8, 2, "full"), (4, 2, "bf16")],
    ids=["2x2", "2x4", "4x2", "2x2-bf16"],
)
def test_every_compressor_keeps_the_replicas_identical(world_size, ranks_per_node, node_precision):
    results = run_ranks(_replicas, world_size, ranks_per_node, node_precision, timeout=600)
    for name in COMPRESSORS.names():
        first, steps = results[0][name]
        assert steps == 3 and bool(torch.isfinite(first).all()) and float(first.abs().max()) > 0, name
        for rank in range(1, world_size):
            assert torch.equal(results[rank][name][0], first), f"{name}: rank {rank} differs from rank 0"


def _bad_layout(rank, world_size, case):
    torch.manual_seed(0)
    ranks_per_node = {"indivisible": 3, "uneven": 1 + rank % 2, "numbering": 2}[case]
    c = build_components("none")
    node_rank, local_rank = (rank % 2, rank // 2) if case == "numbering" else (None, None)
    try:
        GradientSynchronizer(
            SmallCNN(),
            c,
            hierarchy=NodeHierarchy(ranks_per_node=ranks_per_node, node_rank=node_rank, local_rank=local_rank),
        )
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, message",
    [
        ("indivisible", "4 ranks cannot form nodes of 3 ranks each"),
        ("uneven", "needs the same number of ranks on every node, but the ranks report [1, 2] ranks per node"),
        ("numbering", "rank 1 is local rank 0 of node 1, but ranks must be numbered node by node"),
    ],
)
def test_a_bad_layout_is_an_error_on_every_rank(case, message):
    assert all(message in (error or "") for error in run_ranks(_bad_layout, 4, case))


@pytest.mark.parametrize(
    "hierarchy, message",
    [
        ("rack", "hierarchy = 'rack' is invalid; allowed: 'flat', 'node', or a NodeHierarchy(...)"),
        ({"precision": "bf16"}, "hierarchy = {'precision': 'bf16'} is invalid; allowed: 'flat', 'node', or a"),
    ],
)
def test_an_unknown_hierarchy_is_refused_before_any_work(hierarchy, message):
    c = build_components("none")
    with pytest.raises(ValueError, match=re.escape(message)):
        GradientSynchronizer(SmallCNN(), c, hierarchy=hierarchy)
    with pytest.raises(ValueError, match=re.escape(message)):
        GCFusedStrategy(hierarchy=hierarchy)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(precision="fp8"), "NodeHierarchy: option 'precision' = 'fp8' is invalid; allowed: one of 'full', 'bf16'"),
        (dict(ranks_per_node=0), "NodeHierarchy: option 'ranks_per_node' = 0 is invalid; allowed: an integer in [1"),
        (
            dict(node_precision="bf16"),
            "NodeHierarchy does not take option(s) node_precision (did you mean 'precision'?)",
        ),
    ],
)
def test_bad_hierarchy_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        NodeHierarchy(**options)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(node_precision="bf16"),
            "node_precision is an option of the hierarchy; pass hierarchy=NodeHierarchy(precision='bf16')",
        ),
        (
            dict(ranks_per_node=4),
            "ranks_per_node is an option of the hierarchy; pass hierarchy=NodeHierarchy(ranks_per_node=4)",
        ),
    ],
)
def test_a_hierarchy_option_beside_the_roles_says_where_it_goes(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GCFusedStrategy(**options)


def test_the_command_line_form_of_the_hierarchy():
    """``hierarchy=node,node_precision=bf16`` (the app's and the advisor's flat form)."""
    assert hierarchy_of("node", "bf16") == NodeHierarchy(precision="bf16")
    assert hierarchy_of("flat") is None
    with pytest.raises(ValueError, match=re.escape("node_precision' = 'fp8' is invalid; allowed: one of 'full'")):
        hierarchy_of("node", "fp8")
    with pytest.raises(ValueError, match=re.escape("node_precision = 'bf16' applies to the reduction inside nodes")):
        hierarchy_of("flat", "bf16")


def _resume(rank, world_size, ranks_per_node, folder):
    import copy
    import os

    import torch.distributed as dist

    def train(model, synchronizer, optimizer, steps):
        for step in steps:
            optimizer.zero_grad(set_to_none=True)
            model(_batch(rank, step)).square().mean().backward()
            optimizer.step()

    torch.manual_seed(0)
    model = SmallCNN()
    synchronizer = _synchronizer(model, "topk", ranks_per_node)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, synchronizer, optimizer, range(3))
    local = rank % ranks_per_node
    owned = {b for b, owner in enumerate(synchronizer.route.owners) if owner == local}
    holds_only_its_share = set(synchronizer.memory.buffers["residual"]) == owned
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    manifest = save_rank_states(synchronizer, folder)  # what a Lightning or Accelerate checkpoint writes
    dist.barrier()
    files = sorted(os.listdir(folder))
    train(model, synchronizer, optimizer, range(3, 6))
    resumed = SmallCNN()
    resumed.load_state_dict(saved[0])
    synchronizer = _synchronizer(resumed, "topk", ranks_per_node)
    load_rank_states(synchronizer, manifest, folder)
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(saved[1])
    train(resumed, synchronizer, optimizer, range(3, 6))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    return holds_only_its_share, bool(owned), same, files


@pytest.mark.slow
def test_resume_continues_exactly_with_each_ranks_share_of_the_state(tmp_path):
    """top-k + residual on 2 nodes of 2: each rank keeps residuals for the buckets it compresses
    only; a run restored from a state saved after 3 steps ends 3 steps later where the
    uninterrupted run does, bit for bit. The state goes through the per-rank checkpoint files: one
    file per rank, although two ranks share each rank of the node exchange."""
    for holds_only_its_share, owns_some, same, files in run_ranks(_resume, 4, 2, str(tmp_path)):
        assert holds_only_its_share and owns_some and same
        assert files == ["rank0.pt", "rank1.pt", "rank2.pt", "rank3.pt"]


def _one_rank_overflows(rank, world_size, ranks_per_node):
    """top-k + residual over 2 nodes of 2; at step 2 local rank 1 of node 0 sends +inf gradients."""
    torch.manual_seed(0)
    model = SmallCNN()
    synchronizer = _synchronizer(model, "topk", ranks_per_node)

    def backward(step, poisoned=False):
        model.zero_grad(set_to_none=True)
        hooks = (
            [p.register_hook(lambda g: torch.full_like(g, float("inf"))) for p in model.parameters()]
            if poisoned
            else []
        )
        model(_batch(rank, step)).square().mean().backward()
        for hook in hooks:
            hook.remove()
        return _grads(model)

    for step in range(2):
        backward(step)
    residuals = synchronizer.memory.buffers["residual"]
    before = {b: r.clone() for b, r in residuals.items()}
    bad = backward(2, poisoned=rank == 1)
    flagged = int(synchronizer.telemetry.last.nonfinite_buckets)
    kept = {b: bool(torch.equal(residuals[b], before[b])) for b in before}
    finite = all(bool(torch.isfinite(r).all()) for r in residuals.values())
    after = backward(3)
    return rank // ranks_per_node, kept, flagged, finite, bool(torch.isfinite(bad).all()), after


@pytest.mark.slow
def test_a_non_finite_gradient_on_one_rank_never_enters_any_ranks_memory():
    """The node's sum carries the overflow to its owners, who keep their residuals as they were and
    flag each bucket; the other node's owners compress finite sums and update theirs. Every rank's
    averaged step is visibly bad (a scaler skips it), and the next step is finite and the same on
    every rank."""
    results = run_ranks(_one_rank_overflows, 4, 2)
    for node, kept, flagged, finite, bad_step_finite, _ in results:
        assert finite and not bad_step_finite and kept
        if node == 0:
            assert all(kept.values()) and flagged == len(kept)
        else:
            assert not any(kept.values()) and flagged == 0
    assert sum(len(kept) for _, kept, *_ in results) == 2 * 3  # each node's ranks own its 3 buckets
    first = results[0][-1]
    assert bool(torch.isfinite(first).all()) and all(torch.equal(r[-1], first) for r in results[1:])
