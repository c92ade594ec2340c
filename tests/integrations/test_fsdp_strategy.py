"""``strategy="gc_fsdp"`` through Lightning's Trainer on 2 CPU processes (one node of 2 devices:
FSDP2 over both, the exchange across nodes over one node): ``compressor="none"`` equals Lightning's
own ``ModelParallelStrategy`` with FSDP2, with and without gradient accumulation; the default
sharding policy applies where ``configure_model`` shards nothing; a resume from a sharded checkpoint
with each rank's error feedback is exact. Across several nodes: tests/sync/sharded/test_sharded.py."""

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from locations import TESTS
from models import ShardedMLP, fit

from gc_strategy import DiLoCo, GCFSDPStrategy
from gc_strategy.integrations.lightning_fsdp import FullWeightsLauncher
from gc_strategy.sync.sharded.synchronizer import has_fsdp2_hook

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_fsdp2_hook(), reason="sharded training needs torch >= 2.7")]


def _fit(out, mesh_dim, strategy, ckpt_path=None, shard_options=None, **kwargs):
    """Train :class:`ShardedMLP` on 2 processes; rank 0's full parameters after."""
    out.mkdir()
    fit(ShardedMLP(out, mesh_dim, **(shard_options or {})), strategy, ckpt_path=ckpt_path, **kwargs)
    return torch.load(out / "rank0.pt")


def _native():
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def _native_fork():
    strategy = _native()
    strategy._configure_launcher = lambda: setattr(  # the fork launcher under pytest, as gc_fsdp_fork's
        strategy, "_launcher", FullWeightsLauncher(strategy, start_method="fork")
    )
    return strategy


@pytest.mark.parametrize("options", [{}, {"accumulate_grad_batches": 2}])
def test_none_equals_lightnings_fsdp2(tmp_path, options):
    """Also with 2 micro-batches per step."""
    native = _fit(tmp_path / "native", "data_parallel", _native_fork(), **options)
    ours = _fit(tmp_path / "ours", "shard", GCFSDPStrategy(start_method="fork"), **options)
    torch.testing.assert_close(ours, native, rtol=1e-6, atol=1e-6)


def test_clipping_over_the_sharded_gradients_equals_lightnings_fsdp2(tmp_path):
    """``gradient_clip_val``: the norm of the synchronised sharded gradients, clipped as FSDP2's are
    (and the clipping acts: the result differs from the unclipped one)."""
    native = _fit(tmp_path / "native", "data_parallel", _native_fork(), gradient_clip_val=0.05)
    ours = _fit(tmp_path / "ours", "shard", GCFSDPStrategy(start_method="fork"), gradient_clip_val=0.05)
    unclipped = _fit(tmp_path / "unclipped", "shard", GCFSDPStrategy(start_method="fork"))
    torch.testing.assert_close(ours, native, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, unclipped, rtol=1e-4, atol=1e-4)


def test_the_default_policy_shards_what_configure_model_leaves(tmp_path):
    """No ``configure_model`` sharding: the strategy shards every module with parameters of its
    own; the result is the same as sharding them in ``configure_model``."""
    by_hand = _fit(tmp_path / "hand", "shard", GCFSDPStrategy(start_method="fork"))
    by_policy = _fit(tmp_path / "policy", None, GCFSDPStrategy(start_method="fork"))
    assert torch.equal(by_policy, by_hand)


def test_the_policy_applies_the_mixed_precision_policy(tmp_path):
    """``mixed_precision=`` reaches every unit the strategy shards: the same result as sharding by
    hand with that policy, and not the full-precision one."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    by_hand = _fit(tmp_path / "hand", "shard", GCFSDPStrategy(start_method="fork"), shard_options={"mp_policy": policy})
    by_policy = _fit(tmp_path / "policy", None, GCFSDPStrategy(mixed_precision=policy, start_method="fork"))
    full = _fit(tmp_path / "full", None, GCFSDPStrategy(start_method="fork"))
    assert torch.equal(by_policy, by_hand) and not torch.equal(by_policy, full)


def test_resume_from_a_sharded_checkpoint_with_error_feedback_is_exact(tmp_path):
    def strategy():
        return GCFSDPStrategy(compressor="topk", memory="residual", density=0.1, start_method="fork")

    straight = _fit(tmp_path / "straight", "shard", strategy(), max_epochs=2)
    checkpoints = tmp_path / "ckpt"
    _fit(
        tmp_path / "first",
        "shard",
        strategy(),
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True)],
    )
    assert sorted(p.name for p in (tmp_path / "ckpt.gc_state" / "last.ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]
    resumed = _fit(tmp_path / "resumed", "shard", strategy(), max_epochs=2, ckpt_path=str(checkpoints / "last.ckpt"))
    assert torch.equal(resumed, straight)


def test_diloco_over_shards_runs_through_lightning(tmp_path):
    before = torch.cat([p.detach().reshape(-1) for p in ShardedMLP(None).parameters()])
    after = _fit(tmp_path / "diloco", "shard", GCFSDPStrategy(sync=DiLoCo(inner_steps=4), start_method="fork"))
    assert not torch.equal(after, before)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(start_method="thread"), "start_method = 'thread' is invalid; allowed: popen, spawn, fork"),
        (dict(inner_steps=4), r"inner_steps is an option of DiLoCo; pass sync=DiLoCo\(inner_steps=4, ...\)"),
        (dict(compressor="topk", densty=0.1), r"option\(s\) densty are not taken by compressor=topk"),
        (
            dict(compressor="topk", fusion="single"),
            r"option fusion = 'single' is invalid with sharding; allowed: 'bucket_mb:25' \(each FSDP2 module's shard",
        ),
        (
            dict(hierarchy="node"),
            r"option hierarchy = 'node' is invalid with sharding; allowed: 'flat' \(the mesh's nodes are the hier",
        ),
        (dict(find_unused_parameters=True), "option find_unused_parameters = True is invalid with sharding"),
        (dict(log_every_n_steps=0), "log_every_n_steps"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        GCFSDPStrategy(**options)


class _Warnings(Callback):
    """Records on rank 0 the warnings from set-up to the first step into ``path``."""

    def __init__(self, path):
        self.path, self.recorder = path, None

    def setup(self, trainer, pl_module, stage):
        self.recorder = warnings.catch_warnings(record=True)
        self.caught = self.recorder.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module):
        self.recorder.__exit__(None, None, None)
        if trainer.global_rank == 0:
            self.path.write_text("\n".join(str(w.message) for w in self.caught))


def test_telemetry_reaches_the_logger_and_double_momentum_is_warned(tmp_path):
    """As under ``gc_fused``: the ``gc/...`` metrics in the Trainer's logger every step, and a
    warning where DGC's memory and the optimizer's momentum (SGD, 0.9) would both apply momentum."""
    from lightning.pytorch.loggers import CSVLogger

    strategy = GCFSDPStrategy(compressor="dgc", memory="dgc", density=0.1, start_method="fork", log_every_n_steps=1)
    caught = tmp_path / "warnings.txt"
    logger = CSVLogger(tmp_path, name="csv", version=0)
    _fit(tmp_path / "run", "shard", strategy, logger=logger, callbacks=[_Warnings(caught)])
    assert "'dgc' applies momentum itself, and the optimizer SGD has momentum" in caught.read_text()
    text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    header = text.splitlines()[0].split(",")
    assert {"gc/raw_bytes", "gc/sent_bytes", "gc/compression_ratio", "gc/buckets"} <= set(header)
    rows = [dict(zip(header, line.split(","))) for line in text.splitlines()[1:]]
    ratios = [float(row["gc/compression_ratio"]) for row in rows if row.get("gc/compression_ratio")]
    assert ratios and min(ratios) > 1.0


def _two_nodes(tmp_path, kind, port):
    """``tests/fsdp_two_nodes.py`` on 2 nodes x 2 ranks: one torchrun per node, over loopback."""
    import os
    import subprocess
    import sys

    out = tmp_path / kind
    out.mkdir()
    script = TESTS / "fsdp_two_nodes.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2"]
    address = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    nodes = [
        subprocess.Popen(
            [*launcher, f"--node-rank={n}", *address, str(script), kind, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs[0][-3000:] + logs[1][-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


def test_two_nodes_none_equals_native_hsdp_and_topk_keeps_the_replicas_identical(tmp_path):
    """Through torchrun, 2 nodes x 2 ranks: ``gc_fsdp`` with ``compressor="none"`` ends where
    ``ModelParallelStrategy`` with native HSDP (a 2-D mesh) does on every rank, within fp32 rounding;
    with top-k and error feedback every rank ends with the same parameters."""
    native = _two_nodes(tmp_path, "native", 29611)
    ours = _two_nodes(tmp_path, "none", 29613)
    for mine, theirs in zip(ours, native):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    topk = _two_nodes(tmp_path, "topk", 29615)
    assert all(torch.equal(r, topk[0]) for r in topk) and not torch.equal(topk[0], ours[0])
