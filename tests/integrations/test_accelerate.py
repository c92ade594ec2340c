"""The Accelerate adapter: 2 CPU processes through accelerate.debug_launcher."""

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from locations import ROOT

accelerate = pytest.importorskip("accelerate")

from models import SmallCNN  # noqa: E402

import gc_strategy.integrations.accelerate as gc_accelerate  # noqa: E402
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
    with pytest.raises(ValueError, match=f"distributed type is {kind}; supported: NO, MULTI_CPU, MULTI_GPU, FSDP"):
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


def _two_nodes_of_one_rank(gradient_accumulation_steps: int = 1):
    """An accelerator on 2 CPU processes as 2 nodes of 1 rank (the launcher's LOCAL_WORLD_SIZE)."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)


def _as_fsdp2(accelerator) -> None:
    """Accelerate's FSDP2 plugin on ``accelerator``: Accelerate turns FSDP on for accelerators only,
    so on the CPU the test sets the distributed type that Accelerate sets on a GPU (again before each
    prepare, which resets it), and accelerator.prepare runs its FSDP2 path."""
    from accelerate.utils import DistributedType

    accelerator.state.fsdp_plugin = accelerate.FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator.state.distributed_type = DistributedType.FSDP


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))


def _tokens(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 12, generator=g), torch.randint(0, 10, (4,), generator=g)


def _sharded_parity_with_native_hsdp(out: str) -> None:
    """compressor=none, sharded, 2 micro-batches per step, against torch's own HSDP (fully_shard over
    the 2-D mesh, the same units) skipping its reductions on the first micro-batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from gc_strategy.sync.sharded.synchronizer import shard_by_policy

    accelerator = _two_nodes_of_one_rank(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    ours = _mlp()
    theirs = copy.deepcopy(ours)
    start = [p.detach().clone() for p in ours.parameters()]
    our_optimizer = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ours, our_optimizer = gc_accelerate.prepare(accelerator, ours, our_optimizer, sharding="fsdp")
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    shard_by_policy(theirs, hsdp, None, through_root=True)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for step in range(8):
        x, y = _tokens(accelerator.process_index, step)
        with accelerator.accumulate(ours):
            accelerator.backward(torch.nn.functional.cross_entropy(ours(x), y))
            our_optimizer.step()
            our_optimizer.zero_grad()
        theirs.set_requires_gradient_sync(step % 2 == 1)
        (torch.nn.functional.cross_entropy(theirs(x), y) / 2).backward()
        if step % 2 == 1:
            their_optimizer.step()
            their_optimizer.zero_grad()
    mine, others = [p.to_local() for p in ours.parameters()], [p.to_local() for p in theirs.parameters()]
    _write(
        out,
        accelerator,
        {
            "difference": max((a - b).abs().max().item() for a, b in zip(mine, others)),
            "moved": min((a - b).abs().max().item() for a, b in zip(mine, start)),
            "synchronised_steps": ours.gc_synchronizer.telemetry.steps,
            "wrapped": type(ours).__name__,
            "save_state": _refusal(lambda: accelerator.save_state(os.path.join(out, "checkpoint"))),
        },
    )


def _refusal(action) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.slow
def test_sharded_compressor_none_equals_native_hsdp_and_accumulation_skips_sync(tmp_path):
    accelerate.debug_launcher(_sharded_parity_with_native_hsdp, args=(str(tmp_path),), num_processes=2)
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["wrapped"] == "FSDPSequential"
        assert result["moved"] > 1e-3  # every parameter trained
        assert result["difference"] <= 1e-6
        assert result["synchronised_steps"] == 4  # 8 micro-batches, 4 optimizer steps
        assert "save_state of a model sharded without Accelerate's FSDP2 plugin" in result["save_state"]


def _sharded_compression_under_the_fsdp2_plugin(out: str) -> None:
    """topk with residual memory per step, and DiLoCo over shards, through accelerator.prepare's FSDP2
    path, from different initial weights on each rank."""
    from torch.distributed.tensor import DTensor

    accelerator = _two_nodes_of_one_rank()
    torch.manual_seed(accelerator.process_index)
    per_step, outer = _mlp(), _mlp()
    first = [p.detach().clone() for p in per_step.parameters()]
    options = {
        "topk": {"compressor": "topk", "memory": "residual", "density": 0.1},
        "diloco": {"sync": DiLoCo(inner_steps=2)},
    }
    prepared = {}
    for (name, option), model in zip(options.items(), (per_step, outer)):
        _as_fsdp2(accelerator)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared[name] = gc_accelerate.prepare(accelerator, model, optimizer, **option)
    result = {}
    for name, (model, optimizer) in prepared.items():
        losses = []
        for step in range(6):
            x, y = _tokens(0, step % 2)  # two batches, the same on every rank, learnt over and over
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        result[name] = {
            "parameters": [p.to_local().flatten().tolist() for p in model.parameters()],
            "optimizer_holds_shards": all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]),
            "losses": losses,
        }
    result["topk"]["moved_from_own_start"] = [
        (p.to_local() - f).abs().max().item() for p, f in zip(per_step.parameters(), first)
    ]
    result["memory_elements"] = sum(
        t.numel() for v in per_step.gc_synchronizer.memory.buffers.values() for t in v.values()
    )
    _write(out, accelerator, result)


@pytest.mark.slow
def test_sharded_topk_and_diloco_through_the_fsdp2_plugin_keep_replicas_identical(tmp_path):
    accelerate.debug_launcher(_sharded_compression_under_the_fsdp2_plugin, args=(str(tmp_path),), num_processes=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ("topk", "diloco"):
        assert results[0][name]["parameters"] == results[1][name]["parameters"]  # bit-identical replicas
        assert all(r[name]["optimizer_holds_shards"] for r in results)
        assert results[0][name]["losses"][-1] < results[0][name]["losses"][0]
    assert results[0]["memory_elements"] > 0  # error feedback kept what top-k left
    assert min(results[0]["topk"]["moved_from_own_start"] + results[1]["topk"]["moved_from_own_start"]) > 0


def test_sharding_options_are_refused_before_any_work(monkeypatch):
    accelerator = SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2, parallelism_config=None)
    with pytest.raises(ValueError, match="sharding = 'zero' is invalid; allowed: auto, none, fsdp"):
        gc_accelerate.prepare(accelerator, _mlp(), sharding="zero")
    with pytest.raises(ValueError, match="option fusion = 'auto' is invalid with sharding"):
        gc_accelerate.prepare(accelerator, _mlp(), sharding="fsdp", fusion="auto")
    with pytest.raises(ValueError, match="option broadcast_buffers = True is invalid with sharding"):
        gc_accelerate.prepare(accelerator, _mlp(), sharding="fsdp", broadcast_buffers=True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        gc_accelerate.prepare(accelerator, _mlp(), sharding="fsdp")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="2 processes cannot form nodes of 3 ranks each"):
        gc_accelerate.prepare(accelerator, _mlp(), sharding="fsdp")
    fsdp1 = SimpleNamespace(distributed_type="FSDP", state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1)))
    with pytest.raises(ValueError, match="distributed type is FSDP; supported: .* \\(FSDP with fsdp_version=2\\)"):
        gc_accelerate.prepare(fsdp1, _mlp())


@pytest.mark.slow
def test_the_example_runs_under_accelerate_launch(tmp_path):
    root = ROOT
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


def _double_momentum(out: str) -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc_accelerate.prepare(accelerator, model, optimizer, compressor="dgc", memory="dgc", density=0.1)
    _write(out, accelerator, {"warnings": [str(w.message) for w in caught]})


@pytest.mark.slow
def test_double_momentum_is_warned(tmp_path):
    """DGC's memory applies momentum itself; an optimizer with momentum of its own would apply it
    twice (in the launched processes: an Accelerator made in this one would be every later one's)."""
    accelerate.debug_launcher(_double_momentum, args=(str(tmp_path),), num_processes=2)
    for rank in range(2):
        caught = json.loads((tmp_path / f"rank{rank}.json").read_text())["warnings"]
        assert any("'dgc' applies momentum itself, and the optimizer SGD has momentum on" in w for w in caught)
