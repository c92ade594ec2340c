"""docs/extending.md: every Python block runs, and its four roles train on 2 gloo ranks."""

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import SmallCNN

from gc_strategy import GradientSynchronizer, build_components
from gc_strategy.ranks import run_ranks

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _examples() -> dict:
    """The page's Python blocks, run in order in one namespace."""
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S):
        exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def test_the_examples_run_and_behave_as_described():
    ex = _examples()
    assert {"Int8Linear", "ClippedResidual", "FlatAllReduce", "HalvesPlan", "quantised", "summed_in_one"} <= set(ex)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    compressor = ex["Int8Linear"](levels=127)
    scale = float(g.abs().max()) / 127
    decoded = compressor.decode(compressor.encode(g, None), None)
    assert float((decoded - g).abs().max()) <= scale / 2 * (1 + 1e-5)  # round to the nearest level
    assert ex["HalvesPlan"]().plan([4, 4, 4, 4]) == [2, 2] and ex["HalvesPlan"]().plan([10, 1, 1]) == [1, 2]
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
        ("flat", dict(compressor="none", communicator=ex["FlatAllReduce"](), fusion=ex["HalvesPlan"]())),
    ):
        torch.manual_seed(0)
        model, twin = SmallCNN(), SmallCNN()
        twin.load_state_dict(model.state_dict())
        c = build_components(**roles)
        engine = GradientSynchronizer(model, c.compressor, c.memory, c.communicator, c.fusion)
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
        residual = engine.memory.state_by_parameter(engine.buckets).get("residual", {})
        flat_residual = torch.cat([t.reshape(-1) for t in residual.values()]) if residual else torch.zeros(1)
        results[label + " residual norm"] = float(flat_residual.norm())
    return results


@pytest.mark.slow
def test_the_examples_train_on_two_ranks_with_the_plain_math():
    for result in run_ranks(_train_with_examples, 2):
        assert result["int8"] <= 1e-6 and result["flat"] <= 1e-6
        assert 0 < result["int8 residual norm"] <= 1.0 + 1e-6  # the residual exists and is clipped
