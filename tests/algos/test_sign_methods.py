"""Sign methods against plain reference math (docs/algorithms.md §4)."""

import math

import pytest
import torch
from compressor_helpers import EDGE_INPUTS, bucket, build, payload_bytes, roundtrip

from gc_strategy.bucket import Bucket

SHAPES = [torch.Size([3, 4]), torch.Size([5]), torch.Size([2, 3, 3]), torch.Size([1])]


def fused_bucket() -> Bucket:
    return Bucket(0, [f"t{i}" for i in range(len(SHAPES))], SHAPES, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name, scalars_per_tensor", [("signsgd", 0), ("signum", 0), ("onebit", 2), ("efsignsgd", 1)])
@pytest.mark.parametrize("n", [1, 9, 1000])
def test_one_bit_per_element_plus_scalars(name, scalars_per_tensor, n):
    assert payload_bytes(build(name).encode(torch.randn(n), bucket(n))) == math.ceil(n / 8) + 4 * scalars_per_tensor
    fused = fused_bucket()
    sent = payload_bytes(build(name).encode(torch.randn(fused.numel), fused))
    assert sent == math.ceil(fused.numel / 8) + 4 * scalars_per_tensor * len(SHAPES)


def reference_onebit(g: torch.Tensor) -> torch.Tensor:
    positive = g >= 0
    pos_mean = g[positive].mean() if positive.any() else torch.tensor(0.0)
    neg_mean = g[~positive].mean() if (~positive).any() else torch.tensor(0.0)
    return torch.where(positive, pos_mean, neg_mean)


def reference_efsignsgd(g: torch.Tensor) -> torch.Tensor:
    return g.abs().mean() * torch.where(g >= 0, 1.0, -1.0)


@pytest.mark.parametrize("name, reference", [("onebit", reference_onebit), ("efsignsgd", reference_efsignsgd)])
def test_scaled_sign_methods_take_their_scalars_per_tensor_in_a_fused_bucket(name, reference):
    """A fused bucket decodes as if each tensor had been compressed alone (the papers' layer-wise form)."""
    fused = fused_bucket()
    g = torch.randn(fused.numel) * torch.repeat_interleave(
        torch.tensor([1.0, 100.0, 0.01, 3.0]), torch.tensor(fused.numels)
    )
    compressor = build(name)
    out = compressor.decode(compressor.encode(g, fused), fused)
    expected = torch.cat([reference(part.flatten()) for part in fused.views(g)])
    assert torch.allclose(out, expected, rtol=1e-6, atol=0)


def test_signsgd_decode_and_majority_vote():
    g = torch.tensor([0.5, -0.2, 0.0, -3.0])
    compressor = build("signsgd", world_size=3)
    assert torch.equal(roundtrip(compressor, g), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    grads = [
        torch.tensor([1.0, -1.0, 2.0, -1.0]),
        torch.tensor([1.0, 1.0, -2.0, -1.0]),
        torch.tensor([-1.0, 1.0, -1.0, 1.0]),
    ]
    payloads = [compressor.encode(x, bucket(4)) for x in grads]
    reference = torch.sign(sum(torch.where(x >= 0, 1.0, -1.0) for x in grads))
    assert torch.equal(compressor.aggregate(payloads, bucket(4)), reference)
    tie = compressor.aggregate(payloads[:2], bucket(4))  # two ranks disagree: sign(0) = 0
    assert torch.equal(tie, torch.tensor([1.0, 0.0, 0.0, -1.0]))


def test_signum_momentum_recurrence_and_non_finite_guard():
    compressor = build("signum", momentum=0.8)
    b = bucket(3)
    m = torch.zeros(3)
    for x in [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([-3.0, 1.0, 0.1]), torch.tensor([0.2, 0.2, -9.0])]:
        m = 0.8 * m + 0.2 * x
        assert torch.equal(compressor.decode(compressor.encode(x, b), b), torch.where(m >= 0, 1.0, -1.0))
        assert torch.allclose(compressor.buffer("momentum", b), m)
    compressor.encode(torch.tensor([float("nan"), 1.0, 1.0]), b)
    assert torch.allclose(compressor.buffer("momentum", b), m)


def test_onebit_decodes_to_the_two_side_means():
    g = torch.tensor([2.0, -1.0, 4.0, -3.0, 0.0])
    out = roundtrip(build("onebit"), g)
    assert torch.allclose(out, torch.tensor([2.0, -2.0, 2.0, -2.0, 2.0]))


def test_efsignsgd_scales_the_sign_by_the_mean_magnitude():
    g = torch.tensor([2.0, -1.0, 4.0, -3.0])
    assert torch.allclose(roundtrip(build("efsignsgd"), g), 2.5 * torch.tensor([1.0, -1.0, 1.0, -1.0]))


@pytest.mark.parametrize("name", ["signsgd", "signum", "onebit", "efsignsgd"])
@pytest.mark.parametrize("case", sorted(EDGE_INPUTS))
def test_sign_methods_survive_edge_inputs(name, case):
    g = EDGE_INPUTS[case]()
    out = roundtrip(build(name), g)
    assert out.shape == g.shape and torch.isfinite(out).all()


def test_bucket_per_tensor_helpers_equal_their_definitions():
    """Per-tensor sums and per-tensor selection, against the plain per-tensor loops."""
    from gc_strategy.bucket import Bucket

    shapes = [torch.Size([3, 4]), torch.Size([1]), torch.Size([50]), torch.Size([2, 2, 3])]
    bucket = Bucket(0, ["a", "b", "c", "d"], shapes, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    values = torch.randn(bucket.numel, generator=g)
    sums = torch.stack([v.sum() for v in bucket.views(values)])
    torch.testing.assert_close(bucket.sum_per_tensor(values), sums)
    assert torch.equal(
        bucket.sum_per_tensor(values, magnitudes=True), torch.stack([v.abs().sum() for v in bucket.views(values)])
    )
    mask = values > 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        yes, no = torch.randn(4, generator=g).to(dtype), torch.randn(4, generator=g).to(dtype)
        yes[1], no[2] = -0.0, float("-inf")
        expected = torch.cat([torch.where(m.reshape(-1), yes[i], no[i]) for i, m in enumerate(bucket.views(mask))])
        selected = bucket.select_per_tensor(mask, yes, no)
        assert selected.dtype == dtype and torch.equal(selected, expected)
        assert torch.equal(torch.signbit(selected), torch.signbit(expected))  # -0.0 stays -0.0
        assert torch.equal(bucket.select_per_tensor(mask.to(torch.uint8), yes, no), expected)  # 0/1 codes as mask
    assert torch.equal(bucket.per_element(yes), torch.cat([yes[i].expand(n) for i, n in enumerate(bucket.numels)]))
