"""Selection by magnitude (gc_strategy/kernels/numpy_ops.py on the CPU) against plain sorting."""

import math

import pytest
import torch

from gc_strategy.kernels import positions_at_least as at_least
from gc_strategy.kernels import top_k
from gc_strategy.kernels.numpy_ops import SAMPLE


def _reference_top(magnitudes, k):
    """The k largest magnitudes, sorted (NaN largest, as torch.sort orders it)."""
    return magnitudes.sort(descending=True).values[:k].sort().values


@pytest.mark.parametrize("n, k", [(10, 3), (SAMPLE + 1, 655), (300_000, 3000), (300_000, 1), (300_000, 299_999)])
def test_top_k_is_exact(n, k):
    magnitudes = torch.randn(n).abs() * torch.rand(n)
    picked = top_k(magnitudes, k)
    assert picked.dtype == torch.int64 and picked.numel() == k == picked.unique().numel()
    assert torch.equal(magnitudes[picked].sort().values, _reference_top(magnitudes, k))


def test_top_k_is_exact_on_a_vector_that_is_mostly_zeros():
    """A 3x3 convolution on 1x1 maps: 8 of 9 weights get no gradient."""
    magnitudes = torch.rand(300_000) * (torch.rand(300_000) < 0.1)
    assert torch.equal(magnitudes[top_k(magnitudes, 3000)].sort().values, _reference_top(magnitudes, 3000))


def test_top_k_is_exact_when_the_sample_misses_the_largest():
    """Every third element is large and the strided sample holds only those: its threshold leaves
    fewer than k candidates, so the full selection runs."""
    n = 3 * SAMPLE
    magnitudes = torch.rand(n)
    magnitudes[::3] += 10
    k = n // 2  # more than the large ones: the rest must come from the small ones
    assert torch.equal(magnitudes[top_k(magnitudes, k)].sort().values, _reference_top(magnitudes, k))


def test_top_k_with_ties_and_zeros_keeps_k_of_the_largest_values():
    magnitudes = torch.zeros(200_000)
    magnitudes[:1000] = 1.0
    picked = top_k(magnitudes, 1500)
    assert picked.unique().numel() == 1500
    assert magnitudes[picked].sum() == 1000  # every 1.0, then any 500 of the zeros


def test_nan_counts_as_the_largest_magnitude():
    magnitudes = torch.rand(200_000)
    magnitudes[[5, 70_000]] = float("nan")
    assert {5, 70_000} <= set(top_k(magnitudes, 10).tolist())
    assert at_least(magnitudes, 2.0).tolist() == [5, 70_000]
    assert at_least(magnitudes, 2.0, strict=True).tolist() == [5, 70_000]


@pytest.mark.parametrize("strict", [False, True])
def test_at_least_matches_the_comparison(strict):
    magnitudes = torch.randint(0, 5, (10_001,)).float()
    expected = torch.nonzero(magnitudes > 2 if strict else magnitudes >= 2).view(-1)
    assert torch.equal(at_least(magnitudes, 2.0, strict=strict), expected)
    assert torch.equal(at_least(magnitudes, torch.tensor(2.0), strict=strict), expected)
    assert at_least(magnitudes, math.inf).numel() == 0


def test_more_nan_than_k_gives_k_nan_positions():
    magnitudes = torch.rand(200_000)
    magnitudes[::1000] = float("nan")
    picked = top_k(magnitudes, 50)
    assert picked.unique().numel() == 50 and magnitudes[picked].isnan().all()
