"""What both Lightning strategies (``gc_fused``, ``gc_fsdp``) do with the
:class:`~gc_strategy.sync.base.Synchronizer` they hold in ``self.synchronizer``, around the
Trainer's loop: each forward inside the synchroniser's ``forward_pass``, accumulation without
exchange, the synchroniser's step after each optimizer step, its ``gc/...`` telemetry to the
Trainer's loggers, the fusion plan once chosen, the warning where momentum would be applied twice,
each rank's state beside a checkpoint (saved, loaded and removed with it), the optimizer step taken
only where the step commits (fault tolerance), the process group's end at exit, and closing it at
teardown."""

from __future__ import annotations

import atexit
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..components import Components, double_momentum
from ..registry import Option
from ..sync.base import Synchronizer
from .checkpoint import load_rank_states, remove_rank_states, save_rank_states, state_folder

#: the key of the checkpoint's manifest of the ranks' synchroniser states (:mod:`gc_strategy.integrations.checkpoint`)
CHECKPOINT_KEY = "gc_strategy"
#: the strategies' option ``log_every_n_steps``
LOG_EVERY = Option(None, int, low=1, optional=True, help="steps between telemetry logs (None: the Trainer's)")


class SynchronizerGlue:
    """The shared part of the two strategies (see the module's docstring); a mixin before
    Lightning's strategy class, whose ``optimizer_step`` and ``setup_optimizers`` it extends."""

    synchronizer: Synchronizer | None
    components: Components
    #: how often the telemetry goes to the loggers (None: the Trainer's ``log_every_n_steps``)
    log_every_n_steps: int | None = None
    _announced_plan: dict[str, Any] | None = None
    #: the Trainer's counters and schedulers as healed objects (where the synchroniser was there to take them)
    _loop_state: LoopState | None = None

    def _forward_pass(self) -> AbstractContextManager:
        """The synchroniser's ``forward_pass``; nothing before it is built."""
        return nullcontext() if self.synchronizer is None else self.synchronizer.forward_pass()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_pass():
            return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_pass():
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_pass():
            return super().test_step(*args, **kwargs)  # type: ignore[misc]

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_pass():
            return super().predict_step(*args, **kwargs)  # type: ignore[misc]

    def block_backward_sync(self) -> AbstractContextManager:
        """Accumulation without exchange: the synchroniser's ``no_sync``; nothing before it is built."""
        return nullcontext() if self.synchronizer is None else self.synchronizer.no_sync()

    #: a checkpoint's synchroniser state read before the synchroniser was built: (manifest, folder)
    _pending_state: tuple[dict[str, Any], str] | None = None

    def close_synchronizer(self) -> None:
        if self.synchronizer is not None:
            self.synchronizer.close()
            self.synchronizer = None
        self._pending_state = None  # a checkpoint's state applies only to the run that loaded it

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint, and each rank's synchroniser state beside it, when fitting (``validate``,
        ``test`` and ``predict`` with ``ckpt_path=`` have no synchroniser): into the synchroniser, or
        kept for :meth:`load_pending_state` where it is not built yet."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        saved = checkpoint.get(CHECKPOINT_KEY)
        trainer = self._trainer()
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        if saved is not None and fitting:
            folder = state_folder(checkpoint_path, saved=True)
            if self.synchronizer is not None:
                load_rank_states(self.synchronizer, saved, folder)
            else:
                self._pending_state = (saved, folder)
        return checkpoint

    def load_pending_state(self) -> None:
        """Right after the synchroniser is built: the state a checkpoint read earlier holds for it."""
        if self._pending_state is not None and self.synchronizer is not None:
            load_rank_states(self.synchronizer, *self._pending_state)
            self._pending_state = None

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The optimizer states as Lightning restores them (rank 0's); with DiLoCo then each rank's
        own (inner phases let them differ)."""
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        if self.synchronizer is not None:
            self.synchronizer.use_optimizers(self.optimizers)  # type: ignore[attr-defined]
            self.synchronizer.restore_optimizers()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its synchroniser state beside the checkpoint (:mod:`gc_strategy.integrations.checkpoint`);
        the checkpoint holds their manifest under :data:`CHECKPOINT_KEY`."""
        if self.synchronizer is not None:
            self.synchronizer.use_optimizers(self.optimizers)  # type: ignore[attr-defined]
            manifest = save_rank_states(self.synchronizer, state_folder(filepath))
            checkpoint = {**checkpoint, CHECKPOINT_KEY: manifest}
            if not self.synchronizer.writes_checkpoints:  # fault tolerance: another group writes it
                return
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def remove_checkpoint(self, filepath: Any) -> None:
        """The checkpoint and the ranks' state files beside it (by the group that writes them)."""
        if self.synchronizer is not None and not self.synchronizer.writes_checkpoints:
            return
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        if self.is_global_zero:  # type: ignore[attr-defined]
            remove_rank_states(state_folder(filepath))

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # type: ignore[misc]
        message = double_momentum(self.components, self.optimizers)  # type: ignore[attr-defined]
        if message is not None:
            rank_zero_warn(message)
        if self.synchronizer is not None:
            self.attach_optimizers(trainer)

    def attach_optimizers(self, trainer: Any) -> None:
        """The synchroniser takes the Trainer's optimizers, and its counters and schedulers as
        healed objects (:class:`LoopState`)."""
        self.synchronizer.use_optimizers(self.optimizers)  # type: ignore[union-attr, attr-defined]
        self._loop_state = LoopState(trainer)
        self.synchronizer.register_healed({"trainer_loop": self._loop_state})  # type: ignore[union-attr]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.synchronizer is not None and self.synchronizer.votes_on_commit:
            output = closure()  # forward and backward, then the vote: a step that failed somewhere is not taken
            if not self.synchronizer.should_commit():
                self._log_telemetry()
                return output
            closure = lambda: output  # noqa: E731 (the optimizer calls it for the loss)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if self.synchronizer is not None:
            self._after_optimizer_step()
        self._log_telemetry()
        self._announce_plan()
        return output

    def _after_optimizer_step(self) -> None:
        """The synchroniser's hook; a round in it (DiLoCo's outer round) sees the step taken and not
        yet counted by Lightning (:class:`LoopState`)."""
        if self._loop_state is None:
            self.synchronizer.after_optimizer_step()  # type: ignore[union-attr]
            return
        self._loop_state.after_step = True
        try:
            self.synchronizer.after_optimizer_step()  # type: ignore[union-attr]
        finally:
            self._loop_state.after_step = False

    def _trainer(self) -> Any:
        """The Trainer the LightningModule is attached to, or None: also for a module loaded or
        connected outside ``fit``, whose ``.trainer`` raises."""
        module = self.lightning_module  # type: ignore[attr-defined]
        return None if module is None else module._trainer

    def _log_telemetry(self) -> None:
        trainer = self._trainer()
        if self.synchronizer is None or trainer is None or not trainer.loggers or not self.is_global_zero:  # type: ignore[attr-defined]
            return
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:
            return
        metrics = self.synchronizer.telemetry.last.as_metrics()
        if self.synchronizer.last_round is not None:  # fault tolerance: the round's report
            metrics.update(self.synchronizer.last_round.as_metrics())
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _announce_plan(self) -> None:
        """``fusion="auto"``: once its plan is chosen and verified, print it and log it."""
        report = self.synchronizer.plan_report if self.synchronizer is not None else None
        if report is None or report["measured_step_s"] is None or report is self._announced_plan:
            return
        self._announced_plan = report
        verdict = ""
        if "predicted_bf16_allreduce_s" in report:  # absent from a plan restored from an older checkpoint
            pays = "pays" if report["compression_pays"] else "does not pay"
            verdict = f"; bf16 allreduce predicted {report['predicted_bf16_allreduce_s']:.4f} s: compression {pays}"
        rank_zero_info(
            f"fusion=auto chose {report['buckets']} buckets ({', '.join(f'{mb:g}' for mb in report['bucket_mb'])} MB) "
            f"by {report['chosen_by']}: predicted step {report['predicted_step_s']:.4f} s, measured "
            f"{report['measured_step_s']:.4f} s ({len(report['trials'])} plans tried; "
            f"profiling {report['profile_s']:.2f} s, "
            f"search {1000 * report['search_s']:.1f} ms){verdict}"
        )
        trainer = self._trainer()
        if trainer is None or not self.is_global_zero:  # type: ignore[attr-defined]
            return
        metrics = {
            f"gc/plan_{key}": float(report[key])
            for key in (
                "buckets",
                "predicted_step_s",
                "measured_step_s",
                "predicted_fp32_allreduce_s",
                "predicted_bf16_allreduce_s",
            )
            if key in report
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


class LoopState:
    """The Trainer's step counters (``global_step`` and the epoch loop's progress) and its LR
    schedulers' states, as one object a replica group joining late takes from a live peer
    (:meth:`~gc_strategy.sync.base.Synchronizer.register_healed`), so that every group has the same
    ``global_step`` and learning rate.

    Where the peer's state is taken matters: a round in the forward (every step's; DiLoCo's first)
    comes before the peer's step is counted, as the healing group's own step will be; DiLoCo's outer
    round comes after the peer's optimizer step (:attr:`after_step`, set around
    ``after_optimizer_step``), before Lightning counts it and steps the schedulers, while the
    healing group's current step is the peer's next one. Such a state is loaded as the peer will
    stand once its step ends: the step counted, each per-step scheduler stepped once."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        #: whether the optimizer's step of the current training step was taken
        self.after_step = False

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        loop = trainer.fit_loop.epoch_loop.state_dict()
        return {"loop": loop, "schedulers": schedulers, "after_step": self.after_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loop = copy.deepcopy(state["loop"])
        step = loop.get("automatic_optimization.optim_progress", {}).get("optimizer", {}).get("step")
        after_step = state["after_step"] and step is not None
        if after_step:
            for counts in (step["total"], step["current"]):
                counts["completed"] = counts["ready"]
        self.trainer.fit_loop.epoch_loop.load_state_dict(loop)
        for config, scheduler_state in zip(self.trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
            if after_step and config.interval == "step" and not config.reduce_on_plateau:
                config.scheduler.step()


def end_process_group() -> None:
    """Destroy the default process group where one is left: Lightning destroys only NCCL groups,
    and a gloo group left to the interpreter's shutdown can abort the process after its work is done."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_process_group_at_exit() -> None:
    """Destroy the default process group at the interpreter's exit. Lightning destroys only NCCL
    groups; a gloo group left to the interpreter's shutdown can abort the process ("terminate
    called without an active exception") after training succeeded. Registering once keeps a second
    fit from stacking handlers."""
    atexit.unregister(end_process_group)
    atexit.register(end_process_group)
