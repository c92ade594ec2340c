"""Sharded training of models whose FSDP2 units do not reduce every parameter every step: a frozen
parameter (never reduced) and a branch used on even steps only (reduced on those steps alone). On
4 gloo ranks as 2 nodes x 2: ``compressor="none"`` against torch's native HSDP, and with each
compressor every shard's replicas bit-identical across nodes, error feedback kept for the steps a
parameter is not reduced."""

import pytest
import torch
from torch import nn

from gc_strategy import build_components
from gc_strategy.sync.sharded.synchronizer import ShardedSynchronizer, has_fsdp2_hook
from gc_strategy.tools.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_fsdp2_hook(), reason="sharded training needs torch >= 2.7")]

NODES, PER_NODE = 2, 2
COMPRESSORS = [
    ("topk", dict(memory="residual", density=0.1)),
    ("powersgd", dict(rank=2, start_iter=0)),
    ("acpsgd", dict(rank=2, start_iter=0)),
]


class Branching(nn.Module):
    """Odd row counts (FSDP2 pads them), a frozen weight, and a branch only even steps take."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 21)
        self.frozen = nn.Linear(21, 21)
        self.frozen.weight.requires_grad_(False)
        self.branch = nn.Linear(21, 21)
        self.head = nn.Sequential(nn.LayerNorm(21), nn.Linear(21, 3, bias=False))
        self.use_branch = True

    def forward(self, x):
        h = torch.relu(self.frozen(torch.relu(self.stem(x))))
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Branching()
    for unit in (model.stem, model.head):
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)  # the root unit: the frozen layer and the branch


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))


def _train(model, sync, rank, steps=6):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)
    for step in range(steps):
        model.use_branch = step % 2 == 0
        optimizer.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 12, generator=g), torch.randint(0, 3, (6,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if sync is not None:
            sync.after_optimizer_step()
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _run(rank, world_size):
    mesh = _mesh()
    native = _train(_sharded(mesh), None, rank)
    model = _sharded(mesh["shard"])
    out = {"native": native, "none": _train(model, ShardedSynchronizer(model, build_components("none"), mesh), rank)}
    for name, options in COMPRESSORS:
        model = _sharded(mesh["shard"])
        start = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
        sync = ShardedSynchronizer(model, build_components(name, **options), mesh)
        out[name] = _train(model, sync, rank)
        state = sync.state_dict()
        out[f"{name} moved"] = not torch.equal(out[name], start)
        out[f"{name} state"] = sorted(state["memory"].get("residual", state["compressor"].get("error", {})))
        sync.close()
    return out


def test_frozen_and_alternately_unused_parameters_train_like_native_hsdp():
    """``none`` ends where native HSDP does on every rank (the branch's AdamW state and weight decay
    skip the odd steps on both sides); each compressor trains, every rank ending bit-identical with
    the other node's rank of its shard, and its error feedback holds the branch's parameters (kept
    through the steps that did not reduce them) and never the frozen weight."""
    ranks = run_ranks(_run, NODES * PER_NODE, timeout=600)
    for out in ranks:
        torch.testing.assert_close(out["none"], out["native"], rtol=1e-6, atol=1e-6)
    for name, _ in COMPRESSORS:
        for r in range(NODES * PER_NODE):
            assert torch.equal(ranks[r][name], ranks[0][name]), (name, r)
            assert ranks[r][f"{name} moved"], name
            assert "branch.weight" in ranks[r][f"{name} state"], name
            assert "frozen.weight" not in ranks[r][f"{name} state"], name


def _old_format(rank, world_size):
    """A state saved by the earlier format (``sharded-1``: the flat compressors' state by FSDP
    module, the module's shard end to end) loads into the state by parameter that this one keeps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh["shard"])
    sync = ShardedSynchronizer(model, build_components("topk", "residual", density=0.1), mesh)
    _train(model, sync, rank, steps=2)
    state = sync.state_dict()
    by_parameter = state["memory"]["residual"]
    old = {}
    for b, (name, _) in enumerate(sync.modules):
        names, _ = sync.reduced.trainable(b)
        if all(n in by_parameter for n in names):
            old[name or "<root>"] = torch.cat([by_parameter[n].reshape(-1) for n in names])
    fresh = ShardedSynchronizer(_sharded(mesh["shard"]), build_components("topk", "residual", density=0.1), mesh)
    fresh.load_state_dict({**state, "format": "sharded-1", "memory": {"residual": old}})
    loaded = fresh.state_dict()["memory"]["residual"]
    return sorted(old), {n: torch.equal(loaded[n], t) for n, t in by_parameter.items() if n in loaded}


def test_a_state_saved_by_module_loads_by_parameter():
    ((units, same),) = run_ranks(_old_format, 1, timeout=120)
    assert units and same and all(same.values())
