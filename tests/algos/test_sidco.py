"""SIDCo's estimators reach the target density on data of known distribution (docs/algorithms.md §3)."""

import math

import pytest
import torch
from compressor_helpers import bucket, build

from gc_strategy import kernels
from gc_strategy.algos.sidco import exponential_threshold, gamma_threshold, gpareto_threshold

N = 1_000_000


def _laplace(n, seed=0):
    """Laplace(0, 0.01) samples by inversion: exponential magnitudes with random signs."""
    g = torch.Generator().manual_seed(seed)
    magnitude = -torch.rand(n, generator=g).log() * 0.01
    return magnitude * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("estimator", ["exponential", "gpareto", "gamma"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("density", [0.1, 0.01, 0.001])
def test_achieved_density_within_20_percent_on_laplace_gradients(estimator, stages, density):
    g = _laplace(N)  # |g| is exponential
    compressor = build("sidco", density=density, estimator=estimator, stages=stages, adapt_every=0)
    values, indices = compressor.encode(g, bucket(N))
    assert values.numel() == indices.numel() == math.ceil(1.3 * math.floor(density * N))  # the capacity
    achieved = int((values != 0).sum()) / N
    assert abs(achieved / density - 1) <= 0.2, achieved
    metrics = compressor.pop_metrics()
    assert float(metrics["density_achieved"]) == pytest.approx(achieved) and metrics["density_target"] == density
    assert int(metrics["overflow"]) == 0


def test_estimators_match_their_closed_forms():
    y = torch.tensor([0.5, 1.0, 1.5, 3.0])
    q = 0.05
    mean, var = 1.5, float(y.var(unbiased=False))
    assert float(exponential_threshold(y, q)) == pytest.approx(mean * math.log(1 / q))
    ratio = mean**2 / var
    xi, beta = 0.5 * (1 - ratio), 0.5 * mean * (ratio + 1)
    assert float(gpareto_threshold(y, q)) == pytest.approx(beta / xi * (q ** (-xi) - 1), rel=1e-5)
    # gamma: on a large gamma(k=2, scale=3) sample the fitted threshold is the true 1-q quantile
    sample = torch.distributions.Gamma(2.0, 1 / 3.0).sample((400_000,))
    assert float((sample > gamma_threshold(sample, q)).float().mean()) == pytest.approx(q, rel=0.05)


def test_multi_stage_threshold_adds_the_fits_of_the_exceedances():
    """Three exponential stages, computed plainly: t₁ = mean(a)·ln(1/q₁), then t_{s+1} = t_s +
    mean(a − t_s over a > t_s)·ln(1/q_{s+1})."""
    a = _laplace(50_000, seed=3).abs()
    compressor = build("sidco", density=0.001, estimator="exponential", first_ratio=0.25)
    ratios = compressor.stage_ratios(3)
    threshold = a.double().mean() * math.log(1 / ratios[0])
    for q in ratios[1:]:
        above = a.double()[a.double() > threshold]
        threshold = threshold + (above - threshold).mean() * math.log(1 / q)
    assert float(compressor.fitted_threshold(a, 3)) == pytest.approx(float(threshold), rel=1e-5)
    with kernels.forced("torch"):  # the accelerator's form: exceedances as masks
        assert float(compressor.fitted_threshold(a, 3)) == pytest.approx(float(threshold), rel=1e-5)


def test_stage_ratios_multiply_to_the_density():
    compressor = build("sidco", density=0.001, first_ratio=0.25)
    for stages in range(1, 6):
        assert math.prod(compressor.stage_ratios(stages)) == pytest.approx(0.001)
    assert compressor.max_stages() == math.ceil(math.log(0.001) / math.log(0.5))


def test_adaptive_stages_are_per_bucket_and_bounded():
    g = torch.Generator().manual_seed(0)
    light = torch.randn(100_000, generator=g)  # lighter tail than exponential: too few selected
    heavy = torch.randn(100_000, generator=g).exp()  # log-normal, heavier: too many with one stage
    compressor = build("sidco", density=0.01, stages=2, adapt_every=1)
    compressor.stage_counts["p1"] = 1
    b_light, b_heavy = bucket(100_000, 0), bucket(100_000, 1)
    for step in range(12):
        compressor.begin_step(step)
        compressor.encode(light, b_light)
        _, selected = compressor.encode(heavy, b_heavy)
    counts = compressor.extra_state()["stage_counts"]
    assert counts["p0"] == 1  # stages removed down to the lower bound
    assert counts["p1"] == 2  # a stage added, then the density is within ±20%
    assert abs(float(compressor.above) / 100_000 / 0.01 - 1) <= 0.2
    restored = build("sidco", density=0.01)
    restored.load_extra_state(compressor.extra_state())
    assert restored.extra_state() == compressor.extra_state()


def _heavy_steps(compressor, steps, every_step):
    """Encode one log-normal bucket for ``steps`` steps: the stage count of each step."""
    heavy = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).exp()
    counts = []
    for step in steps:
        compressor.begin_step(step)
        every_step(compressor.encode(heavy, bucket(100_000)))
        counts.append(compressor.stage_counts["p0"])
    return counts


def test_the_density_of_one_adaptation_step_sets_the_stages_from_the_next():
    """Every 2 steps (steps 1, 3, 5, ...): the density measured at step 1 (one stage selects too
    many on log-normal data) adds a stage at step 3, not before; and a checkpoint taken between
    the two carries the measurement, so that a resumed run adapts as the uninterrupted one."""
    counts = _heavy_steps(build("sidco", density=0.01, stages=1, adapt_every=2), range(8), lambda _: None)
    assert counts[:4] == [1, 1, 1, 2]
    first = build("sidco", density=0.01, stages=1, adapt_every=2)
    _heavy_steps(first, range(2), lambda _: None)
    resumed = build("sidco", density=0.01, stages=1, adapt_every=2)
    resumed.load_extra_state(first.extra_state())
    assert _heavy_steps(resumed, range(2, 8), lambda _: None) == counts[2:]


def test_adaptive_stages_on_the_accelerators_path_are_those_of_the_host():
    """Kernels forced to the accelerator's variants (exceedances as masks, the count measured
    through a host copy): the counts and the entries sent equal the host's step by step."""
    host, sent = build("sidco", density=0.01, stages=1, adapt_every=1), []
    expected = _heavy_steps(host, range(6), sent.append)
    with kernels.forced("torch"):
        device = build("sidco", density=0.01, stages=1, adapt_every=1)
        got = []
        assert _heavy_steps(device, range(6), got.append) == expected
    b = bucket(100_000)
    for payload_device, payload_host in zip(got, sent):
        assert torch.equal(device.decode(payload_device, b), host.decode(payload_host, b))
    assert device.extra_state() == host.extra_state() and expected[-1] > 1


def test_nothing_selected_is_a_valid_payload():
    compressor = build("sidco", density=0.001, adapt_every=0)
    values, indices = compressor.encode(torch.zeros(1000), bucket(1000))
    assert values.numel() == indices.numel() == 2 and not values.any()  # the capacity, nothing in it


def test_a_host_copy_that_has_landed_is_read_without_a_host_synchronisation():
    """SIDCo reads its count a step after the copy was queued: the event is asked first, and only
    a copy still on its way makes the host wait on it."""
    from gc_strategy.bucket import HostCopy

    class Event:
        def __init__(self, landed: bool) -> None:
            self.landed, self.waited = landed, False

        def query(self) -> bool:
            return self.landed

        def synchronize(self) -> None:
            self.waited = True

    for landed in (True, False):
        copy = HostCopy(torch.tensor(7))
        copy._event = Event(landed)
        assert int(copy.value()) == 7 and copy._event.waited is not landed
