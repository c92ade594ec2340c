"""Fault tolerance across replica groups (gc_strategy/sync/fault_tolerant.py), tested for real: a
torchft lighthouse on loopback, each replica group a process started here (tests/ft_worker.py), one
killed with SIGKILL in the middle of a step and started again under its old id."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

coordination = pytest.importorskip("torchft.coordination")

from ft_worker import batch, model  # noqa: E402

from gc_strategy import build_components  # noqa: E402
from gc_strategy.sync.fault_tolerant import FaultTolerance, FaultTolerantSynchronizer  # noqa: E402

WORKER = Path(__file__).with_name("ft_worker.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def lighthouse():
    """torchft's lighthouse on loopback: a quorum as soon as the live groups asked (or after 0.5 s)."""
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500)
    yield server.address()
    server.shutdown()


def start(lighthouse: str, group: int, groups: int, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    args = [
        "--lighthouse",
        lighthouse,
        "--group",
        str(group),
        "--groups",
        str(groups),
        "--out",
        str(out / f"{group}.pt"),
    ]
    log = open(out / f"{group}.log", "ab")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen([sys.executable, str(WORKER), *args, *extra], env=env, stdout=log, stderr=log)


def finish(process: subprocess.Popen, out: Path, group: int, timeout: float = 240) -> dict:
    try:
        assert process.wait(timeout=timeout) == 0, (out / f"{group}.log").read_text()[-3000:]
    finally:
        process.kill()
    return torch.load(out / f"{group}.pt")


@pytest.mark.parametrize(("compressor", "memory"), [("topk", "residual"), ("powersgd", "none")])
def test_a_group_killed_in_a_step_fails_that_step_everywhere_and_comes_back_bit_identical(
    lighthouse, tmp_path, compressor, memory
):
    """Three groups; group 2 is killed (SIGKILL) after the forward of a step (from step 6 on) that
    all three take part in. The survivors' step fails: no commit, and their error feedback and
    compressor state are, to the bit, what they were before the step. They go on as two; group 2,
    started again, heals from a live peer, and every group ends with the same parameters to the bit
    (PowerSGD's shared factors healed too)."""
    options = ["--steps", "30", "--compressor", compressor, "--memory", memory]
    groups = [start(lighthouse, g, 3, tmp_path, *options, *(["--die-at", "6"] if g == 2 else [])) for g in range(3)]
    groups[2].wait(timeout=120)
    assert groups[2].returncode == -signal.SIGKILL
    groups[2] = start(lighthouse, 2, 3, tmp_path, *options)
    results = [finish(p, tmp_path, g) for g, p in enumerate(groups)]
    for survivor in results[:2]:
        failed = [r for r in survivor["record"] if not r["committed"]]
        assert failed, "the step group 2 died in was committed"
        died = failed[0]["step"]
        assert died >= 6 and failed[0]["participants"] == 3
        assert all(r["state_kept"] for r in failed)  # the roles' state as before the failed step
        after = [r["participants"] for r in survivor["record"] if r["committed"] and r["step"] >= died]
        assert after[0] == 2 and after[-1] == 3  # on as two, then three again
    healed = results[2]["record"]
    assert healed[0]["step"] > died and healed[-1]["participants"] == 3  # took its peer's step, not 0
    for name, value in results[0]["params"].items():
        for other in results[1:]:
            assert torch.equal(value, other["params"][name]), name
    if memory == "residual":  # the healed group's own error feedback started at zero: it differs
        residual = results[2]["state"]["memory"]["residual"]
        assert any(not torch.equal(residual[p], results[0]["state"]["memory"]["residual"][p]) for p in residual)


def test_two_groups_without_failures_average_as_plain_data_parallel_training(lighthouse, tmp_path):
    """``compressor=none``, two groups, each step committed only with both (``min_replicas=2``):
    the parameters of every group equal those of plain SGD on the average of the two groups'
    gradients, computed here step by step."""
    steps = 12
    options = ["--steps", str(steps), "--min-replicas", "2"]
    groups = [start(lighthouse, g, 2, tmp_path, *options) for g in range(2)]
    results = [finish(p, tmp_path, g) for g, p in enumerate(groups)]
    for result in results:
        assert [r["step"] for r in result["record"] if r["committed"]] == list(range(steps))
    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        grads = []
        for group in range(2):
            reference.zero_grad()
            x, y = batch(group, step)
            (reference(x) - y).square().mean().backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for p, *each in zip(reference.parameters(), *grads):
            p.grad = sum(each) / 2
        optimizer.step()
    for name, value in reference.named_parameters():
        for result in results:
            torch.testing.assert_close(result["params"][name], value.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lighthouse": "127.0.0.1:29510"}, "lighthouse = '127.0.0.1:29510' is invalid; allowed: the lighthouse's"),
        ({"replica_group": -1}, "replica_group = -1 is invalid; allowed: an integer >= 0"),
        ({"min_replicas": 0}, "min_replicas = 0 is invalid; allowed: an integer >= 1"),
        ({"timeout_s": 0}, "timeout_s = 0 is invalid; allowed: a number of seconds > 0"),
    ],
)
def test_bad_options_are_refused_with_the_option_the_value_and_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        FaultTolerance(**{"lighthouse": "http://127.0.0.1:29510", "replica_group": 0, **options})


def test_a_measured_fusion_plan_is_refused_before_any_work():
    options = FaultTolerance("http://127.0.0.1:1", 0)
    with pytest.raises(ValueError, match="fusion = 'auto' is invalid"):
        FaultTolerantSynchronizer(model(), build_components("topk", "residual", fusion="auto"), options)
