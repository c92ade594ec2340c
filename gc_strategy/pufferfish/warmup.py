"""``PufferfishWarmup``: train the vanilla model first, then continue with its low-rank form.

Pufferfish (Wang, Agarwal, Papailiopoulos, MLSys 2021, §3.2) trains the full-rank model for a few
epochs ("full-rank warm-up", e.g. 80 of 300 on CIFAR-10), factorises it by truncated SVD and trains
the low-rank model from there. At the conversion step, on every rank:

1. :func:`~gc_strategy.pufferfish.factorize` converts the selected layers in place;
2. the strategy's gradient synchroniser is rebuilt over the new parameters (rank 0's converted
   weights are broadcast, buckets are cut again, compression state starts fresh), with the roles
   of ``after_warmup`` when given: ``{"compressor": "none"}`` after PowerSGD is the paper's
   "Powerfish" (PowerSGD during warm-up only);
3. the optimizers and learning-rate schedulers are rebuilt by the LightningModule's
   ``configure_optimizers``; they continue where the old ones were (current learning rates and
   scheduler state carried over, optimizer state kept for the parameters that did not change);
   optionally the learning rate ramps up again linearly over ``lr_rewarmup_steps`` steps.

Checkpoints written after the conversion hold the low-rank weights; the callback registers a
load-state-dict pre-hook (:func:`~gc_strategy.pufferfish.enable_factorized_loading`) so that
resuming from them converts the freshly built model before loading.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..components import Components, build_components
from ..integrations.lightning import GCFusedStrategy
from ..registry import Option
from ..sync.modes import check_setup
from .transform import check_ratio, enable_factorized_loading, factorize, select_layers

#: the warm-up's counts (epochs or steps), each optional
COUNT = Option(None, int, low=0, optional=True)


def _check_count(name: str, value: Any) -> int | None:
    return COUNT.validate("PufferfishWarmup", name, value)


class PufferfishWarmup(pl.Callback):
    """Full-rank warm-up, then conversion to the low-rank model (see the module docstring).

    Args:
        ratio: rank of each factorised layer = ``ratio · min(m, n)`` of its weight matrix, in (0, 1].
        warmup_epochs, warmup_steps: the length of the full-rank phase; give exactly one (0 converts
            before the first step: low-rank training from the SVD of the initial weights).
        keep_full_rank: extra module-name patterns (``fnmatch``) kept full-rank on top of the role rules.
        after_warmup: ``None`` keeps the strategy's compressor, memory and communicator (fresh state);
            otherwise keyword arguments of :func:`~gc_strategy.build_components` for the low-rank
            phase (the fusion plan stays the configured one unless given).
        lr_rewarmup_steps: after the conversion, the learning rate is scaled by ``k / n`` in the
            k-th of these ``n`` optimizer steps (0: off).
    """

    def __init__(
        self,
        ratio: float = 0.25,
        warmup_epochs: int | None = None,
        warmup_steps: int | None = None,
        keep_full_rank: Iterable[str] = (),
        after_warmup: dict[str, Any] | None = None,
        lr_rewarmup_steps: int = 0,
    ) -> None:
        self.ratio = check_ratio(ratio)
        self.warmup_epochs = _check_count("warmup_epochs", warmup_epochs)
        self.warmup_steps = _check_count("warmup_steps", warmup_steps)
        if (self.warmup_epochs is None) == (self.warmup_steps is None):
            raise ValueError(
                f"give exactly one of warmup_epochs and warmup_steps (got warmup_epochs={warmup_epochs!r}, "
                f"warmup_steps={warmup_steps!r})"
            )
        self.keep_full_rank = list(keep_full_rank)
        self.after_warmup = dict(after_warmup) if after_warmup is not None else None
        if self.after_warmup is not None:
            build_components(**self.after_warmup)  # refuse bad names or options now
        self.lr_rewarmup_steps = _check_count("lr_rewarmup_steps", lr_rewarmup_steps)
        self.converted_at_step: int | None = None
        self._trainer: pl.Trainer | None = None
        self._rewarmup_hooks: list[Any] = []

    # ------------------------------------------------------------------ set-up and resume
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, (GCFusedStrategy, SingleDeviceStrategy)):
            raise ValueError(
                f"PufferfishWarmup replaces the model's layers during training; strategy {type(strategy).__name__} "
                "keeps references to the old parameters. Use strategy='gc_fused' (compressor='none' is plain "
                "allreduce) or a single device."
            )
        if isinstance(strategy, GCFusedStrategy):  # the conversion switches the roles: refused now where it cannot
            check_setup(strategy.sync, strategy.components, strategy.placement(), switches_roles=True)
        if isinstance(strategy, GCFusedStrategy) and strategy.components.fusion.fixes_tensors:
            raise ValueError(
                f"fusion={strategy.components.fusion.describe()!r} fixes the tensors of the full-rank "
                "model, which the conversion replaces; use 'auto' or a size-based plan"
            )
        if self.after_warmup is not None and not isinstance(strategy, GCFusedStrategy):
            raise ValueError("after_warmup chooses the gradient synchroniser's roles, which needs strategy='gc_fused'")
        select_layers(pl_module, self.keep_full_rank)  # a pattern matching nothing fails before training
        if isinstance(strategy.launcher, _MultiProcessingLauncher) and not getattr(
            pl_module, "_gc_factorized_loading", False
        ):
            rank_zero_warn(
                "With the fork/spawn launcher the launching process's module gets the trained weights back with "
                "strict=False; call gc_strategy.pufferfish.enable_factorized_loading(module) before trainer.fit "
                "so that it takes the low-rank weights too."
            )
        enable_factorized_loading(pl_module)
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"converted_at_step": self.converted_at_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resuming after the conversion: the model was converted while its weights loaded; the
        synchroniser, built after this, must use the low-rank phase's roles."""
        self.converted_at_step = state_dict["converted_at_step"]
        if self.converted_at_step is not None and self._trainer is not None:
            strategy = self._trainer.strategy
            if isinstance(strategy, GCFusedStrategy):
                strategy.switch_components(self._low_rank_components(strategy))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install_rewarmup(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._rewarmup_hooks and trainer.global_step - self.converted_at_step >= self.lr_rewarmup_steps:
            self._install_rewarmup(trainer)  # the window is over: this only removes the hooks

    # ------------------------------------------------------------------ the conversion
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (
            self.warmup_epochs is not None
            and self.converted_at_step is None
            and trainer.current_epoch >= self.warmup_epochs
        ):
            self._convert(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        starts_a_step = batch_idx % trainer.accumulate_grad_batches == 0
        if (
            self.warmup_steps is not None
            and self.converted_at_step is None
            and starts_a_step
            and trainer.global_step >= self.warmup_steps
        ):
            self._convert(trainer, pl_module)

    def _convert(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = factorize(pl_module, self.ratio, self.keep_full_rank)
        self.converted_at_step = trainer.global_step
        rank_zero_info(f"step {trainer.global_step}: full-rank warm-up over. {report.summary()}")
        strategy = trainer.strategy
        if isinstance(strategy, GCFusedStrategy):
            strategy.switch_components(self._low_rank_components(strategy), broadcast_from_rank0=True)
        self._rebuild_optimizers(trainer)
        self._install_rewarmup(trainer)
        if trainer.loggers and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"lowrank/params_before": report.params_before, "lowrank/params_after": report.params_after},
                    step=trainer.global_step,
                )

    def _low_rank_components(self, strategy: GCFusedStrategy) -> Components:
        if self.after_warmup is None:
            return strategy.components.fresh()
        return build_components(**{"fusion": copy.deepcopy(strategy.components.fusion), **self.after_warmup})

    @staticmethod
    def _rebuild_optimizers(trainer: pl.Trainer) -> None:
        """``configure_optimizers`` again, for the new parameters; the learning rates, the scheduler
        state and the optimizer state of unchanged parameters carry over."""
        strategy = trainer.strategy
        old_optimizers, old_schedulers = strategy.optimizers, strategy.lr_scheduler_configs
        strategy.setup_optimizers(trainer)
        if len(strategy.optimizers) != len(old_optimizers) or len(strategy.lr_scheduler_configs) != len(old_schedulers):
            raise RuntimeError(
                "configure_optimizers returned a different number of optimizers or schedulers "
                "for the low-rank model; PufferfishWarmup cannot carry the training state over"
            )
        for old, new in zip(old_optimizers, strategy.optimizers):
            if len(old.param_groups) != len(new.param_groups):
                raise RuntimeError(
                    "configure_optimizers returned a different number of parameter groups "
                    "for the low-rank model; PufferfishWarmup cannot carry the learning rates over"
                )
            for old_group, new_group in zip(old.param_groups, new.param_groups):
                for key in ("lr", "initial_lr"):
                    if key in old_group:
                        new_group[key] = old_group[key]
            for group in new.param_groups:
                for p in group["params"]:
                    if p in old.state:
                        new.state[p] = old.state[p]
        for old, new in zip(old_schedulers, strategy.lr_scheduler_configs):
            new.scheduler.load_state_dict(old.scheduler.state_dict())

    # ------------------------------------------------------------------ learning-rate re-warm-up
    def _install_rewarmup(self, trainer: pl.Trainer) -> None:
        """Scale the learning rates by ``k / n`` around each of the first ``n`` optimizer steps after
        the conversion (restored right after the step, so schedulers see their own values)."""
        for handle in self._rewarmup_hooks:
            handle.remove()
        self._rewarmup_hooks = []
        if self.converted_at_step is None or trainer.global_step - self.converted_at_step >= self.lr_rewarmup_steps:
            return
        for optimizer in trainer.optimizers:
            saved: list[float] = []

            def scale(opt: Any, args: Any, kwargs: Any, saved: list[float] = saved) -> None:
                k = trainer.global_step - self.converted_at_step + 1
                saved[:] = [group["lr"] for group in opt.param_groups]
                if k <= self.lr_rewarmup_steps:
                    for group in opt.param_groups:
                        group["lr"] *= k / self.lr_rewarmup_steps

            def restore(opt: Any, args: Any, kwargs: Any, saved: list[float] = saved) -> None:
                for group, lr in zip(opt.param_groups, saved):
                    group["lr"] = lr

            self._rewarmup_hooks += [
                optimizer.register_step_pre_hook(scale),
                optimizer.register_step_post_hook(restore),
            ]
