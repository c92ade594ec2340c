"""The Accelerate adapter: 2 CPU processes through accelerate.debug_launcher."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from models import SmallCNN  # noqa: E402

import gc_strategy.accelerate as gc_accelerate  # noqa: E402
from gc_strategy import DiLoCo  # noqa: E402


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def _write(out: str, accelerator, result: dict) -> None:
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


def _parity_with_accelerate_ddp(out: str, accumulation: int) -> None:
    """compressor=none against Accelerate's own DDP, with gradient accumulation."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    torch.manual_seed(accelerator.process_index)  # different initial weights: the broadcast must fix them
    ours = SmallCNN()
    theirs = copy.deepcopy(ours)
    our_optimizer = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    ours, our_optimizer = gc_accelerate.prepare(accelerator, ours, our_optimizer)
    theirs, their_optimizer = accelerator.prepare(theirs, their_optimizer)
    for step in range(4 * accumulation):
        x, y = _batch(accelerator.process_index, step)
        with accelerator.accumulate(ours, theirs):  # one accumulation counter for both
            for model, optimizer in ((ours, our_optimizer), (theirs, their_optimizer)):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    reference = accelerator.unwrap_model(theirs)
    # parameters and BatchNorm buffers (DDP broadcasts rank 0's before its forwards)
    mine, others = ours.state_dict(), reference.state_dict()
    difference = max((mine[k].double() - others[k].double()).abs().max().item() for k in mine)
    scale = max(p.abs().max().item() for p in reference.parameters())
    _write(
        out,
        accelerator,
        {
            "difference": difference,
            "scale": scale,
            "synchronised_steps": ours.gc_synchronizer.telemetry.steps,
            "wrapped": type(ours).__name__,
            "ddp": type(theirs).__name__,
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_compressor_none_equals_accelerate_ddp_and_accumulation_skips_sync(tmp_path, accumulation):
    accelerate.debug_launcher(_parity_with_accelerate_ddp, args=(str(tmp_path), accumulation), num_processes=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["wrapped"] == "SmallCNN" and result["ddp"] == "DistributedDataParallel"
        assert result["difference"] <= 1e-5 * result["scale"]
        assert result["synchronised_steps"] == 4  # one collective round per optimizer step, none on micro-steps


def _difference_after_resume(out: str, accelerator, model, optimizer, after_step=None) -> float:
    """Train steps 0-2, ``save_state``, steps 3-5; ``load_state`` and steps 3-5 again: the largest
    difference between the weights at the two ends (``after_step(step)`` runs after each step)."""

    def train(steps):
        for step in steps:
            x, y = _batch(accelerator.process_index, step)
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if after_step is not None:
                after_step(step)

    train(range(3))
    accelerator.save_state(str(Path(out, "state")))
    train(range(3, 6))
    first = [p.detach().clone() for p in model.parameters()]
    accelerator.load_state(str(Path(out, "state")))
    train(range(3, 6))
    return max((a - b).abs().max().item() for a, b in zip(first, model.parameters()))


def _resume(out: str) -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = gc_accelerate.prepare(
        accelerator, model, optimizer, compressor="topk", memory="residual", density=0.1
    )

    difference = _difference_after_resume(out, accelerator, model, optimizer)
    residual = model.gc_synchronizer.memory.state_by_parameter(model.gc_synchronizer.buckets)
    _write(
        out,
        accelerator,
        {"difference": difference, "residual_norm": sum(t.norm().item() for t in residual["residual"].values())},
    )


@pytest.mark.slow
def test_save_state_and_load_state_resume_identically_with_residual_memory(tmp_path):
    accelerate.debug_launcher(_resume, args=(str(tmp_path),), num_processes=2)
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["difference"] == 0.0 and result["residual_norm"] > 0
    assert sorted(p.name for p in (tmp_path / "state" / "gc_state").iterdir()) == ["rank0.pt", "rank1.pt"]


def _diloco(out: str) -> None:
    """sync='diloco', H=2, top-k + residual: replicas equal after each outer step; a state saved
    after step 3 (mid-way through an inner phase) resumes bit for bit."""
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(accelerator.process_index)  # different initial weights: the broadcast must fix them
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = gc_accelerate.prepare(
        accelerator, model, optimizer, compressor="topk", memory="residual", density=0.1, sync=DiLoCo(inner_steps=2)
    )
    identical = []

    def check_replicas(step):
        if step % 2 == 1:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            identical.append(bool(torch.equal(accelerator.reduce(flat.clone(), "mean"), flat)))

    difference = _difference_after_resume(out, accelerator, model, optimizer, check_replicas)
    _write(out, accelerator, {"difference": difference, "identical": identical, "outer": model.gc_synchronizer.step})


@pytest.mark.slow
def test_diloco_keeps_replicas_identical_and_resumes_mid_inner_phase(tmp_path):
    accelerate.debug_launcher(_diloco, args=(str(tmp_path),), num_processes=2)
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["difference"] == 0.0
        assert result["identical"] == [True] * 5 and result["outer"] == 3


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM"])
def test_unsupported_distributed_types_are_refused(kind):
    from accelerate.utils import DistributedType

    accelerator = SimpleNamespace(distributed_type=DistributedType(kind))
    with pytest.raises(ValueError, match=f"distributed type is {kind}; supported: NO, MULTI_CPU, MULTI_GPU"):
        gc_accelerate.prepare(accelerator, SmallCNN())


def test_bad_options_are_refused_before_anything_is_moved():
    accelerator = SimpleNamespace(distributed_type="NO")
    with pytest.raises(ValueError, match="option 'density' = 2 is invalid"):
        gc_accelerate.prepare(accelerator, SmallCNN(), compressor="topk", density=2)
    with pytest.raises(ValueError, match=r"pass hierarchy=NodeHierarchy\(precision='bf16'\)"):
        gc_accelerate.prepare(accelerator, SmallCNN(), node_precision="bf16")
    with pytest.raises(ValueError, match=r"pass sync=DiLoCo\(inner_steps=4, ...\)"):
        gc_accelerate.prepare(accelerator, SmallCNN(), inner_steps=4)
    with pytest.raises(ValueError, match="hierarchy = 'rack' is invalid"):
        gc_accelerate.prepare(accelerator, SmallCNN(), hierarchy="rack")


@pytest.mark.slow
def test_the_example_runs_under_accelerate_launch(tmp_path):
    root = Path(__file__).resolve().parents[1]
    launcher = Path(sys.executable).with_name("accelerate")
    done = subprocess.run(
        [
            str(launcher),
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(root / "examples" / "accelerate_train.py"),
            "--epochs",
            "1",
            "--compressor",
            "dgc",
            "--memory",
            "dgc",
            "--option",
            "density=0.05",
            "--save",
            str(tmp_path / "state"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "test accuracy" in done.stdout and "compressor=dgc" in done.stdout
    assert (tmp_path / "state" / "custom_checkpoint_0.pkl").is_file()
