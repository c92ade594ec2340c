"""The fixed fusion plans cut the gradient-ready sequence as documented."""

import random

import pytest
import torch
import torch.distributed as dist

from gc_strategy.fusion import GroupsPlanner, LayerwisePlanner, SinglePlanner, SizeCapPlanner, parse_fusion

MB = 1024 * 1024


def test_layerwise_and_single():
    sizes = [4, 8, 12]
    assert LayerwisePlanner().plan(sizes) == [1, 1, 1]
    assert SinglePlanner().plan(sizes) == [3]
    assert SinglePlanner().plan([]) == []


def test_groups_of_about_equal_bytes():
    assert GroupsPlanner(2).plan([10] * 8) == [4, 4]
    assert GroupsPlanner(4).plan([10] * 8) == [2, 2, 2, 2]
    # one huge tensor first: the cut lands right after it
    assert GroupsPlanner(2).plan([100, 10, 10, 10, 10]) == [1, 4]
    assert GroupsPlanner(1).plan([1, 2, 3]) == [3]
    # more groups than tensors: layer-wise
    assert GroupsPlanner(8).plan([5, 5, 5]) == [1, 1, 1]


def test_groups_balance_on_random_sizes():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 1000) for _ in range(rng.randint(1, 40))]
        n = rng.randint(1, 10)
        groups = GroupsPlanner(n).plan(sizes)
        assert sum(groups) == len(sizes) and min(groups) >= 1 and len(groups) == min(n, len(sizes))
        # each cut is within one tensor of the ideal byte position
        cum = 0
        for k, g in enumerate(groups[:-1], start=1):
            cum += g
            ideal = sum(sizes) * k / len(groups)
            assert abs(sum(sizes[:cum]) - ideal) <= max(sizes) or len(groups) < n


def test_size_cap_closes_a_bucket_once_it_reaches_the_cap():
    sizes = [MB, MB, 3 * MB, MB // 2, MB // 2, MB]
    assert SizeCapPlanner(2).plan(sizes) == [1, 2, 3]  # the first bucket closes at 1 MiB, like DDP's
    assert SizeCapPlanner(100).plan(sizes) == [1, 5]
    assert SizeCapPlanner(0.25).plan([MB // 8] * 4) == [2, 2]  # a cap below 1 MiB applies to the first too


@pytest.mark.parametrize("cap_mb", [25, 4, 1.5])
def test_size_cap_buckets_like_ddp(cap_mb):
    """The reference is DDP's own assignment (first bucket 1 MiB, then the cap) on fp32 tensors."""
    g = torch.Generator().manual_seed(int(cap_mb * 10))
    numels = [int(n) for n in torch.randint(1, 3_000_000, (40,), generator=g)]
    reference, _ = dist._compute_bucket_assignment_by_size(
        [torch.empty(n) for n in numels], [dist._DEFAULT_FIRST_BUCKET_BYTES, int(cap_mb * MB)]
    )
    assert SizeCapPlanner(cap_mb).plan([4 * n for n in numels]) == [len(bucket) for bucket in reference]


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("layerwise", "layerwise"),
        ("single", "single"),
        ("groups:4", "groups:4"),
        ("bucket_mb:25", "bucket_mb:25"),
        ("bucket_mb:0.5", "bucket_mb:0.5"),
    ],
)
def test_parse(spec, expected):
    assert parse_fusion(spec).describe() == expected


def test_planner_objects_pass_through():
    plan = GroupsPlanner(3)
    assert parse_fusion(plan) is plan
