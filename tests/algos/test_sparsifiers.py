"""Sparsifiers against plain reference math (docs/algorithms.md §3)."""

import math
import sys

import pytest
import torch
from compressor_helpers import EDGE_INPUTS, bucket, build, finish, payload_bytes, roundtrip
from locations import ROOT

from gc_strategy import kernels


def _op_recorder():
    """``benchmarks/op_recorder.py``'s recorder of aten ops."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from op_recorder import OpRecorder

    return OpRecorder


def _k(density, n):
    return max(1, math.floor(density * n))


@pytest.mark.parametrize("case", sorted(EDGE_INPUTS))
@pytest.mark.parametrize("density", [0.01, 0.3])
def test_topk_keeps_the_k_largest_magnitudes(case, density):
    g = EDGE_INPUTS[case]()
    compressor = build("topk", density=density)
    values, indices = compressor.encode(g, bucket(g.numel()))
    out = compressor.decode([values, indices], bucket(g.numel()))
    k = _k(density, g.numel())
    kept = torch.zeros(g.numel(), dtype=torch.bool)
    kept[indices.long()] = True
    assert kept.sum() == k
    # exactly the reference top-k magnitudes (as a multiset: ties may pick either equal element)
    assert torch.equal(g.abs()[kept].sort().values, g.abs().sort(descending=True).values[:k].sort().values)
    assert torch.equal(out[kept], g[kept]) and torch.all(out[~kept] == 0)


def _sent_set(values, indices, n):
    """The positions whose slots carry a value (fillers carry 0, at any position), checked distinct."""
    carried = indices.long()[values != 0]
    assert carried.unique().numel() == carried.numel()
    sent = torch.zeros(n, dtype=torch.bool)
    sent[carried] = True
    return sent


def _largest_of_the_first(magnitudes, above, capacity):
    """The sent set of a capacity sparsifier that overflows, written out: of the positions above
    the threshold in bucket order, the first ``2C``; of them, the ``C`` with the largest magnitudes."""
    first = above.nonzero().view(-1)[: 2 * capacity]
    sent = torch.zeros(magnitudes.numel(), dtype=torch.bool)
    sent[first[magnitudes[first].topk(capacity).indices]] = True
    return sent


def test_threshold_sends_the_entries_above_tau_that_fit_its_capacity():
    g = torch.randn(999)
    above = g.abs() > 0.5
    roomy = build("threshold", threshold=0.5, capacity=1.0)
    assert torch.equal(roundtrip(roomy, g), torch.where(above, g, torch.zeros_like(g)))
    assert torch.equal(roundtrip(roomy, torch.zeros(10)), torch.zeros(10))

    compressor = build("threshold", threshold=0.5, capacity=0.1)  # 100 slots, about 600 entries above τ
    values, indices = compressor.encode(g, bucket(999))
    assert values.numel() == indices.numel() == 100
    sent = _sent_set(values, indices, 999)
    # the largest of those above τ: the floor (the 150th largest, the whole bucket its sample) lets
    # 150 through, within the 200 candidates
    assert torch.equal(sent.nonzero().view(-1), g.abs().topk(100).indices.sort().values)
    assert torch.equal(values[values != 0], g[indices.long()][values != 0])
    metrics = compressor.pop_metrics()
    assert int(metrics["overflow"]) == int(above.sum()) - 100
    assert float(metrics["density_achieved"]) == pytest.approx(100 / 999)


@pytest.mark.parametrize("variant", ["numpy", "torch"])
def test_threshold_sends_the_largest_of_all_when_far_more_than_its_capacity_exceed_tau(variant):
    """200,000 entries (a fixed draw), nearly all above τ = 0.01, 2,000 slots: the sampled floor
    (about the 3,000th largest, from 6,667 sampled entries) keeps the selection within its 4,000
    candidates, so the 2,000 sent are the 2,000 largest of all, not the largest of the bucket's
    first 4,000 above τ; overflow counts every entry above τ not sent."""
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(200_000, generator=generator) * torch.rand(200_000, generator=generator)
    compressor = build("threshold", threshold=0.01, capacity=0.01)
    with kernels.forced(variant):
        values, indices = compressor.encode(g, bucket(200_000))
    assert torch.equal(_sent_set(values, indices, 200_000), _sent_set(*g.abs().topk(2000), 200_000))
    assert int(compressor.pop_metrics()["overflow"]) == int((g.abs() > 0.01).sum()) - 2000


@pytest.mark.parametrize("n", [50, 10_000, 200_001])
def test_dgc_sends_a_threshold_set_of_about_k_within_its_capacity(n):
    """Plain reference: the threshold is the k_s-th largest of the same sample (the compressor's
    seed; at least max(4096, 100/δ) entries, the whole bucket when that is all of it); the sent set
    is exactly |g| >= thr when it fits C = ceil(1.3 k) slots, else the C largest of its first 2C."""
    g = torch.randn(n) * torch.rand(n)  # heavier tails than a Gaussian
    compressor = build("dgc", density=0.01)
    b = bucket(n)
    values, indices = compressor.encode(g, b)
    k = _k(0.01, n)
    capacity = math.ceil(1.3 * k)
    assert values.numel() == indices.numel() == capacity
    samples = min(n, max(4096, 10_000, math.ceil(0.01 * n)))
    if samples < n:
        generator = torch.Generator().manual_seed(compressor.seed_for(b, shared=False))
        sample = g.abs()[torch.randint(n, (samples,), generator=generator)]
    else:
        sample = g.abs()
    threshold = float(sample.topk(_k(0.01, samples)).values.min())
    above = g.abs() >= threshold
    count = int(above.sum())
    expected = above if count <= capacity else _largest_of_the_first(g.abs(), above, capacity)
    assert 0.7 * k <= count <= 1.3 * k
    assert torch.equal(_sent_set(values, indices, n), expected)
    assert torch.equal(values[values != 0], g[indices.long()][values != 0])
    metrics = compressor.pop_metrics()
    assert float(metrics["density_achieved"]) == pytest.approx(min(count, capacity) / n)
    assert int(metrics["overflow"]) == max(0, count - capacity)


@pytest.mark.parametrize("variant", ["numpy", "torch"])
@pytest.mark.parametrize("encodes", [65, 70])
def test_threshold_counts_its_overflow_per_encode_over_many_unread_encodes(variant, encodes):
    """65 or 70 encodes (more than are kept apart before they are summed; the 65th sums them all)
    of two bucket sizes, hence two capacities, with the metrics unread: the overflow is the entries
    above τ less the sent, ``Σ min(above_i, C_i)``, each encode's count above its threshold read
    from the compressor."""
    generator = torch.Generator().manual_seed(0)
    compressor = build("threshold", threshold=0.5, capacity=0.2)
    demand = sent = elements = 0
    with kernels.forced(variant):
        for encode in range(encodes):
            n = 1000 if encode % 2 else 3000
            g = torch.randn(n, generator=generator) * (1 + encode % 3)
            compressor.encode(g, bucket(n))
            demand += int((g.abs() > 0.5).sum())
            sent += min(int(compressor.above), math.ceil(0.2 * n))
            elements += n
    metrics = compressor.pop_metrics()
    assert demand > sent and int(metrics["overflow"]) == demand - sent
    assert float(metrics["density_achieved"]) == pytest.approx(sent / elements)


def test_dgcs_sample_puts_the_count_in_graces_window():
    """By sampling: with at least 100 sampled entries above the threshold (here the floor 100/δ
    sets the sample, 10,000 of 1,000,000), the count above it falls in [0.7k, 1.3k] in all but a
    few of 200 draws (about 0.3% expected outside)."""
    n, inside = 1_000_000, 0
    g = torch.distributions.StudentT(3.0).sample((n,))
    b = bucket(n)
    for seed in range(200):
        compressor = build("dgc", density=0.01, sample_ratio=0.001, min_sample=1, seed=seed)
        count = int((g.abs() >= compressor.threshold(g.abs(), b)).sum())
        inside += 0.7 * _k(0.01, n) <= count <= 1.3 * _k(0.01, n)
    assert inside >= 196, inside


def test_dgc_keeps_what_overflows_its_capacity_in_the_residual():
    """A threshold that cannot settle (every |g| equal): C slots of the largest go, and residual
    error feedback keeps every entry not sent, exactly."""
    from gc_strategy import MEMORIES

    g = torch.ones(10_000)
    compressor = build("dgc", density=0.01, adjust_rounds=0)
    memory = MEMORIES.build("residual")
    b = bucket(10_000)
    residual = memory.buffer("residual", b)
    payload = compressor.encode_with_residual(g.clone(), residual, torch.tensor(True), b)
    sent = _sent_set(payload[0], payload[1], 10_000)
    assert int(sent.sum()) == math.ceil(1.3 * 100)
    assert torch.equal(residual, torch.where(sent, torch.zeros_like(g), g))
    assert int(compressor.pop_metrics()["overflow"]) == 10_000 - 130


def test_dgc_density_warm_up_is_exponential_from_25_percent():
    compressor = build("dgc", density=0.01, warmup_steps=4)
    densities = []
    for step in range(6):
        compressor.begin_step(step)
        densities.append(compressor.density_now())
    expected = [0.25 * (0.01 / 0.25) ** (s / 4) for s in range(4)] + [0.01, 0.01]
    assert densities == pytest.approx(expected)


def test_randk_draws_the_same_positions_on_every_rank_and_new_ones_each_step():
    g = torch.randn(1000)
    a = build("randk", density=0.05, process_rank=0, world_size=2)
    b = build("randk", density=0.05, process_rank=1, world_size=2)
    assert torch.equal(
        a.decode(a.encode(g, bucket(1000)), bucket(1000)) != 0, b.decode(b.encode(g, bucket(1000)), bucket(1000)) != 0
    )
    b.begin_step(1)
    assert not torch.equal(roundtrip(a, g) != 0, roundtrip(b, g) != 0)
    assert a.encode(g, bucket(1000))[0].numel() == 50  # values only on the wire


def _bucket_draws(drawn: list[int]) -> list[int]:
    """The sizes drawn for the buckets, not the sampler's own inner draws."""
    return [n for n in drawn if n in (1000, 3000)]


def test_randk_draws_each_buckets_positions_once_per_step_with_several_buckets_in_flight(monkeypatch):
    """The synchroniser encodes bucket 1 before it decodes bucket 0: each bucket's positions are drawn once
    per step, and the decode puts the values back where that bucket's encode took them."""
    from gc_strategy.algos import sparse

    drawn = []
    draw = sparse.sample_without_replacement
    monkeypatch.setattr(sparse, "sample_without_replacement", lambda n, k, gen: drawn.append(n) or draw(n, k, gen))
    compressor = build("randk", density=0.05)
    buckets = [bucket(1000, index=0), bucket(3000, index=1)]
    grads = [torch.randn(1000), torch.randn(3000)]
    payloads = [compressor.encode(g, b) for g, b in zip(grads, buckets)]
    decoded = [compressor.decode(p, b) for p, b in zip(payloads, buckets)]
    assert _bucket_draws(drawn) == [1000, 3000]
    for g, d in zip(grads, decoded):
        assert int((d != 0).sum()) == _k(0.05, g.numel())
        assert torch.equal(d, torch.where(d != 0, g, 0.0))
    compressor.begin_step(1)
    compressor.encode(grads[0], buckets[0])
    assert _bucket_draws(drawn) == [1000, 3000, 1000]


def test_randk_with_scaling_is_unbiased():
    g = torch.randn(40)
    compressor = build("randk", density=0.25, unbiased=True)
    trials = 4000
    total = torch.zeros(40)
    for step in range(trials):
        compressor.begin_step(step)
        total += roundtrip(compressor, g)
    mean = total / trials
    # per element the estimate is (n/k) g with probability k/n, else 0: variance g² (n/k - 1)
    std_of_mean = g.abs() * math.sqrt(40 / 10 - 1) / math.sqrt(trials)
    assert torch.all((mean - g).abs() <= 5 * std_of_mean + 1e-7)


def test_sparse_aggregation_adds_overlapping_indices():
    compressor = build("topk", density=0.5, world_size=2)
    b = bucket(4)
    p0 = [torch.tensor([1.0, 2.0]), torch.tensor([0, 3], dtype=torch.int32)]
    p1 = [torch.tensor([10.0, 20.0]), torch.tensor([3, 1], dtype=torch.int32)]
    assert torch.equal(compressor.aggregate([p0, p1], b), torch.tensor([1.0, 20.0, 0.0, 12.0]) / 2)


@pytest.mark.parametrize(
    "name, options, expected",
    [
        ("topk", dict(density=0.01), lambda n, g: 8 * _k(0.01, n)),
        ("randk", dict(density=0.01), lambda n, g: 4 * _k(0.01, n)),
        ("threshold", dict(threshold=1.0, capacity=0.05), lambda n, g: 8 * math.ceil(0.05 * n)),
        ("dgc", dict(density=0.01), lambda n, g: 8 * math.ceil(1.3 * _k(0.01, n))),
    ],
)
def test_bytes_on_the_wire(name, options, expected):
    n = 10_007
    g = torch.randn(n)
    assert payload_bytes(build(name, **options).encode(g, bucket(n))) == expected(n, g)


def test_sample_without_replacement_draws_every_subset_equally_often():
    """n = 6, k = 2: each of the 15 subsets with probability 1/15, checked by sampling (the counts'
    chi-square statistic, 14 degrees of freedom, stays far below its 0.1% quantile 36.1)."""
    from collections import Counter

    from gc_strategy.algos.sparse import sample_without_replacement

    generator = torch.Generator().manual_seed(0)
    draws = 15_000
    counts = Counter()
    for _ in range(draws):
        chosen = sample_without_replacement(6, 2, generator)
        assert chosen.numel() == 2 and chosen.unique().numel() == 2 and 0 <= int(chosen.min()) and int(chosen.max()) < 6
        counts[tuple(sorted(chosen.tolist()))] += 1
    assert len(counts) == 15
    expected = draws / 15
    chi_square = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi_square < 36.1
    big = sample_without_replacement(11_000_000, 110_000, generator)
    assert big.unique().numel() == 110_000


def test_sample_without_replacement_above_the_permutation_size_is_sorted_and_uniform():
    """n = 400, k = 3 takes the iid-draw path (66 draws < 400 positions): positions are increasing,
    and every position is chosen with probability k/n (chi-square over the 400 counts, 399 degrees
    of freedom, below its 0.1% quantile 492)."""
    from gc_strategy.algos.sparse import sample_without_replacement

    generator = torch.Generator().manual_seed(1)
    n, k, draws = 400, 3, 20_000
    counts = torch.zeros(n)
    for _ in range(draws):
        chosen = sample_without_replacement(n, k, generator)
        assert chosen.numel() == k and bool((chosen[1:] > chosen[:-1]).all())
        counts[chosen] += 1
    expected = draws * k / n
    assert float(((counts - expected) ** 2 / expected).sum()) < 492


def test_sample_on_device_draws_every_subset_equally_often_in_increasing_order():
    """The accelerator's draw (the k largest of n uniform keys), n = 6, k = 2: each of the 15
    subsets with probability 1/15 (chi-square over the counts, 14 degrees of freedom, below its
    0.1% quantile 36.1), distinct and increasing."""
    from collections import Counter

    from gc_strategy.algos.sparse import sample_on_device

    generator = torch.Generator().manual_seed(0)
    keys = torch.empty(6)
    draws = 15_000
    counts = Counter()
    for _ in range(draws):
        chosen, flags = sample_on_device(6, 2, generator, keys)
        assert chosen.numel() == 2 and bool(flags.all())
        assert bool(chosen[1] > chosen[0]) and 0 <= int(chosen[0]) and int(chosen[1]) < 6
        counts[tuple(chosen.tolist())] += 1
    expected = draws / 15
    assert len(counts) == 15 and sum((c - expected) ** 2 / expected for c in counts.values()) < 36.1


@pytest.mark.parametrize("n, k", [(100_000, 1000), (100_000, 1), (5000, 2500)])
def test_sample_on_device_takes_the_k_largest_keys_from_its_compacted_candidates(n, k):
    """Among the keys above ``1 − p`` (about ``k + 8√k + 40`` of them), the draw takes exactly the
    positions of the ``k`` largest of all ``n`` keys, as a top-k over the whole bucket would (20
    seeds), every slot flagged."""
    from gc_strategy.algos.sparse import sample_on_device

    keys = torch.empty(n)
    for seed in range(20):
        chosen, flags = sample_on_device(n, k, torch.Generator().manual_seed(seed), keys)
        assert torch.equal(chosen, keys.topk(k).indices.sort().values) and bool(flags.all())


def test_sample_on_device_flags_the_slots_it_could_not_fill(monkeypatch):
    """Where fewer than ``k`` keys lie above ``1 − p`` (forced here: the keys' draw replaced by 50
    high keys among 10,000 low ones, k = 200), the slots left over hold distinct positions and
    are not flagged, and randk sends 0 there."""
    from gc_strategy.algos import sparse

    def few_high(keys, *args, **kwargs):
        return keys.fill_(0.5).index_fill_(0, torch.arange(0, 10_000, 200), 0.99)

    monkeypatch.setattr(torch.Tensor, "uniform_", few_high)
    chosen, flags = sparse.sample_on_device(10_000, 200, torch.Generator().manual_seed(0), torch.empty(10_000))
    assert int(flags.sum()) == 50 and torch.equal(chosen[flags], torch.arange(0, 10_000, 200))
    assert chosen[~flags].unique().numel() == 150
    monkeypatch.setattr(sparse, "sample_on_device", lambda n, k, generator, keys: (chosen, flags))
    compressor = build("randk", density=0.02)
    g = torch.randn(10_000)
    with kernels.forced("torch"):
        (values,) = compressor.encode(g, bucket(10_000))
    assert torch.equal(values, torch.where(flags, g[chosen], 0.0))


def test_randk_on_the_accelerators_path_draws_alike_on_every_rank_and_unbiased():
    """Kernels forced to the accelerator's variants: the positions come from the device draw, the
    same on two ranks, new each step, and with scaling the estimate is unbiased (as for the host's)."""
    g = torch.randn(40)
    with kernels.forced("torch"):
        a = build("randk", density=0.25, unbiased=True, process_rank=0, world_size=2)
        b = build("randk", density=0.25, unbiased=True, process_rank=1, world_size=2)
        assert torch.equal(roundtrip(a, g), roundtrip(b, g))
        b.begin_step(1)
        assert not torch.equal(roundtrip(a, g) != 0, roundtrip(b, g) != 0)
        total = torch.zeros(40)
        for step in range(4000):
            a.begin_step(step)
            total += roundtrip(a, g)
    std_of_mean = g.abs() * math.sqrt(40 / 10 - 1) / math.sqrt(4000)
    assert torch.all((total / 4000 - g).abs() <= 5 * std_of_mean + 1e-7)


@pytest.mark.parametrize("name", ["topk", "randk", "dgc"])
def test_fused_residual_exchange_matches_plain_error_feedback_and_writes_into_the_gradient_buffer(name):
    """Three steps of the residual memory's exchange (the fused positional path), one process: the
    average is the decode of ``x = g + e`` (written into the gradient buffer that was passed in),
    ``e ← x − decode(x)``; a step with an inf leaves ``e`` as it was."""
    from gc_strategy.algos import MEMORIES
    from gc_strategy.communicators import COMMUNICATORS

    n = 5_000
    b = bucket(n)
    compressor, twin = build(name, density=0.05), build(name, density=0.05)
    memory = MEMORIES.build("residual")
    memory.compensated_exchange = None  # the fused path must not fall back to the separate passes
    communicator = COMMUNICATORS.build("allreduce" if compressor.summable else "allgather")
    communicator.bind(None)
    e = torch.zeros(n)
    for step in range(4):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step))
        if step == 2:
            g[17] = float("inf")
        compressor.begin_step(step)
        twin.begin_step(step)
        buffer = g.clone()
        average, _ = finish(memory.exchange(buffer, b, compressor, communicator))
        x = g + e
        expected = twin.decode(twin.encode(x.clone(), b), b)
        assert average is buffer
        if step != 2:
            assert torch.equal(average, expected)
            e = x - expected
        assert torch.equal(memory.buffer("residual", b), e)


@pytest.mark.parametrize("n, chunk", [(1000, 64), (1024, 64), (50, 64), (70_001, 300)])
@pytest.mark.parametrize("density", [0.05, 0.3])
def test_chunked_topk_keeps_the_largest_of_each_chunk(n, chunk, density):
    """Each chunk of ``c`` consecutive elements (the last one shorter) keeps its ``max(1, ⌊δc⌋)``
    entries of largest |g|, computed plainly chunk by chunk; in-chunk indices travel in 1 byte up
    to 256 elements a chunk, in 2 above."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    compressor = build("topk", density=density, chunk=chunk)
    b = bucket(n)
    values, indices = compressor.encode(g, b)
    assert indices.dtype == (torch.uint8 if chunk <= 256 else torch.int16)
    out = compressor.decode([values, indices], b)
    expected = torch.zeros(n)
    for start in range(0, n, chunk):
        part = g[start : start + chunk]
        top = part.abs().sort(descending=True).indices[: _k(density, part.numel())]
        expected[start + top] = part[top]
    assert torch.equal(out, expected)
    assert payload_bytes([values, indices]) == values.numel() * (4 + indices.element_size())


@pytest.mark.parametrize("chunk", [0, 32])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_topk_with_quantized_values_sends_each_chunks_plain_levels(chunk, bits):
    """SparseLoCo's quantized values: at the positions plain top-k keeps, each value becomes
    sign(v) (j + ½) s / L with L = 2^(b−1) levels, s its chunk's largest kept |v| and
    j = min(⌊|v| L / s⌋, L − 1), computed value by value; codes travel b bits each, one fp32 scale
    per chunk."""
    n = 1000
    g = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    b = bucket(n)
    exact = build("topk", density=0.1, chunk=chunk)
    kept = exact.decode(exact.encode(g, b), b)
    compressor = build("topk", density=0.1, chunk=chunk, value_bits=bits)
    payload = compressor.encode(g, b)
    levels = 2 ** (bits - 1)
    expected = torch.zeros(n)
    step = chunk or n
    for start in range(0, n, step):
        part = kept[start : start + step]
        scale = part.abs().max().item()
        for i in part.nonzero().view(-1).tolist():
            v = part[i].item()
            j = min(math.floor(abs(v) / scale * levels), levels - 1)
            expected[start + i] = math.copysign((j + 0.5) * scale / levels, v)
    torch.testing.assert_close(compressor.decode(payload, b), expected, rtol=1e-6, atol=1e-7)
    k, scales = (kept != 0).sum().item(), math.ceil(n / step)
    index_bytes = 1 if chunk else 4
    assert payload_bytes(payload) == math.ceil(k * bits / 8) + 4 * scales + k * index_bytes
    with kernels.forced("torch"), _op_recorder()() as ops:  # the accelerator's path: the host waits nowhere
        compressor.decode(compressor.encode(g, b), b)
    assert not ops.waits, ops.sites


def test_topk_value_bits_other_than_the_packed_widths_are_refused():
    with pytest.raises(ValueError, match="option 'value_bits' = 3 is invalid; allowed: 0, 1, 2, 4, 8"):
        build("topk", value_bits=3)


def test_chunked_topk_aggregates_and_keeps_its_residual_like_the_plain_math():
    """Two ranks' chunked payloads average as their decodes do; the residual memory's fused path
    keeps ``e = x − decode(x)`` and the accelerator's path makes the host wait nowhere."""
    from gc_strategy.algos import MEMORIES
    from gc_strategy.communicators import COMMUNICATORS

    OpRecorder = _op_recorder()
    n, b = 1000, bucket(1000)
    ranks = [build("topk", density=0.1, chunk=32, world_size=2, process_rank=r) for r in range(2)]
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    payloads = [c.encode(g, b) for c, g in zip(ranks, grads)]
    expected = (ranks[0].decode(payloads[0], b) + ranks[1].decode(payloads[1], b)) / 2
    assert torch.equal(ranks[0].aggregate(payloads, b), expected)
    with kernels.forced("torch"):
        compressor, memory = build("topk", density=0.1, chunk=32), MEMORIES.build("residual")
        communicator = COMMUNICATORS.build("allgather")
        communicator.bind(None)
        with OpRecorder() as ops:
            average, _ = finish(memory.exchange(grads[0].clone(), b, compressor, communicator))
    assert not ops.waits, ops.sites
    assert torch.equal(average, compressor.decode(compressor.encode(grads[0].clone(), b), b))
    assert torch.equal(memory.buffer("residual", b), grads[0] - average)


def test_dgc_threshold_rounds_on_the_accelerators_path_equal_the_hosts():
    """GRACE's rounds (``adjust_rounds=3``): the host stops adjusting at the first threshold whose
    count lies in [0.7k, 1.3k]; the accelerator's path runs every round on the device, a threshold
    in the window kept by a factor of 1: the same threshold, also where the rounds move it (an atom
    of equal magnitudes, 5% of the bucket, puts the sampled threshold's count far above the window)."""
    n, moved = 200_000, 0
    b = bucket(n)
    for seed in range(8):
        torch.manual_seed(seed)
        magnitudes = torch.rand(n) * 0.9 * (seed + 1)
        magnitudes[: n // 200] = (2 + torch.rand(n // 200)) * (seed + 1)  # 0.5% large
        magnitudes[n // 200 : n // 200 + n // 20] = seed + 1  # the atom
        options = dict(density=0.01, seed=seed)
        host, unadjusted = build("dgc", adjust_rounds=3, **options), build("dgc", **options)
        with kernels.forced("torch"):
            device = build("dgc", adjust_rounds=3, **options)
            on_device = device.threshold(magnitudes.clone(), b)
        on_host = host.threshold(magnitudes.clone(), b)
        assert float(on_device) == float(on_host), seed
        moved += float(on_host) != float(unadjusted.threshold(magnitudes.clone(), b))
    assert moved >= 2, moved  # the rounds were exercised


def test_a_capacity_payloads_fillers_change_nothing_on_the_accelerators_path():
    """Under the torch variants a capacity payload's slots left over hold distinct positions (one
    index_add_ into a single repeated position would serialise on its atomics), some of them also
    sent: the decode is ``g`` where ``|g| > τ`` and 0 elsewhere, and masking what was sent (DGC's
    memory: both rows of a ``[2, n]`` tensor) zeroes exactly there."""
    from gc_strategy.algos.base import zero_at

    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    above = g.abs() > 2.0  # about 46 entries, 200 slots
    compressor = build("threshold", threshold=2.0, capacity=0.2)
    b = bucket(1000)
    with kernels.forced("torch"):
        payload = compressor.encode(g, b)
        positions, flags = compressor.sent_positions(payload, b)
        fillers = positions[~flags]
        assert fillers.numel() > 100 and fillers.unique().numel() == fillers.numel()
        assert bool(torch.isin(fillers, positions[flags]).any())
        assert torch.equal(compressor.decode(payload, b), torch.where(above, g, torch.zeros_like(g)))
        state = torch.randn(2, 1000)
        masked = zero_at(state.clone(), compressor.sent_positions(payload, b))
    assert torch.equal(masked, torch.where(above, torch.zeros_like(state), state))
