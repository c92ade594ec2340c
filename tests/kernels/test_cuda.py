"""CUDA paths (side stream, fp16 AMP with a grad scaler); skipped without a GPU."""

import lightning.pytorch as pl
import pytest
import torch
from compressor_helpers import finish
from models import ParityModule, SmallCNN

from gc_strategy import GCFusedStrategy, GradientSynchronizer, build_components

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_side_stream_engine_matches_plain_gradients():
    reference = SmallCNN().cuda()
    model = SmallCNN().cuda()
    model.load_state_dict(reference.state_dict())
    c = build_components(compressor="none", fusion="groups:3")
    synchronizer = GradientSynchronizer(model, c)
    assert synchronizer.stream is not None
    for seed in range(3):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed)).cuda()
        reference(x).square().mean().backward()
        model(x).square().mean().backward()
        for a, b in zip(reference.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)


def test_16_mixed_with_grad_scaler_trains_on_one_gpu():
    pl.seed_everything(0, verbose=False)
    module = ParityModule()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        strategy=GCFusedStrategy(compressor="fp16", memory="residual"),  # one device: runs in this process
    )
    trainer.fit(module)
    assert all(torch.isfinite(p).all() for p in module.parameters())


# ---------------------------------------------------------------- every compressor on a CUDA bucket
from gc_strategy import COMPRESSORS  # noqa: E402
from gc_strategy.bucket import Bucket  # noqa: E402

#: draws on the tensor's device (the CPU and CUDA generators differ): checked by sampling instead
#: (randk: tests/algos/test_sparsifiers.py checks its device draw on the CPU)
RANDOM_ON_DEVICE = {"qsgd", "terngrad", "natural", "dgc", "randk"}
UNBIASED = {"qsgd", "terngrad", "natural"}
MEMORY = {
    "topk": "residual",
    "randk": "residual",
    "onebit": "residual",
    "efsignsgd": "residual",
    "threshold": "residual",
    "sidco": "residual",
    "dgc": "dgc",
}
OPTIONS = {
    "powersgd": dict(start_iter=0),
    "acpsgd": dict(start_iter=0),
    "threshold": dict(threshold=0.5),
    "terngrad": dict(clip_sigma=0.0),
}  # unbiased without clipping
SHAPES = [torch.Size([64, 32]), torch.Size([1001]), torch.Size([16, 3, 3, 3]), torch.Size([7])]


def _exchange(name: str, device: str, gradients: list[torch.Tensor], step0: int = 0):
    """Steps of one compressor + memory on ``device`` (world size 1): each step's (average, memory state)."""
    c = build_components(name, MEMORY.get(name, "none"), **OPTIONS.get(name, {}))
    c.communicator.bind(None)
    bucket = Bucket(0, [f"t{i}" for i in range(len(SHAPES))], SHAPES, torch.float32, torch.device(device))
    results = []
    for step, g in enumerate(gradients):
        c.compressor.begin_step(step0 + step)
        flat = g.to(device)
        compensated = c.memory.compensate(flat, bucket)
        exchange = c.compressor.exchange(compensated, bucket, c.communicator, c.memory.local_form)
        average, local = finish(exchange)
        if local is not None:
            c.memory.update(compensated, local, bucket, torch.tensor(True, device=device))
        state = {k: v[0].detach().cpu().clone() for k, v in c.memory.buffers.items()}
        results.append((average.float().cpu(), state))
    return results


def _gradients(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(sum(s.numel() for s in SHAPES), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("name", sorted(set(COMPRESSORS.names()) - RANDOM_ON_DEVICE))
def test_deterministic_compressors_on_cuda_equal_the_cpu(name):
    """Three steps (warm starts, momenta, residuals carried) on a CUDA bucket equal those on the CPU:
    this covers the CUDA branches of the bucket helpers, the Triton bit kernels and the batched
    low-rank path, against the CPU code the rest of the suite checks against the math."""
    gradients = _gradients(3)
    for (cuda_avg, cuda_state), (cpu_avg, cpu_state) in zip(
        _exchange(name, "cuda", gradients), _exchange(name, "cpu", gradients)
    ):
        torch.testing.assert_close(cuda_avg, cpu_avg, rtol=1e-4, atol=1e-5)
        for key in cpu_state:
            torch.testing.assert_close(cuda_state[key], cpu_state[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(UNBIASED))
def test_stochastic_quantizers_on_cuda_are_unbiased(name):
    """The mean of N independent CUDA draws approaches the gradient as an unbiased one must: the squared
    error of the mean, summed over elements, is about Σ var_i / N (variances measured on the draws;
    a ratio near 1 over thousands of elements; a bias would add N-independent error)."""
    g = _gradients(1)[0]
    draws = torch.stack([_exchange(name, "cuda", [g], step0=step)[0][0] for step in range(400)]).double()
    squared_error = (draws.mean(0) - g.double()).square().sum()
    expected = draws.var(0).sum() / draws.shape[0]
    assert float(squared_error / expected) < 1.5, (float(squared_error), float(expected))


def test_all_finite_on_cuda_finds_every_inf_and_nan():
    from gc_strategy.bucket import all_finite

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bad in (None, float("inf"), -float("inf"), float("nan")):
            flat = torch.randn(3_000_001, device="cuda").to(dtype)
            if bad is not None:
                flat[2_999_999] = bad
            assert bool(all_finite(flat)) == (bad is None), (dtype, bad)


def test_cupy_packs_signs_on_torchs_stream_in_torchs_memory():
    """The default variant of ``pack_signs`` where CuPy is installed: the torch variant's bytes,
    on a side stream, with nothing taken from CuPy's own memory pool."""
    cupy = pytest.importorskip("cupy")
    from gc_strategy import kernels
    from gc_strategy.kernels import torch_ops

    values = torch.randn(25_557_035, device="cuda")
    values[:3] = torch.tensor([-0.0, float("nan"), 0.0])
    pool = cupy.get_default_memory_pool().used_bytes()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        assert kernels.variant_for(values, triton=True, cupy=True) == "cupy"
        packed, expected = kernels.pack_signs(values), torch_ops.pack_bits(values >= 0, 1)
        assert torch.equal(packed, expected)
    assert cupy.get_default_memory_pool().used_bytes() == pool


def test_chunked_topk_on_cuda_equals_the_cpu():
    g = _gradients(1)[0]
    decoded = []
    for device in ("cuda", "cpu"):
        compressor = build_components("topk", density=0.1, chunk=64).compressor
        bucket = Bucket(0, [f"t{i}" for i in range(len(SHAPES))], SHAPES, torch.float32, torch.device(device))
        decoded.append(compressor.decode(compressor.encode(g.to(device), bucket), bucket).cpu())
    assert torch.equal(*decoded)


def test_dgc_on_cuda_sends_about_its_density():
    g = _gradients(1)[0]
    average = _exchange("dgc", "cuda", [g])[0][0]
    assert average.isfinite().all()
    assert 0.2 * 0.01 * g.numel() <= int(average.count_nonzero()) <= 5 * 0.01 * g.numel()


def test_randk_on_cuda_draws_alike_on_every_rank_and_is_unbiased():
    """The device draw: two ranks' compressors pick the same positions, new ones each step, and with
    scaling the mean of many decodes approaches g (5 standard deviations of the mean)."""
    n, trials = 40, 4000
    bucket = Bucket(0, ["p"], [torch.Size([n])], torch.float32, torch.device("cuda"))
    g = torch.randn(n, device="cuda")
    ranks = [build_components("randk", density=0.25, unbiased=True).compressor for _ in range(2)]
    for rank, compressor in enumerate(ranks):
        compressor.bind(2, rank)
    decoded = [c.decode(c.encode(g, bucket), bucket) for c in ranks]
    assert torch.equal(decoded[0], decoded[1])
    total = torch.zeros(n, device="cuda")
    for step in range(trials):
        ranks[0].begin_step(step)
        total += ranks[0].decode(ranks[0].encode(g, bucket), bucket)
    std_of_mean = g.abs() * (n / 10 - 1) ** 0.5 / trials**0.5
    assert torch.all((total / trials - g).abs() <= 5 * std_of_mean + 1e-6)
    assert not torch.equal(decoded[0] != 0, total != 0)  # the positions moved from step to step


def test_diloco_offload_keeps_the_outer_state_and_residuals_in_cpu_memory_between_exchanges():
    from gc_strategy import DiLoCo
    from gc_strategy.sync.diloco.synchronizer import DiLoCoSynchronizer

    torch.manual_seed(0)
    model = SmallCNN().cuda()
    reference = SmallCNN().cuda()
    reference.load_state_dict(model.state_dict())
    results = []
    for net, offload in ((model, True), (reference, False)):
        c = build_components("topk", "residual", density=0.1, fusion="groups:2")
        sync = DiLoCoSynchronizer(net, c, DiLoCo(inner_steps=2, offload=offload))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        for step in range(4):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step)).cuda()
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
            sync.after_optimizer_step()
        residuals = [t for s in sync.synchronizers for t in s.memory.buffers.get("residual", {}).values()]
        results.append({t.device.type for t in [*sync.outer.values(), *residuals]})
    assert results == [{"cpu"}, {"cuda"}]
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_sidco_adapts_its_stages_on_cuda_without_a_host_sync():
    """adapt_every=1: each step applies the count the last one measured (read from pinned memory
    behind an event) and measures anew, under ``set_sync_debug_mode("error")``; the stage counts
    are the CPU's, step by step."""
    from compressor_helpers import bucket, build

    heavy = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).exp()  # one stage selects too many
    host, device = (build("sidco", density=0.01, stages=1, adapt_every=1) for _ in range(2))
    on_cuda = Bucket(0, ["p0"], [torch.Size([100_000])], torch.float32, torch.device("cuda"))
    counts = {"cpu": [], "cuda": []}
    for step in range(6):
        host.begin_step(step)
        host.encode(heavy, bucket(100_000))
        counts["cpu"].append(host.stage_counts["p0"])
        device.begin_step(step)
        g = heavy.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            device.encode(g, on_cuda)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts["cuda"].append(device.stage_counts["p0"])
    assert counts["cuda"] == counts["cpu"] and counts["cpu"][-1] > 1, counts


# ---------------------------------------------------------------- no host synchronisation in a step
from compressor_helpers import STEP_CONFIGS, STEP_OPTIONS  # noqa: E402


@pytest.mark.parametrize("config", STEP_CONFIGS, ids=[f"{name}+{memory}" for name, memory in STEP_CONFIGS])
def test_a_synchronised_step_runs_under_cuda_sync_debug_mode_error(config):
    """Every compressor and memory (``STEP_CONFIGS``, as tests/kernels/test_no_host_wait.py runs them)
    on one GPU: the fourth synchronised step, after the gradient order is recorded and the buckets
    built, runs with
    ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host synchronisation."""
    name, memory = config
    torch.manual_seed(0)
    model = SmallCNN().cuda()
    roles = build_components(name, memory, "auto", "groups:2", **STEP_OPTIONS.get(name, {}))
    synchronizer = GradientSynchronizer(model, roles)
    x, y = torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 10, (4,), device="cuda")
    for step in range(4):
        model.zero_grad(set_to_none=True)
        with synchronizer.forward_pass():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 3:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronizer.close()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
