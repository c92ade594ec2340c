"""The gradient synchroniser without Lightning: ordering, launches, accumulation, state."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from locations import ROOT
from models import SmallCNN
from torch import nn

from gc_strategy import GradientSynchronizer, build_components
from gc_strategy.communicators import AllReduce
from gc_strategy.fusion import FusionPlanner
from gc_strategy.sync.every_step.state import resharded
from gc_strategy.tools.ranks import run_ranks


def _synchronizer(module, compressor="none", memory="none", fusion="layerwise", communicator="auto", **options):
    c = build_components(compressor, memory, communicator, fusion, **options)
    return GradientSynchronizer(module, c)


def _backward(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 8, 8, generator=g)
    module(x).square().mean().backward()


def _ready_order(module):
    """The order in which autograd finishes the parameters' gradients (independent observer)."""
    order, names = [], {p: n for n, p in module.named_parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda p: order.append(names[p])) for p in module.parameters()]
    _backward(module)
    for h in handles:
        h.remove()
    module.zero_grad(set_to_none=True)
    return order


class Shuffled(nn.Module):
    """Registration order differs from use order: head is registered first but used last."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.conv = nn.Conv2d(3, 16, 3)
        self.mid = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.conv(x).mean(dim=(2, 3)))))


@pytest.mark.parametrize("fusion", ["layerwise", "single", "groups:2", "bucket_mb:0.001"])
def test_single_process_none_leaves_gradients_exact(fusion):
    reference = SmallCNN()
    model = SmallCNN()
    model.load_state_dict(reference.state_dict())
    _synchronizer(model, fusion=fusion)
    for step in range(3):
        _backward(reference, step)
        _backward(model, step)
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), name


def test_first_step_records_the_ready_order_and_rebuilds_buckets():
    model = Shuffled()
    expected = _ready_order(model)
    synchronizer = _synchronizer(model, fusion="layerwise")
    assert synchronizer.layout.order == list(reversed(synchronizer.names))  # before: reverse registration order
    assert synchronizer.layout.order != expected
    _backward(model)
    assert synchronizer.ready_order == expected
    assert [b.names for b in synchronizer.buckets] == [[n] for n in expected]


class SpyAllReduce(AllReduce):
    """Records how many gradients were ready when each bucket launched."""

    def __init__(self, engine_ref):
        super().__init__()
        self.engine_ref = engine_ref
        self.launches = []

    def exchange(self, payload, variable_size, eager=False):
        synchronizer = self.engine_ref[0]
        self.launches.append(sum(synchronizer._filled))
        return (yield from super().exchange(payload, variable_size, eager))


class Pairs(FusionPlanner):
    def plan(self, sizes):
        return [2] * (len(sizes) // 2) + [1] * (len(sizes) % 2)

    def describe(self):
        return "pairs"


@pytest.mark.parametrize("plan, expected", [("layerwise", [1, 2, 3, 4, 5, 6, 7, 8]), (Pairs(), [2, 4, 6, 8])])
def test_buckets_launch_during_backward_as_soon_as_complete(plan, expected):
    model = SmallCNN()
    ref = []
    spy = SpyAllReduce(ref)
    c = build_components(fusion=plan)
    synchronizer = GradientSynchronizer(model, replace(c, communicator=spy))
    ref.append(synchronizer)
    _backward(model)  # records the order
    spy.launches.clear()
    _backward(model, 1)
    # in the real ready order, bucket k launches when exactly its last gradient has become ready
    assert spy.launches == expected


def test_no_sync_launches_nothing_and_the_next_sync_averages_the_sum():
    model = SmallCNN()
    ref = []
    spy = SpyAllReduce(ref)
    c = build_components()
    synchronizer = GradientSynchronizer(model, replace(c, communicator=spy))
    ref.append(synchronizer)
    with synchronizer.no_sync():
        _backward(model, 0)
        _backward(model, 1)
    assert spy.launches == [] and synchronizer.step == 0
    _backward(model, 2)
    assert synchronizer.step == 1 and len(spy.launches) == len(synchronizer.buckets)
    reference = SmallCNN()
    reference.load_state_dict(model.state_dict())
    for seed in range(3):
        _backward(reference, seed)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_unused_parameters_keep_none_and_frozen_ones_are_left_alone():
    model = SmallCNN(with_unused=True, frozen_stem=True)
    c = build_components("none", "none", "auto", "single")
    synchronizer = GradientSynchronizer(model, c, find_unused_parameters=True)
    assert "conv1.weight" not in synchronizer.names and "unused.weight" in synchronizer.names
    _backward(model)
    assert model.unused.weight.grad is None and model.unused.bias.grad is None  # as DDP: untouched
    assert model.conv1.weight.grad is None
    assert model.head.weight.grad is not None
    assert synchronizer.telemetry.last.buckets == 1


def test_an_unused_parameter_without_find_unused_parameters_is_an_error_naming_the_option():
    model = SmallCNN(with_unused=True)
    _synchronizer(model, fusion="single")
    with pytest.raises(RuntimeError, match=r"find_unused_parameters=True.*|'unused.weight'") as error:
        _backward(model)
    assert "'unused.weight'" in str(error.value) and "find_unused_parameters=True" in str(error.value)


def test_telemetry_counts_bytes():
    model = SmallCNN()
    synchronizer = _synchronizer(model, compressor="fp16", fusion="groups:3")
    _backward(model)
    raw = sum(p.numel() * 4 for p in model.parameters())
    last = synchronizer.telemetry.last
    assert last.raw_bytes == raw and last.sent_bytes == raw // 2 and last.buckets == 3
    assert last.compression_ratio == 2.0


def test_non_finite_gradient_never_enters_memory_and_is_flagged():
    model = SmallCNN()
    synchronizer = _synchronizer(model, compressor="bf16", memory="residual", fusion="groups:2")
    _backward(model, 0)
    _backward(model, 1)
    before = {k: v.clone() for k, v in synchronizer.memory.buffers["residual"].items()}
    poisoned_bucket = synchronizer.layout.slots[synchronizer.names.index("head.weight")][0]
    model.head.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    _backward(model, 2)
    after = synchronizer.memory.buffers["residual"]
    assert torch.equal(after[poisoned_bucket], before[poisoned_bucket])
    other = 1 - poisoned_bucket
    assert not torch.equal(after[other], before[other])  # the healthy bucket was updated
    assert torch.isfinite(after[poisoned_bucket]).all()
    assert synchronizer.telemetry.last.nonfinite_buckets == 1
    assert not torch.isfinite(model.head.weight.grad).all()  # the step is visibly bad: a scaler skips it


def test_state_dict_round_trip_and_a_different_model_is_refused():
    model = SmallCNN()
    synchronizer = _synchronizer(model, compressor="bf16", memory="residual", fusion="groups:2")
    _backward(model)
    _backward(model, 1)
    state = synchronizer.state_dict()
    fresh_model = SmallCNN()
    fresh = _synchronizer(fresh_model, compressor="bf16", memory="residual", fusion="groups:2")
    fresh.load_state_dict(state)
    assert (
        fresh.layout.order == synchronizer.layout.order
        and fresh.layout.tensors_per_bucket == synchronizer.layout.tensors_per_bucket
        and fresh.step == 2
    )
    for b in synchronizer.buckets:
        assert torch.equal(fresh.memory.buffers["residual"][b.index], synchronizer.memory.buffers["residual"][b.index])
    other = _synchronizer(Shuffled(), compressor="bf16", memory="residual")
    with pytest.raises(ValueError, match="does not match this model's parameters"):
        other.load_state_dict(state)


def test_memory_survives_a_change_of_plan():
    model = SmallCNN()
    synchronizer = _synchronizer(model, compressor="bf16", memory="residual", fusion="groups:2")
    _backward(model)
    per_param = synchronizer.memory.state_by_parameter(synchronizer.buckets)["residual"]
    synchronizer.layout.rebucket([1] * len(synchronizer.layout.order))
    again = synchronizer.memory.state_by_parameter(synchronizer.buckets)["residual"]
    assert per_param.keys() == again.keys()
    for name in per_param:
        assert torch.equal(per_param[name], again[name])


def _local_grads(rank, step, state):
    model = SmallCNN()
    model.load_state_dict(state)
    _backward(model, seed=100 * step + rank)
    return [p.grad for p in model.parameters()]


def _average_vs_reference(rank, world_size, compressor, communicator, fusion):
    torch.manual_seed(1234)
    model = SmallCNN()
    if rank:  # the synchroniser must broadcast rank 0's weights at set-up
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    synchronizer = _synchronizer(model, compressor=compressor, communicator=communicator, fusion=fusion)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    results = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        _backward(model, seed=100 * step + rank)
        reference = [sum(g) / world_size for g in zip(*(_local_grads(r, step, state) for r in range(world_size)))]
        results.append(max(float((p.grad - ref).abs().max()) for p, ref in zip(model.parameters(), reference)))
    order = synchronizer.layout.order
    dist.barrier()
    return results, order


@pytest.mark.slow
@pytest.mark.parametrize("compressor, communicator, tol", [("none", "allreduce", 1e-6), ("fp16", "allgather", 2e-3)])
def test_multi_rank_average_matches_the_mean_of_local_gradients(compressor, communicator, tol):
    results = run_ranks(_average_vs_reference, 3, compressor, communicator, "groups:3")
    orders = {tuple(order) for _, order in results}
    assert len(orders) == 1  # every rank rebuilt the same buckets
    for errors, _ in results:
        assert max(errors) <= tol


def test_gradients_become_views_of_the_averaged_buckets_and_still_accumulate():
    """With the bucket's dtype, ``.grad`` is a view of the averaged bucket (one storage per bucket, no
    copy-out); zeroing in place, accumulating over two backwards and set_to_none all still give the
    plain gradients (world size 1: the average is the local gradient)."""
    torch.manual_seed(0)
    reference, model = SmallCNN(), SmallCNN()
    model.load_state_dict(reference.state_dict())
    c = build_components("none", fusion="groups:2")
    synchronizer = GradientSynchronizer(model, c)
    for step in range(6):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        for m in (reference, model):
            if step % 2 == 0:  # odd steps accumulate onto the previous step's gradients
                m.zero_grad(set_to_none=step == 0)
            m(x).square().mean().backward()
        for a, b in zip(reference.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(synchronizer.buckets) == 2


def test_gradients_kept_between_steps_accumulate_in_their_bucket_with_no_copy():
    """zero_grad(set_to_none=False): once the buckets are built in the recorded order (after the
    first step), each gradient accumulates in its bucket (its .grad is the bucket's view), and a
    synchronised backward copies nothing into the buckets; the gradients equal plain backward's
    (world size 1). With set_to_none, one copy each."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from op_recorder import OpRecorder

    torch.manual_seed(0)
    reference, model = SmallCNN(), SmallCNN()
    model.load_state_dict(reference.state_dict())
    _synchronizer(model, fusion="groups:2")
    copies = []
    for step in range(5):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        for m in (reference, model):
            m.zero_grad(set_to_none=step == 4)
        reference(x).square().mean().backward()
        loss = model(x).square().mean()
        with OpRecorder() as ops:
            loss.backward()
        copies.append(ops.launches["copy_"])
        for a, b in zip(reference.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
    tensors = len(list(model.parameters()))
    assert copies == [tensors, tensors, 0, 0, tensors], copies


class EventAllReduce(AllReduce):
    """Records, for each collective, how many gradients were ready when it was issued and whether it
    was marked eager."""

    def __init__(self, engine_ref):
        super().__init__()
        self.engine_ref = engine_ref
        self.events = []

    def exchange(self, payload, variable_size, eager=False):
        self.events.append((sum(self.engine_ref[0]._filled), eager))
        return (yield from super().exchange(payload, variable_size, eager))


# (gradients ready, eager) per collective of a layerwise PowerSGD step on SmallCNN: vectors go dense
# in one round, each weight sends P (eager) at its launch; its Q follows after the own collective of
# the next bucket at least EAGER_AFTER_BYTES large, or at the end of backward
Q_AT_THE_NEXT_LAUNCH = [(1, False), (2, True), (3, True), (3, False), (4, False), (4, False)]
Q_AT_THE_NEXT_LAUNCH += [(5, False), (6, False), (7, True), (8, False), (8, False)]
Q_AT_THE_END = [(1, False), (2, True), (3, True), (4, False), (5, False), (6, False), (7, True)]
Q_AT_THE_END += [(8, False)] * 4


@pytest.mark.parametrize(
    "after_bytes, expected",
    [(0, Q_AT_THE_NEXT_LAUNCH), (1 << 20, Q_AT_THE_END)],
    ids=["every launch", "no bucket large enough"],
)
def test_powersgd_issues_q_after_the_next_large_enough_launch(after_bytes, expected, monkeypatch):
    """PowerSGD's P round is eager: a bucket's Q collective goes out during backward, right after the
    next large enough bucket's own first collective (SmallCNN's buckets hold at most 4.6 kB), or at
    the end of backward before any bucket is decoded."""
    monkeypatch.setattr("gc_strategy.sync.every_step.synchronizer.EAGER_AFTER_BYTES", after_bytes)
    model = SmallCNN()
    ref = []
    communicator = EventAllReduce(ref)
    c = build_components("powersgd", rank=1, start_iter=0, fusion="layerwise")
    synchronizer = GradientSynchronizer(model, replace(c, communicator=communicator))
    ref.append(synchronizer)
    _backward(model)  # records the order
    communicator.events.clear()
    _backward(model, 1)
    assert synchronizer.layout.order == [
        "head.bias",
        "head.weight",
        "conv2.weight",
        "conv2.bias",
        "bn1.weight",
        "bn1.bias",
        "conv1.weight",
        "conv1.bias",
    ]
    assert communicator.events == expected


def test_resharding_takes_the_mean_of_per_rank_state_and_rank_0s_shared_state():
    """Two ranks' states (two single-process engines on different data) resharded for another world
    size: per-element state (residuals; PowerSGD's error) is their mean, PowerSGD's shared factors
    are rank 0's; a fresh synchroniser loads it."""
    states = {}
    for compressor, memory, options in (
        ("topk", "residual", dict(density=0.1)),
        ("powersgd", "none", dict(rank=1, start_iter=0)),
    ):
        per_rank = []
        for rank in range(2):
            torch.manual_seed(0)
            model = SmallCNN()
            synchronizer = _synchronizer(model, compressor, memory, fusion="groups:2", **options)
            for step in range(3):
                _backward(model, 10 * rank + step)
            per_rank.append(synchronizer.state_dict())
        states[compressor] = per_rank
        merged = resharded(per_rank)
        role, name = ("memory", "residual") if memory == "residual" else ("compressor", "error")
        for param, value in merged[role][name].items():
            expected = (per_rank[0][role][name][param] + per_rank[1][role][name][param]) / 2
            assert torch.equal(value, expected)
        assert any(not torch.equal(per_rank[0][role][name][p], per_rank[1][role][name][p]) for p in merged[role][name])
        torch.manual_seed(0)
        fresh_model = SmallCNN()
        fresh = _synchronizer(fresh_model, compressor, memory, fusion="groups:2", **options)
        fresh.load_state_dict({**merged, "world_size": 3})
        loaded = (fresh.memory if role == "memory" else fresh.compressor).state_by_parameter(fresh.buckets)[name]
        assert all(torch.equal(loaded[p], merged[role][name][p]) for p in loaded)
    factors = resharded(states["powersgd"])["compressor_extra"]["factors"]["q"]
    assert all(torch.equal(q, states["powersgd"][0]["compressor_extra"]["factors"]["q"][p]) for p, q in factors.items())


class CheckpointedPerLayer(nn.Module):
    """Every layer, the head nearest the loss included, under its own activation checkpoint."""

    def __init__(self, reentrant: bool, frozen_head: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4).requires_grad_(not frozen_head)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = x.requires_grad_()  # the reentrant mode needs an input that requires grad
        for layer in self.layers:
            x = checkpoint(lambda t, layer=layer: torch.relu(layer(t)), x, use_reentrant=self.reentrant)
        return checkpoint(self.head, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("frozen_head", [False, True], ids=["head", "frozen head"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_layers_finish_once_with_plain_gradients_at_world_size_1(reentrant, frozen_head):
    """At world size 1 the synchronised gradients equal a plain backward's (the reference: the same
    model without a synchroniser), and the step finishes once per backward."""
    torch.manual_seed(0)
    reference = CheckpointedPerLayer(reentrant, frozen_head)
    model = CheckpointedPerLayer(reentrant, frozen_head)
    model.load_state_dict(reference.state_dict())
    synchronizer = _synchronizer(model, fusion="layerwise")
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
            m(x.clone()).square().mean().backward()
        for a, b in zip(reference.parameters(), model.parameters()):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)
                assert b.grad.abs().sum() > 0
        assert synchronizer.step == step + 1


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.use_branch = True

    def forward(self, x):
        h = self.trunk(x)
        return self.branch(h) if self.use_branch else h


def test_a_parameter_no_rank_used_keeps_its_error_feedback_state():
    """find_unused_parameters=True, fp16 with residual memory: a step in which the branch is unused
    leaves its residual exactly as the step before left it (without the restore the step would send
    part of it and keep the rounding of the rest), and its .grad None."""
    torch.manual_seed(0)
    model = Branchy()
    c = build_components("fp16", "residual", "auto", "single")
    synchronizer = GradientSynchronizer(model, c, find_unused_parameters=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    before = synchronizer.memory.state_by_parameter(synchronizer.buckets)["residual"]
    assert before["branch.weight"].abs().sum() > 0  # fp16's rounding left something behind
    model.zero_grad(set_to_none=True)
    model.use_branch = False
    model(x).square().mean().backward()
    after = synchronizer.memory.state_by_parameter(synchronizer.buckets)["residual"]
    assert torch.equal(after["branch.weight"], before["branch.weight"])
    assert torch.equal(after["branch.bias"], before["branch.bias"])
    assert not torch.equal(after["trunk.weight"], before["trunk.weight"])
    assert model.branch.weight.grad is None and model.trunk.weight.grad is not None
