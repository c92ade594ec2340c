"""A sync mode added through the public registry with no edit to any integration, as
docs/extending.md writes it (its blocks run here): ``every_other_step`` averages the gradients of
even steps and trains locally on odd ones. It runs in a plain loop (against the same schedule
computed plainly on one process), under Lightning's ``gc_fused`` and under Accelerate, each
selecting it by name."""

import json
from pathlib import Path

import pytest
import torch
from models import ParityModule, SmallCNN, fit
from test_extending import _examples

from gc_strategy import SYNC_MODES, GCFusedStrategy, Replicated, build_components
from gc_strategy.tools.ranks import run_ranks

_examples()  # registers the page's sync mode


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def _plain_loop(rank, world_size):
    torch.manual_seed(0)
    model = SmallCNN()
    sync = SYNC_MODES.build("every_other_step").build(model, build_components("none"), Replicated())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        with sync.forward_pass():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        sync.after_optimizer_step()
    sync.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), sync.inner.telemetry.steps


def _reference(world_size=2, steps=4):
    """The schedule computed plainly on one process: a model per rank, each rank's own gradient,
    averaged over the ranks on even steps."""
    torch.manual_seed(0)
    models = [SmallCNN() for _ in range(world_size)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    for step in range(steps):
        grads = []
        for rank, model in enumerate(models):
            x, y = _batch(rank, step)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for rank, model in enumerate(models):
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    g = sum(gs[i] for gs in grads) / world_size if step % 2 == 0 else grads[rank][i]
                    p -= 0.1 * g
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]


@pytest.mark.slow
def test_a_registered_mode_runs_in_a_plain_loop():
    ranks = run_ranks(_plain_loop, 2)
    expected = _reference()
    for rank, (parameters, synchronised) in enumerate(ranks):
        torch.testing.assert_close(parameters, expected[rank], rtol=1e-5, atol=1e-6)
        assert synchronised == 2  # steps 0 and 2
    assert not torch.equal(ranks[0][0], ranks[1][0])  # the odd steps were local


class _Recorded(ParityModule):
    """Records each rank's synchroniser and its count of synchronised steps (the replicas differ
    after local steps, so the parity check is not made)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def on_train_end(self) -> None:
        sync = self.trainer.strategy.synchronizer
        record = {"kind": type(sync).__name__, "synchronised": sync.inner.telemetry.steps, "steps": sync.step}
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_a_registered_mode_runs_under_lightning_by_name(tmp_path):
    fit(_Recorded(tmp_path), GCFusedStrategy(sync="every_other_step", start_method="fork"))
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {"kind": "EveryOther", "synchronised": 2, "steps": 4}


def _accelerate(out: str) -> None:
    import accelerate

    import gc_strategy.integrations.accelerate as gc_accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = gc_accelerate.prepare(accelerator, model, optimizer, sync="every_other_step")
    for step in range(4):
        x, y = _batch(accelerator.process_index, step)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    sync = model.gc_synchronizer
    record = {"kind": type(sync).__name__, "synchronised": sync.inner.telemetry.steps, "steps": sync.step}
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_a_registered_mode_runs_under_accelerate_by_name(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    accelerate.debug_launcher(_accelerate, args=(str(tmp_path),), num_processes=2)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {"kind": "EveryOther", "synchronised": 2, "steps": 4}
