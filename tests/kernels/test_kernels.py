"""The kernel layer: every variant of every operation against plain torch computed here, and every
compressor with the accelerator's variants forced on the CPU against its CPU variants. (The Triton
variants: tests/kernels/test_triton_bits.py, under Triton's interpreter.)"""

import math
from contextlib import nullcontext

import pytest
import torch
from compressor_helpers import finish

from gc_strategy import kernels
from gc_strategy.algos import COMPRESSORS, MEMORIES
from gc_strategy.bucket import Bucket, all_finite
from gc_strategy.communicators import COMMUNICATORS

CPU_VARIANTS = ["numpy", "torch"]
#: quantizers whose draws come from each variant's own generator: compared by sampling, not exactly
OWN_DRAWS = {"qsgd", "terngrad", "natural"}
#: draws its positions on the device by another method than the host's (tests/algos/test_sparsifiers.py checks both)
DEVICE_DRAWS = {"randk"}


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _as_positions(found: torch.Tensor) -> list[int]:
    """Int64 positions or a bool mask, as a sorted list of positions."""
    return sorted((found.nonzero().flatten() if found.dtype == torch.bool else found).tolist())


def test_the_dispatch_picks_numpy_on_the_host_unless_forced():
    x = torch.zeros(3)
    assert kernels.variant_for(x) == "numpy" and kernels.in_host_memory(x)
    with kernels.forced("torch"):
        assert kernels.variant_for(x) == "torch" and not kernels.in_host_memory(x)
        assert not kernels.in_host_memory(torch.device("cpu"))
    assert kernels.variant_for(x) == "numpy"
    with pytest.raises(ValueError, match="kernel variant 'cuda' is invalid; allowed: triton, cupy, numpy, torch"):
        with kernels.forced("cuda"):
            pass


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_nonzero_positions(variant):
    dense = _vector(1000)
    dense[::3] = 0
    dense[7] = float("nan")
    with kernels.forced(variant):
        found = kernels.nonzero_positions(dense)
    assert _as_positions(found) == torch.nonzero((dense != 0) | dense.isnan()).flatten().tolist()


@pytest.mark.parametrize("variant", CPU_VARIANTS)
@pytest.mark.parametrize("strict", [False, True])
def test_positions_at_least(variant, strict):
    magnitudes = _vector(5000).abs()
    magnitudes[10] = 1.0
    magnitudes[11] = float("nan")
    with kernels.forced(variant):
        found = kernels.positions_at_least(magnitudes, 1.0, strict=strict)
    plain = [j for j, a in enumerate(magnitudes.tolist()) if math.isnan(a) or (a > 1.0 if strict else a >= 1.0)]
    assert found.tolist() == plain


@pytest.mark.parametrize("variant", CPU_VARIANTS)
@pytest.mark.parametrize("n, k", [(1000, 10), (200_000, 2000), (200_000, 199_999), (50, 60)])
def test_top_k(variant, n, k):
    magnitudes = _vector(n, seed=n).abs()
    with kernels.forced(variant):
        picked = kernels.top_k(magnitudes, k)
    expected = torch.sort(magnitudes, descending=True).values[: min(k, n)]
    assert torch.equal(torch.sort(magnitudes[picked], descending=True).values, expected)


@pytest.mark.parametrize("variant", CPU_VARIANTS)
@pytest.mark.parametrize(
    "threshold, capacity",
    [(1.5, 2000), (0.5, 2000), (0.5, 300)],
    ids=["room to spare", "overflow", "overflow past the candidates"],
)
def test_select_above_fills_its_capacity_with_the_largest_above_the_threshold(variant, threshold, capacity):
    """Against a plain computation: the slots flagged sent hold exactly the entries above the
    threshold when they fit (NaN among them), else the ``capacity`` largest (NaN first) of the
    first ``2 · capacity`` of them in bucket order; flagged positions are distinct; the count is
    of all entries above (about 670 above 1.5 and 3100 above 0.5 of 5000)."""
    magnitudes = _vector(5000).abs()
    magnitudes[7] = float("nan")
    above = [j for j, a in enumerate(magnitudes.tolist()) if math.isnan(a) or a > threshold]
    candidates = above[: 2 * capacity]
    by_size = sorted(candidates, key=lambda j: -math.inf if math.isnan(magnitudes[j]) else -float(magnitudes[j]))
    with kernels.forced(variant):
        positions, sent, count = kernels.select_above(magnitudes.clone(), threshold, capacity, strict=True)
    flagged = positions[sent].tolist()
    assert positions.numel() == sent.numel() == capacity and len(set(flagged)) == len(flagged)
    assert sorted(flagged) == sorted(by_size[:capacity]) and int(count) == len(above)


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_exceedances(variant):
    magnitudes = _vector(3000).abs()
    with kernels.forced(variant):
        tail = kernels.exceedances(magnitudes, 0.5)
    assert sorted(tail.tolist()) == sorted(a for a in magnitudes.tolist() if a > 0.5)


@pytest.mark.parametrize("variant", CPU_VARIANTS)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 9, 1001])
def test_pack_and_unpack_bits(variant, bits, n):
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    plain = [
        sum(int(codes[i + j]) << (j * bits) for j in range(8 // bits) if i + j < n) for i in range(0, n, 8 // bits)
    ]
    with kernels.forced(variant):
        packed = kernels.pack_bits(codes, bits)
        assert packed.tolist() == plain
        assert torch.equal(kernels.unpack_bits(packed, bits, n), codes)
        signs = kernels.pack_signs(_vector(n))
    assert torch.equal(signs, kernels.pack_bits(_vector(n) >= 0, 1))


@pytest.mark.parametrize("variant", ["numpy", "torch", "cupy"])
@pytest.mark.parametrize("n", [1, 8, 13, 1001])
def test_pack_signs_sets_bit_j_of_byte_i_for_element_8i_plus_j_at_least_0(variant, n):
    """Against the wire format computed plainly; -0.0 counts as ``>= 0``, NaN does not. Forced
    ``"cupy"`` on the CPU runs the CuPy variant's code through numpy."""
    values = _vector(n, seed=n)
    special = torch.tensor([-0.0, 0.0, float("nan"), -1.0, 1.0])[:n]
    values[: len(special)] = special
    plain = [sum(int(values[i + j] >= 0) << j for j in range(8) if i + j < n) for i in range(0, n, 8)]
    with kernels.forced(variant):
        assert kernels.variant_for(values, triton=True, cupy=True) == variant
        packed = kernels.pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.tolist() == plain


def test_forced_cupy_runs_the_cupy_variant_where_an_operation_has_one_and_torch_elsewhere():
    x = torch.zeros(3)
    with kernels.forced("cupy"):
        assert kernels.variant_for(x, cupy=True) == "cupy"
        assert kernels.variant_for(x, triton=True) == "torch"
        assert not kernels.in_host_memory(x)
    assert kernels.variant_for(x, triton=True, cupy=True) == "numpy"  # the host keeps its own variant


@pytest.mark.parametrize("name", ["signsgd", "signum", "onebit", "efsignsgd"])
def test_sign_compressors_through_the_cupy_variant_equal_the_torch_variant(name):
    """Every step's average and state, bit for bit: the packed signs are the same bytes."""
    for (a, state_a, _), (b, state_b, _) in zip(_steps(name, "cupy"), _steps(name, "torch")):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert all(torch.equal(state_a[key], state_b[key]) for key in state_a)


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_frexp_and_fill_where_zero(variant):
    a = _vector(500).abs()
    a[::4] = 0
    mantissa, exponent = torch.empty(500), torch.empty(500, dtype=torch.int32)
    target = torch.arange(500, dtype=torch.int32)
    with kernels.forced(variant):
        kernels.frexp_into(a, mantissa, exponent)
        kernels.fill_where_zero(target, a, -1)
    expected = torch.frexp(a)
    assert torch.equal(mantissa, expected.mantissa) and torch.equal(exponent, expected.exponent)
    assert target.tolist() == [-1 if i % 4 == 0 else i for i in range(500)]


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_uniform_draws_are_reproducible_and_uniform(variant):
    n = 200_000
    with kernels.forced(variant):
        first, again, other = (kernels.uniform_(torch.empty(n), seed) for seed in (3, 3, 4))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert 0 <= float(first.min()) and float(first.max()) < 1
    # mean 1/2 and variance 1/12: within 5 standard errors
    assert abs(float(first.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(first.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_per_tensor_sums_and_selection(variant):
    shapes = [torch.Size([7]), torch.Size([3, 5]), torch.Size([1]), torch.Size([40])]
    bucket = Bucket(0, ["a", "b", "c", "d"], shapes, torch.float32, torch.device("cpu"))
    values = _vector(bucket.numel)
    mask = values > 0
    yes, no = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([-1.0, -2.0, -3.0, -4.0])
    with kernels.forced(variant):
        sums = bucket.sum_per_tensor(values)
        magnitudes = bucket.sum_per_tensor(values, magnitudes=True)
        selected = bucket.select_per_tensor(mask, yes, no)
    pieces = [values[o : o + n] for o, n in zip(bucket.offsets, bucket.numels)]
    torch.testing.assert_close(sums, torch.stack([p.sum() for p in pieces]))
    torch.testing.assert_close(magnitudes, torch.stack([p.abs().sum() for p in pieces]))
    ids = [t for t, n in enumerate(bucket.numels) for _ in range(n)]
    assert selected.tolist() == [float(yes[t] if m else no[t]) for t, m in zip(ids, mask.tolist())]


@pytest.mark.parametrize("variant", CPU_VARIANTS)
@pytest.mark.parametrize("finite", [True, False])
def test_assign_if_finite(variant, finite):
    target, value = torch.zeros(4), torch.ones(4)
    with kernels.forced(variant):
        kernels.assign_if_finite(target, value, torch.tensor(finite))
    assert target.tolist() == ([1.0] * 4 if finite else [0.0] * 4)


def _bucket() -> Bucket:
    shapes = [torch.Size([64, 32]), torch.Size([32]), torch.Size([16, 8, 3, 3]), torch.Size([10])]
    return Bucket(0, ["w1", "b1", "conv", "b2"], shapes, torch.float32, torch.device("cpu"))


def _steps(name: str, variant: str | None, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Three steps of one rank's exchange (world size 1) with residual memory where the compressor
    takes one; a NaN in the second step's gradient. The averages and the error-feedback state."""
    bucket = _bucket()
    options = {"powersgd": dict(start_iter=0), "acpsgd": dict(start_iter=0)}.get(name, {})
    compressor = COMPRESSORS.build(name, **options)
    memory = MEMORIES.build("none" if compressor.keeps_error_feedback else "residual")
    communicator = COMMUNICATORS.build("allreduce" if compressor.summable else "allgather")
    communicator.bind(None)
    results = []
    with kernels.forced(variant) if variant else nullcontext():
        for step in range(steps):
            compressor.begin_step(step)
            grad = _vector(bucket.numel, seed=step)
            if step == 1:
                grad[5] = float("nan")
            average, finite = finish(memory.exchange(grad, bucket, compressor, communicator))
            state = {**memory.buffers, **compressor.buffers}
            results.append((average.clone(), {k: v[0].clone() for k, v in state.items()}, finite))
    return results


@pytest.mark.parametrize("name", sorted(set(COMPRESSORS.names()) - OWN_DRAWS - DEVICE_DRAWS))
def test_the_accelerator_variants_equal_the_cpu_variants(name):
    """Every deterministic compressor, with residual memory: the variants accelerators run (plain
    torch, forced on the CPU) give the averages and state of the CPU variants, to fp32 rounding of
    sums taken in another order; the non-finite step leaves the state as it was in both."""
    host, accelerator = _steps(name, None), _steps(name, "torch")
    for step, ((a, state_a, finite_a), (b, state_b, finite_b)) in enumerate(zip(host, accelerator)):
        assert (finite_a is None) == (finite_b is None)
        if finite_a is not None:
            assert bool(finite_a) == bool(finite_b) == (step != 1)
        if step != 1:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            torch.testing.assert_close(state_a[key], state_b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OWN_DRAWS))
def test_the_accelerator_variants_of_the_stochastic_quantizers_are_unbiased(name):
    """With the torch variants forced (their own generator), the mean of many independent decodes
    approaches ``g``: ``‖mean − g‖²`` against the sampled variance ``Σ_i var_i / N``, its
    expectation for an unbiased quantizer."""
    bucket = _bucket()
    g = _vector(bucket.numel, seed=11)
    compressor = COMPRESSORS.build(name)
    draws = 300
    with kernels.forced("torch"):
        decodes = []
        for step in range(draws):
            compressor.begin_step(step)
            decodes.append(compressor.decode(compressor.encode(g.clone(), bucket), bucket))
    decodes = torch.stack(decodes).double()
    expected = decodes.var(dim=0).sum() / draws
    assert float((decodes.mean(dim=0) - g.double()).square().sum()) < 2 * float(expected)
    assert bool(all_finite(decodes))


@pytest.mark.parametrize("variant", CPU_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), -float("inf"), float("nan")])
def test_all_finite_finds_every_inf_and_nan(variant, dtype, bad):
    """As ``isfinite(x).all()``, wherever the bad value sits and beside the largest finite values."""
    for position in (0, 500, 999):
        flat = torch.randn(1000, generator=torch.Generator().manual_seed(position)).to(dtype)
        flat[7] = torch.finfo(dtype).max
        flat[8] = -torch.finfo(dtype).max
        if bad is not None:
            flat[position] = bad
        with kernels.forced(variant):
            assert bool(kernels.all_finite(flat)) == bool(torch.isfinite(flat).all())


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_row_max_magnitudes(variant):
    rows = torch.randn(7, 33, generator=torch.Generator().manual_seed(3))
    rows[2, 5] = -40.0
    with kernels.forced(variant):
        out = torch.empty(7)
        assert kernels.row_max_magnitudes(rows, out) is out
    assert torch.equal(out, rows.abs().amax(dim=1))


def test_select_above_without_compaction_takes_the_largest_of_all(monkeypatch):
    """Where ``nonzero_static`` does not run (torch < 2.6 on CUDA), the torch variant's one top-k
    over the bucket flags the ``capacity`` largest of all the entries above the threshold."""
    from gc_strategy.kernels import torch_ops

    monkeypatch.setattr(torch_ops, "compacts", lambda magnitudes: False)
    magnitudes = _vector(5000).abs()
    above = [j for j, a in enumerate(magnitudes.tolist()) if a > 0.5]
    largest = sorted(above, key=lambda j: -float(magnitudes[j]))[:300]
    with kernels.forced("torch"):
        positions, sent, count = kernels.select_above(magnitudes.clone(), 0.5, 300, strict=True)
    assert sorted(positions[sent].tolist()) == sorted(largest) and int(count) == len(above)
