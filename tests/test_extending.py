"""docs/extending.md: every Python block runs, and its four roles train on 2 gloo ranks."""

import functools
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import SmallCNN

from gc_strategy import DiLoCo, EveryStep, GradientSynchronizer, NodeHierarchy, build_components
from gc_strategy.tools.ranks import run_ranks

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


@functools.cache
def _examples() -> dict:
    """The page's Python blocks, run in order in one namespace, once per process (its sync mode is
    registered by name, once)."""
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S):
        exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def test_the_examples_run_and_behave_as_described():
    ex = _examples()
    assert {"Int8Linear", "ClippedResidual", "FlatAllReduce", "HalvesPlanner", "quantised", "summed_in_one"} <= set(ex)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    compressor = ex["Int8Linear"](levels=127)
    scale = float(g.abs().max()) / 127
    decoded = compressor.decode(compressor.encode(g, None), None)
    assert float((decoded - g).abs().max()) <= scale / 2 * (1 + 1e-5)  # round to the nearest level
    assert ex["HalvesPlanner"]().plan([4, 4, 4, 4]) == [2, 2] and ex["HalvesPlanner"]().plan([10, 1, 1]) == [1, 2]
    with pytest.raises(ValueError, match="sums payloads element-wise"):
        ex["GCFusedStrategy"](compressor=compressor, communicator=ex["FlatAllReduce"]())


def _train_with_examples(rank, world_size):
    ex = _examples()
    results = {}
    for label, roles in (
        (
            "int8",
            dict(compressor=ex["Int8Linear"](levels=127), memory=ex["ClippedResidual"](max_norm=1.0), fusion="single"),
        ),
        ("flat", dict(compressor="none", communicator=ex["FlatAllReduce"](), fusion=ex["HalvesPlanner"]())),
    ):
        torch.manual_seed(0)
        model, twin = SmallCNN(), SmallCNN()
        twin.load_state_dict(model.state_dict())
        c = build_components(**roles)
        synchronizer = GradientSynchronizer(model, c)
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        twin(x).square().mean().backward()
        local = [p.grad for p in twin.parameters()]
        if label == "int8":  # the paper's math per rank, averaged: round(g / s) s with s = max|g| / 127
            scale = max(float(t.abs().max()) for t in local) / 127
            local = [torch.round(t / scale) * scale for t in local]
        expected = []
        for t in local:
            gathered = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(gathered, t)
            expected.append(torch.stack(gathered).mean(0))
        results[label] = max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected))
        residual = synchronizer.memory.state_by_parameter(synchronizer.buckets).get("residual", {})
        flat_residual = torch.cat([t.reshape(-1) for t in residual.values()]) if residual else torch.zeros(1)
        results[label + " residual norm"] = float(flat_residual.norm())
    return results


@pytest.mark.slow
def test_the_examples_train_on_two_ranks_with_the_plain_math():
    for result in run_ranks(_train_with_examples, 2):
        assert result["int8"] <= 1e-6 and result["flat"] <= 1e-6
        assert 0 < result["int8 residual norm"] <= 1.0 + 1e-6  # the residual exists and is clipped


def _page_roles():
    ex = _examples()
    return build_components(
        ex["Int8Linear"](levels=127), ex["ClippedResidual"](max_norm=1.0), fusion=ex["HalvesPlanner"]()
    )


def _every_mode_with_the_pages_roles(rank, world_size):
    """DiLoCo (its vectors exchanged in bf16 by the same custom plan) and the hierarchy, each
    built by its sync mode from the page's compressor, memory and planner: what each rank holds
    after a few steps (replicas must agree)."""
    from gc_strategy.sync.modes import Replicated

    held = {}
    for label, mode, hierarchy in (
        ("diloco", DiLoCo(inner_steps=2), "flat"),
        ("hierarchy", EveryStep(), NodeHierarchy(ranks_per_node=1)),
    ):
        torch.manual_seed(0)
        model = SmallCNN()
        sync = mode.build(model, _page_roles(), Replicated(hierarchy=hierarchy))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            optimizer.zero_grad()
            with sync.forward_pass():
                loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            sync.after_optimizer_step()
        sync.close()
        held[label] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return held


@pytest.mark.slow
def test_the_pages_roles_run_under_diloco_and_the_hierarchy():
    """A custom compressor, memory and planner written as the page shows them work in every way of
    synchronising: the replicas stay identical, and the parameters moved."""
    ranks = run_ranks(_every_mode_with_the_pages_roles, 2)
    for label in ("diloco", "hierarchy"):
        assert torch.equal(ranks[0][label], ranks[1][label]), label
    torch.manual_seed(0)
    start = torch.cat([p.detach().reshape(-1) for p in SmallCNN().parameters()])
    assert not torch.equal(ranks[0]["diloco"], start) and not torch.equal(ranks[0]["hierarchy"], start)


@pytest.mark.slow
def test_the_pages_roles_run_through_pufferfishs_warm_up(tmp_path):
    """The Lightning strategy with the page's roles and Pufferfish's warm-up: after the conversion
    the synchroniser is rebuilt with fresh copies of the same custom roles, on both ranks."""
    import lightning.pytorch as pl
    from models import ParityModule, fit

    from gc_strategy import GCFusedStrategy
    from gc_strategy.pufferfish import LowRankConv2d, PufferfishWarmup, enable_factorized_loading

    ex = _examples()

    class Seen(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            sync = trainer.strategy.synchronizer
            roles = f"{type(sync.compressor).__name__} {type(sync.memory).__name__} {type(sync.planner).__name__}"
            (tmp_path / f"rank{trainer.global_rank}.txt").write_text(roles)

    pl.seed_everything(0, verbose=False)
    module = ParityModule()
    enable_factorized_loading(module)
    strategy = GCFusedStrategy(
        compressor=ex["Int8Linear"](levels=127),
        memory=ex["ClippedResidual"](max_norm=1.0),
        fusion=ex["HalvesPlanner"](),
        start_method="fork",
    )
    fit(module, strategy, max_epochs=2, callbacks=[PufferfishWarmup(ratio=0.5, warmup_steps=3), Seen()])
    assert isinstance(module.net.conv2, LowRankConv2d)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "Int8Linear ClippedResidual HalvesPlanner"
