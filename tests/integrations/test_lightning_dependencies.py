"""What ``gc_fsdp`` takes from Lightning beyond its public hooks, pinned: a change in any of it fails
here, naming what to read again.

``GCFSDPStrategy.setup`` is ``ModelParallelStrategy.setup`` without its demand that the
LightningModule shard itself in ``configure_model`` (the strategy's policy shards what it leaves):
Lightning has no hook between that check and the rest, so the body is written again, with two of
its private helpers. ``setup_environment`` builds the ``("replicate", "shard")`` mesh on the process
group that ``_setup_distributed`` makes, and the fork/spawn launcher hands the trained weights back
through ``_collect_rank_zero_results`` (a sharded state dict does not travel). Each is read from the
installed Lightning and compared with the source ``gc_strategy/integrations/lightning_fsdp.py`` was written
against (Lightning 2.6)."""

import pytest
from pinned_source import assert_unchanged

pytest.importorskip("lightning")

from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher  # noqa: E402
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput  # noqa: E402
from lightning.pytorch.strategies.model_parallel import (  # noqa: E402
    _materialize_distributed_module,
    _optimizers_to_device,
)

#: the first 16 hex digits of the sha256 of each piece's source, as gc_fsdp was written against it
PINNED = {
    "ModelParallelStrategy.setup": (ModelParallelStrategy.setup, "fdf402066d49c198"),
    "ModelParallelStrategy.setup_environment": (ModelParallelStrategy.setup_environment, "508f608433d9c45d"),
    "ModelParallelStrategy._setup_distributed": (ModelParallelStrategy._setup_distributed, "3659985ae9c55dba"),
    "model_parallel._materialize_distributed_module": (_materialize_distributed_module, "04f62d1d98feb207"),
    "model_parallel._optimizers_to_device": (_optimizers_to_device, "7965e59f969ed78b"),
    "_MultiProcessingLauncher._collect_rank_zero_results": (
        _MultiProcessingLauncher._collect_rank_zero_results,
        "af8be7ef609f70a1",
    ),
    "multiprocessing._WorkerOutput": (_WorkerOutput, "38f76fc7bcd1b91f"),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_lightning_code_gc_fsdp_depends_on_is_unchanged(name):
    where = "GCFSDPStrategy (gc_strategy/integrations/lightning_fsdp.py)"
    assert_unchanged("Lightning", name, *PINNED[name], where)
