"""No op that makes an accelerator's host wait runs in a synchronised step.

Two gloo ranks run synchronised steps of every compressor with its usual memories, kernels forced to
the accelerator's variants (``kernels.forced("torch")``), every op recorded
(``benchmarks/op_recorder.py``): a data-dependent output size, a scalar or tensor read back to the
host, or a tensor built from Python data would each stall a GPU's host behind the device.
"""

import sys

import pytest
import torch
from compressor_helpers import STEP_CONFIGS, STEP_OPTIONS
from locations import ROOT
from models import SmallCNN

from gc_strategy import GradientSynchronizer, build_components, kernels
from gc_strategy.tools.ranks import run_ranks

sys.path.insert(0, str(ROOT / "benchmarks"))

from op_recorder import OpRecorder  # noqa: E402


def _step(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    model.zero_grad(set_to_none=True)
    with model.gc_synchronizer.forward_pass():
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()


def _waits_of_every_config(rank, world_size):
    """Per configuration: the waits of step 3 (after the order is recorded and the warm-ups of
    PowerSGD's start_iter), and where they came from."""
    found = {}
    for name, memory in STEP_CONFIGS:
        torch.manual_seed(0)
        model = SmallCNN()
        roles = build_components(name, memory, "auto", "groups:2", **STEP_OPTIONS.get(name, {}))
        with kernels.forced("torch"):
            model.gc_synchronizer = GradientSynchronizer(model, roles)
            for step in range(3):
                _step(model, rank, step)
            with OpRecorder() as ops:
                _step(model, rank, 3)
        model.gc_synchronizer.close()
        found[(name, memory)] = (dict(ops.waits), ops.sites)
    return found


@pytest.fixture(scope="module")
def waits():
    return run_ranks(_waits_of_every_config, 2, timeout=300)


@pytest.mark.parametrize("config", STEP_CONFIGS, ids=[f"{name}+{memory}" for name, memory in STEP_CONFIGS])
def test_a_synchronised_step_never_makes_the_host_wait(waits, config):
    for rank, found in enumerate(waits):
        ops, sites = found[config]
        assert not ops, f"rank {rank}: {ops} at {sites}"


def test_the_recorder_sees_each_kind_of_wait():
    """The control: each kind of op the test refuses is seen."""
    x = torch.randn(10)
    with OpRecorder() as ops:
        x.nonzero()
        x[x > 0]
        float(x.sum())
        x.tolist()
        torch.tensor([1, 2])
        x.unique()
    assert {"nonzero", "index", "_local_scalar_dense", "Tensor.tolist", "lift_fresh"} <= set(ops.waits)
    assert {"_unique2"} & set(ops.waits) or {"_unique"} & set(ops.waits)
