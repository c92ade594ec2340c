"""PowerSGD and ACP-SGD (docs/algorithms.md §5): exactness, error feedback, torch's hook, collectives."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from compressor_helpers import build, finish
from torch import nn

from gc_strategy import GCFusedStrategy, GradientSynchronizer, build_components
from gc_strategy.algos.factors import normalize_columns, orthogonalize
from gc_strategy.bucket import Bucket
from gc_strategy.tools.ranks import run_ranks


def _matrix_bucket(*shapes, index=0):
    return Bucket(
        index,
        [f"w{i}" for i in range(len(shapes))],
        [torch.Size(s) for s in shapes],
        torch.float32,
        torch.device("cpu"),
    )


def _single_rank_exchange(compressor, flat, bucket):
    """Drive a compressor's exchange on one process (the communicator sums over one rank)."""
    from gc_strategy.communicators import AllReduce

    communicator = AllReduce()
    communicator.bind(None)
    return finish(compressor.exchange(flat, bucket, communicator, local_form="estimate"))


@pytest.mark.parametrize("true_rank, rank", [(1, 1), (2, 4), (3, 3)])
def test_powersgd_is_exact_for_a_matrix_of_lower_rank(true_rank, rank):
    g = torch.Generator().manual_seed(true_rank)
    matrix = torch.randn(40, true_rank, generator=g) @ torch.randn(true_rank, 30, generator=g)
    bucket = _matrix_bucket((40, 30))
    compressor = build("powersgd", rank=rank, start_iter=0)
    average, _ = _single_rank_exchange(compressor, matrix.reshape(-1), bucket)
    assert torch.allclose(average, matrix.reshape(-1), atol=1e-4 * matrix.abs().max())
    assert compressor.buffer("error", bucket).abs().max() <= 1e-4 * matrix.abs().max()


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_error_feedback_makes_the_running_sums_track(name):
    """Σ ĝ_t − Σ g_t = −e_T exactly (telescoping), and e_T stays bounded while Σ g_t grows, so the
    time-averaged error vanishes."""
    bucket = _matrix_bucket((32, 24), (16,))
    compressor = build(name, rank=1, start_iter=0)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(bucket.numel, generator=gen)
    true_sum = torch.zeros(bucket.numel)
    sent_sum = torch.zeros(bucket.numel)
    relative = {}
    for step in range(400):
        compressor.begin_step(step)
        g = base + 0.3 * torch.randn(bucket.numel, generator=gen)
        average, _ = _single_rank_exchange(compressor, g, bucket)
        true_sum += g
        sent_sum += average
        if step + 1 in (100, 400):
            error = compressor.buffer("error", bucket)
            assert torch.allclose(sent_sum - true_sum, -error, atol=1e-3 * true_sum.abs().max())
            relative[step + 1] = float(error.norm() / true_sum.norm())
    assert relative[400] < relative[100] / 2.5  # bounded error: ~1/T of the running sum
    # the dense vector (16 elements) is averaged exactly: no error there
    assert torch.all(compressor.buffer("error", bucket)[32 * 24 :] == 0)


def test_orthogonalize_gives_orthonormal_columns():
    batch = torch.randn(3, 20, 4)
    q = orthogonalize(batch.clone())
    eye = torch.eye(4).expand(3, 4, 4)
    assert torch.allclose(q.transpose(1, 2) @ q, eye, atol=1e-5)


def test_a_normalised_q_gives_the_p_of_an_orthonormalised_one():
    """orth(M · normalise(Q)) = orth(M · orth(Q)), computed in float64, for a warm-started Q = Mᵀ P
    (columns of very different scales, not orthogonal) and for a Gaussian one; a zero column (a
    matrix of lower rank in a padded batch) stays zero."""
    g = torch.Generator().manual_seed(0)
    m = torch.randn(4, 30, 20, generator=g, dtype=torch.float64) * torch.logspace(0, -3, 20, dtype=torch.float64)
    p = orthogonalize(torch.randn(4, 30, 3, generator=g, dtype=torch.float64))
    for q in (m.transpose(1, 2) @ p, torch.randn(4, 20, 3, generator=g, dtype=torch.float64)):
        expected = orthogonalize(m @ orthogonalize(q.clone()))
        torch.testing.assert_close(orthogonalize(m @ normalize_columns(q)), expected, rtol=0, atol=1e-10)
    padded = torch.randn(2, 20, 3, generator=g)
    padded[:, :, 2] = 0
    assert normalize_columns(padded)[:, :, 2].eq(0).all()
    torch.testing.assert_close(normalize_columns(padded)[:, :, :2].norm(dim=1), torch.ones(2, 2))


def test_rank_clamping_and_the_compression_rule():
    compressor = build("powersgd", rank=8, min_compression_rate=2)
    bucket = _matrix_bucket((64, 3, 3, 3), (4, 5), (100,), (512, 512))
    layout = compressor.layout(bucket)
    shapes = {(m.rows, m.cols, m.rank): m.name for ms in layout.by_shape.values() for m in ms}
    # conv [64, 27]: (64+27)*8*2 = 1456 < 1728 compress; [4, 5]: rank 4, (9)*4*2 = 72 > 20 dense
    assert shapes == {(64, 27, 8): "w0", (512, 512, 8): "w3"}
    assert layout.dense.numel() == 20 + 100


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=0), "option 'rank' = 0 is invalid; allowed: an integer in [1, inf)"),
        (dict(start_iter=-1), "option 'start_iter' = -1 is invalid"),
        (dict(min_compression_rate=0), "option 'min_compression_rate' = 0 is invalid; allowed: a number in (0, inf)"),
    ],
)
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_bad_options_are_refused(name, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        GCFusedStrategy(compressor=name, **kwargs)


def test_powersgd_needs_allreduce():
    with pytest.raises(ValueError, match="needs communicator='allreduce'"):
        GCFusedStrategy(compressor="powersgd", communicator="allgather")


def _mlp():
    return nn.Sequential(
        nn.Linear(32, 64, bias=False),
        nn.ReLU(),
        nn.Linear(64, 48, bias=False),
        nn.ReLU(),
        nn.Linear(48, 16, bias=False),
    )


def _against_torch_hook(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    theirs, ours = _mlp(), _mlp()
    ours.load_state_dict(theirs.state_dict())
    state = hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=2,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    ddp = DistributedDataParallel(theirs, bucket_cap_mb=100)
    ddp.register_comm_hook(state, hook.powerSGD_hook)
    c = build_components("powersgd", rank=2, start_iter=2, fusion="single")
    synchronizer = GradientSynchronizer(ours, c)
    # the same initial Q as the hook: its numpy seed -> torch seed -> randn per tensor in bucket order
    names = dict(ours.named_parameters())
    bucket_order = [n for n, _ in reversed(list(ours.named_parameters()))]
    torch.manual_seed(np.random.RandomState(0).randint(1_000_000_000))
    initial_q = {}
    for name in bucket_order:
        rows, cols = names[name].shape
        initial_q[name] = torch.randn(1, cols, 2)[0]
    synchronizer.compressor.load_extra_state({"factors": {"q": initial_q}})
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    errors = []
    for step in range(8):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        for model, opt in ((ddp, opt_theirs), (ours, opt_ours)):
            opt.zero_grad()
            model(x).square().mean().backward()
        assert synchronizer.layout.order == bucket_order or step == 0
        worst = max(
            float((a.grad - b.grad).norm() / a.grad.norm()) for a, b in zip(theirs.parameters(), ours.parameters())
        )
        errors.append(worst)
        opt_theirs.step()
        opt_ours.step()
    return errors


@pytest.mark.slow
def test_powersgd_equals_torch_powersgd_hook():
    for errors in run_ranks(_against_torch_hook, 2):
        assert max(errors) <= 1e-4, errors


def _many_buckets(rank, world_size, name):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(24, 24) for _ in range(8)])
    c = build_components(name, rank=2, start_iter=1, fusion="layerwise")
    synchronizer = GradientSynchronizer(model, c)
    per_step = []
    for step in range(5):
        model.zero_grad()
        model(torch.randn(4, 24, generator=torch.Generator().manual_seed(step * 10 + rank))).square().mean().backward()
        t = synchronizer.telemetry.last
        p_step = name == "acpsgd" and step >= 1 and (step - 1) % 2 == 0
        per_step.append((t.buckets, t.collectives, t.sent_bytes, p_step))
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])  # every rank holds the same averaged gradients
    return per_step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_many_buckets_on_gloo_and_collectives_per_step(name):
    """16 buckets on gloo (torch's hook fails here with several buckets); one allreduce per bucket per
    step for ACP-SGD, two for PowerSGD; bytes per step as the formula says."""
    per_step = run_ranks(_many_buckets, 2, name)[0]
    # 8 layers: weight [24, 24] rank 2 -> P, Q = 48 elements each; bias 24 dense
    for step, (buckets, collectives, sent, _p_step) in enumerate(per_step):
        assert buckets == 16
        if step == 0:  # start_iter = 1: plain allreduce
            assert collectives == 16 and sent == 4 * 8 * (24 * 24 + 24)
        elif name == "powersgd":
            assert collectives == 2 * 8 + 8 and sent == 4 * 8 * (48 + 48 + 24)
        else:
            assert collectives == 16 and sent == 4 * 8 * (48 + 24)


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_dense_parts_are_exact_and_a_non_finite_bucket_leaves_error_and_factors_as_they_were(name):
    """One process: the densely averaged tensor (a vector) comes back exactly; after a step whose
    gradient holds an inf, the error feedback and the stored factors are those of the step before."""
    bucket = Bucket(0, ["w", "v"], [torch.Size([16, 12]), torch.Size([5])], torch.float32, torch.device("cpu"))
    compressor = build(name, rank=2, start_iter=0)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        compressor.begin_step(step)
        g = torch.randn(bucket.numel, generator=generator)
        average, _ = _single_rank_exchange(compressor, g.clone(), bucket)
        assert torch.equal(average[192:], g[192:])
    error = compressor.buffer("error", bucket).clone()
    factors = {key: batch.clone() for key, batch in compressor._batches.items()}
    assert error.abs().sum() > 0 and factors  # powersgd keeps Q, acpsgd P and Q
    poisoned = torch.randn(bucket.numel, generator=generator)
    poisoned[7] = float("inf")
    compressor.begin_step(3)
    _single_rank_exchange(compressor, poisoned, bucket)
    assert torch.equal(compressor.buffer("error", bucket), error)
    assert all(torch.equal(compressor._batches[key], batch) for key, batch in factors.items())


def test_acpsgd_alternates_p_and_q_steps():
    """Odd compressed steps send P ([30, 2]: 60 values), even ones Q ([20, 2]: 40), one round each."""
    from gc_strategy.communicators import AllReduce

    sizes = []

    class Recording(AllReduce):
        def exchange(self, payload, variable_size, eager=False):
            sizes.append([t.numel() for t in payload])
            return (yield from super().exchange(payload, variable_size, eager))

    communicator = Recording()
    communicator.bind(None)
    bucket = _matrix_bucket((30, 20))
    compressor = build("acpsgd", rank=2, start_iter=3)
    for step in range(1, 9):
        compressor.begin_step(step)
        exchange = compressor.exchange(torch.randn(600), bucket, communicator, local_form=None)
        round_ = next(exchange)
        with pytest.raises(StopIteration):
            exchange.send(round_.wait())
    assert sizes == [[600], [600], [60], [40], [60], [40], [60], [40]]


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_batched_same_shape_matrices_give_the_per_matrix_results(name, monkeypatch):
    """The GPU layout (same-shape matrices in one bmm) against the CPU one (one matrix per bmm)."""
    shapes = [(6, 4, 3, 3), (5,), (6, 4, 3, 3), (8, 9), (6, 4, 3, 3), (8, 9)]
    bucket = _matrix_bucket(*shapes)
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(bucket.numel, generator=g) for _ in range(3)]
    results = {}
    for batched in (False, True):
        monkeypatch.setattr(type(build(name)), "batch_by_shape", staticmethod(lambda device, b=batched: b))
        compressor = build(name, rank=2, start_iter=0)
        assert len(compressor.layout(bucket).by_shape) == (2 if batched else 5)
        results[batched] = []
        for step, flat in enumerate(steps):
            compressor.begin_step(step)
            average, local = _single_rank_exchange(compressor, flat, bucket)
            results[batched].append((average, local, compressor.buffer("error", bucket).clone()))
    for unbatched, batched in zip(results[False], results[True]):
        for a, b in zip(unbatched, batched):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_warm_start_each_step_draws_a_fresh_q():
    """``warm_start=False``: the same gradient twice gives two different approximations, since Q is
    a fresh Gaussian each step (Vogels et al. 2019; torch's ``powerSGD_hook``). Each is the paper's
    one power step from that Q, computed here plainly: ``P = orth(M Q)``, ``ĝ = P Pᵀ M``."""
    bucket = _matrix_bucket((40, 30))
    matrix = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    compressor = build("powersgd", rank=2, start_iter=0, use_error_feedback=False, warm_start=False)
    results = []
    for step in range(2):
        compressor.begin_step(step)
        q = compressor.initial_factor("q", "w0", 30, 2).double()
        p, _ = torch.linalg.qr(matrix.double() @ torch.linalg.qr(q)[0])
        expected = p @ p.T @ matrix.double()
        result = _single_rank_exchange(compressor, matrix.reshape(-1), bucket)[0].clone()
        torch.testing.assert_close(result.double().view(40, 30), expected, rtol=1e-4, atol=1e-5)
        results.append(result)
    assert not torch.equal(results[0], results[1])


def _fresh_q_on_two_ranks(rank, world_size):
    """Each rank's Q at steps 0 and 1, and its average of a rank-dependent gradient."""
    bucket = _matrix_bucket((20, 12))
    compressor = build(
        "powersgd", world_size=2, process_rank=rank, rank=2, start_iter=0, use_error_feedback=False, warm_start=False
    )
    from gc_strategy.communicators import AllReduce

    communicator = AllReduce()
    communicator.bind(None)
    out = []
    for step in range(2):
        compressor.begin_step(step)
        g = torch.randn(240, generator=torch.Generator().manual_seed(10 * rank + step))
        average, _ = finish(compressor.exchange(g, bucket, communicator, local_form="estimate"))
        out.append((compressor.initial_factor("q", "w0", 12, 2), average.clone()))
    return out


@pytest.mark.slow
def test_without_warm_start_the_ranks_draw_the_same_fresh_q():
    rank0, rank1 = run_ranks(_fresh_q_on_two_ranks, 2)
    for (q0, average0), (q1, average1) in zip(rank0, rank1):
        assert torch.equal(q0, q1) and torch.equal(average0, average1)
    assert not torch.equal(rank0[0][0], rank0[1][0])


@pytest.mark.parametrize("kind", ["p", "q"])
def test_both_forms_of_the_factor_products_agree_and_the_cpu_keeps_its_faster_one(kind):
    from gc_strategy.algos import factors

    g = torch.Generator().manual_seed(0)
    m = torch.randn(3, 40, 70, generator=g, dtype=torch.float64)
    factor = torch.randn(3, 70 if kind == "p" else 40, 4, generator=g, dtype=torch.float64)
    expected = m @ factor if kind == "p" else m.transpose(1, 2) @ factor
    for factor_first in (False, True):
        torch.testing.assert_close(factors.product(kind, m, factor, factor_first), expected)
    key = (kind, (3, 40, 70), 4)
    factors._FACTOR_FIRST.pop(key, None)
    torch.testing.assert_close(factors.product(kind, m, factor), expected)
    assert key in factors._FACTOR_FIRST  # timed once, then kept
