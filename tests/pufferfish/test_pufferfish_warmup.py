"""PufferfishWarmup inside Lightning: conversion on every rank of a 2-rank gloo run, the optimizer,
schedule and synchroniser rebuilt for the new parameters, resume from checkpoints saved before and
after the switch, the learning-rate re-warm-up, and strategies it cannot work with."""

import json
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import ParityModule, fit, flat_params

from gc_strategy import GCFusedStrategy
from gc_strategy.pufferfish import LowRankConv2d, PufferfishWarmup, enable_factorized_loading

pytestmark = pytest.mark.slow

LR, STEPS_PER_EPOCH, EPOCHS = 0.1, 4, 3  # 64 samples, batch 8, 2 ranks


class ScheduledModule(ParityModule):
    """ParityModule with a cosine learning-rate schedule stepped every optimizer step."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS_PER_EPOCH * EPOCHS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Probe(pl.Callback):
    """After every step, on every rank: which form the model has, whether the optimizer, the
    synchroniser and the gradient hooks cover exactly the model's parameters, and the learning rate
    against the cosine formula; written to one JSON file per rank."""

    def __init__(self, out_dir):
        self.out_dir, self.rows = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = list(pl_module.parameters())
        ids = {id(p) for p in params}
        optimizer = trainer.optimizers[0]
        in_optimizer = [id(p) for g in optimizer.param_groups for p in g["params"]]
        sync = trainer.strategy.synchronizer
        bucketed = sorted(n for b in sync.buckets for n in b.names)
        lr = optimizer.param_groups[0]["lr"]
        cosine = LR * (1 + math.cos(math.pi * trainer.global_step / (STEPS_PER_EPOCH * EPOCHS))) / 2
        self.rows.append(
            {
                "step": trainer.global_step,
                "low_rank": isinstance(pl_module.net.conv2, LowRankConv2d),
                "optimizer_exact": len(in_optimizer) == len(ids) and set(in_optimizer) == ids,
                "sync_exact": {id(p) for p in sync.params} == ids and len(sync.params) == len(ids),
                "buckets_exact": bucketed == sorted(n for n, _ in pl_module.named_parameters()),
                "one_hook_each": all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in params),
                "lr_on_schedule": abs(lr - cosine) < 1e-9,
                "compressor": sync.compressor.name,
            }
        )

    def on_train_end(self, trainer, pl_module):
        with open(self.out_dir / f"rank{trainer.global_rank}.json", "w") as f:
            json.dump(self.rows, f)


def _strategy():
    return GCFusedStrategy(compressor="powersgd", rank=1, start_iter=1, fusion="groups:2", start_method="fork")


def test_conversion_on_every_rank_keeps_optimizer_schedule_and_synchroniser_consistent(tmp_path):
    pl.seed_everything(0, verbose=False)
    module = ScheduledModule()
    enable_factorized_loading(module)
    before = flat_params(module).clone()
    warmup = PufferfishWarmup(ratio=0.5, warmup_steps=5)
    fit(module, _strategy(), max_epochs=EPOCHS, callbacks=[warmup, Probe(tmp_path)])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    rows = ranks[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    assert [r["low_rank"] for r in rows] == [r["step"] > 5 for r in rows]  # converted before step 6
    for key in ("optimizer_exact", "sync_exact", "buckets_exact", "one_hook_each", "lr_on_schedule"):
        assert all(r[key] for r in rows), key
    assert {r["compressor"] for r in rows} == {"powersgd"}
    # the launching process received rank 0's low-rank weights, which moved away from the start
    assert isinstance(module.net.conv2, LowRankConv2d) and flat_params(module).numel() < before.numel()


def test_checkpoints_before_and_after_the_switch_resume_identically(tmp_path):
    """Powerfish: PowerSGD during the warm-up epoch, plain allreduce after the conversion."""

    def run(ckpt_path=None, checkpoints=None):
        pl.seed_everything(0, verbose=False)
        module = ParityModule()
        enable_factorized_loading(module)
        warmup = PufferfishWarmup(ratio=0.5, warmup_epochs=1, after_warmup={"compressor": "none"})
        callbacks = [warmup]
        if checkpoints is not None:
            callbacks.append(ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1))
        fit(
            module,
            _strategy(),
            max_epochs=EPOCHS,
            callbacks=callbacks,
            ckpt_path=ckpt_path,
            enable_checkpointing=checkpoints is not None,
        )
        return module

    checkpoints = tmp_path / "ckpt"
    straight = flat_params(run(checkpoints=checkpoints))
    before, after = checkpoints / "epoch=0.ckpt", checkpoints / "epoch=1.ckpt"
    assert not any(".u.weight" in k for k in torch.load(before, weights_only=False)["state_dict"])
    assert any(".u.weight" in k for k in torch.load(after, weights_only=False)["state_dict"])
    for checkpoint in (before, after):
        resumed = flat_params(run(ckpt_path=str(checkpoint)))
        assert resumed.shape == straight.shape
        assert (resumed - straight).abs().max() <= 1e-6, checkpoint.name


def test_learning_rate_rewarms_linearly_after_the_conversion():
    """Plain SGD: the update of a kept parameter is lr_effective x its gradient."""

    class Recorder(pl.Callback):
        def __init__(self):
            self.effective = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            head = pl_module.net.head.bias
            self._before, self._grad = head.detach().clone(), head.grad.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            change = self._before - pl_module.net.head.bias.detach()
            self.effective.append((change / self._grad).median().item())

    class PlainSGD(ParityModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    recorder = Recorder()
    pl.seed_everything(0, verbose=False)
    fit(
        PlainSGD(),
        "auto",
        devices=1,
        max_steps=8,
        callbacks=[PufferfishWarmup(warmup_steps=2, lr_rewarmup_steps=4), recorder],
    )
    expected = [LR, LR, LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR]
    assert recorder.effective == pytest.approx(expected, rel=1e-4)


def test_strategies_that_keep_the_old_parameters_are_refused():
    """Refused in ``setup``, the first hook of a fit (before any process group or step)."""
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match="strategy DDPStrategy keeps references to the old parameters"):
        PufferfishWarmup(warmup_steps=1).setup(trainer, ParityModule(), "fit")
