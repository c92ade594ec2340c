"""A fault-tolerant sync mode added in its own file, with no edit to any integration or to the
fault-tolerance package: docs/extending.md's ``local_odd_steps`` (a round on even steps, local
steps between) trains two replica groups on a real lighthouse (tests/ft_toy_worker.py) in a plain
loop, under Lightning and under Accelerate, each selecting it by name, against the schedule
computed plainly here."""

import subprocess
import sys

import pytest
import torch
from locations import TESTS

coordination = pytest.importorskip("torchft.coordination")

from ft_groups import group_env  # noqa: E402
from ft_worker import batch, model  # noqa: E402

WORKER = TESTS / "ft_toy_worker.py"
STEPS = 6


def _reference() -> list[dict[str, torch.Tensor]]:
    """Each group's model: even steps take the mean of both groups' gradients, odd ones their own."""
    models = [model(), model()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(STEPS):
        grads = []
        for group, net in enumerate(models):
            net.zero_grad()
            x, y = batch(group, step)
            (net(x) - y).square().mean().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for group, (net, optimizer) in enumerate(zip(models, optimizers)):
            for i, p in enumerate(net.parameters()):
                p.grad = (grads[0][i] + grads[1][i]) / 2 if step % 2 == 0 else grads[group][i]
            optimizer.step()
    return [{name: p.detach() for name, p in net.named_parameters()} for net in models]


@pytest.mark.slow
@pytest.mark.parametrize("via", ["loop", "lightning", "accelerate"])
def test_a_fault_tolerant_mode_of_its_own_file_trains_in_every_integration(tmp_path, via):
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500)
    try:
        command = [sys.executable, str(WORKER), "--lighthouse", server.address(), "--via", via]
        command += ["--steps", str(STEPS)]
        groups = [
            subprocess.Popen(
                [*command, "--group", str(g), "--out", str(tmp_path / f"{g}.pt")],
                env=group_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for g in range(2)
        ]
        for process in groups:
            output = process.communicate(timeout=240)[0]
            assert process.returncode == 0, output.decode()[-3000:]
    finally:
        server.shutdown()
    expected = _reference()
    for g in range(2):
        result = torch.load(tmp_path / f"{g}.pt")
        assert result["reports"][0][:2] == (2, True) and result["reports"][-1][2] == 0  # rounds of both, none failed
        for name, value in expected[g].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(torch.load(tmp_path / "0.pt")["params"]["2.bias"], expected[1]["2.bias"])
