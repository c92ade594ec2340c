"""Step timing, throughput, the optional uncompressed baseline phase and the end-of-run summary.

Step time is the wall time from ``on_train_batch_start`` to ``on_train_batch_end`` on rank 0
(forward, backward, gradient synchronisation, optimizer step; data loading excluded). With
``baseline_steps > 0`` the first steps run with ``compressor=none`` (same processes, same fusion
plan) and the summary reports the **measured** speedup: median baseline step time / median
compressed step time, each phase without its first ``warmup_steps`` steps. With ``fusion=auto`` the
summary also carries the timeline model's **estimate** (labelled so): the predicted step time of an
uncompressed fp32 allreduce / its predicted step time for the chosen plan. The summary holds the
last validation's ``val/...`` metrics beside them, with its step (``val_step``). Where each sample
is a sequence of ``tokens_per_sample`` tokens (a language model), throughput is also counted in
tokens (``perf/tokens_per_s``, shown in the progress bar; ``throughput_tokens_per_s``).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger

from ..components import build_components
from ..telemetry import StepTelemetry
from .lightning import GCFusedStrategy


class ThroughputMonitor(pl.Callback):
    """Logs ``perf/...`` every step; at the end rank 0 writes ``summary.json`` in ``output_dir`` and
    sends the summary, the bucket plan (a table) and the step-time breakdown (a bar chart) to the
    loggers."""

    def __init__(
        self,
        batch_size: int,
        output_dir: str,
        baseline_steps: int = 0,
        warmup_steps: int = 5,
        tokens_per_sample: int | None = None,
    ) -> None:
        if baseline_steps < 0 or warmup_steps < 0:
            raise ValueError(
                f"speedup.baseline_steps = {baseline_steps} and speedup.warmup_steps = {warmup_steps}: "
                "both must be >= 0"
            )
        self.batch_size, self.baseline_steps, self.warmup_steps = batch_size, baseline_steps, warmup_steps
        self.output_dir = Path(output_dir)
        self.tokens_per_sample = tokens_per_sample
        self.times: dict[str, list[float]] = {"baseline": [], "compressed": []}
        self.telemetry: list[StepTelemetry] = []  # the synchroniser's record of each timed compressed step
        self.summary: dict[str, Any] = {}
        self._configured = None
        self._start = 0.0
        self._seen: tuple[Any, int] = (None, 0)  # the synchroniser and its exchange count after the last step
        #: the ``val/...`` metrics of the last validation and its step
        self.validation: dict[str, float] = {}

    def _phase(self, step: int) -> str:
        return "baseline" if step < self.baseline_steps else "compressed"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if self.baseline_steps and isinstance(strategy, GCFusedStrategy) and trainer.global_step < self.baseline_steps:
            self._configured = strategy.components
            strategy.switch_components(build_components("none", fusion=strategy.components.fusion))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._configured is not None and trainer.global_step == self.baseline_steps:
            trainer.strategy.switch_components(self._configured)
            self._configured = None
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        elapsed = time.perf_counter() - self._start
        step = trainer.global_step - 1  # the step that just ran
        phase = self._phase(step)
        first = 0 if phase == "baseline" else self.baseline_steps
        synchronizer = getattr(trainer.strategy, "synchronizer", None)
        # whether an exchange ran in this step (every step; every few with sync=DiLoCo(...))
        exchanged = synchronizer is not None and (
            synchronizer is not self._seen[0] or synchronizer.telemetry.steps > self._seen[1]
        )
        self._seen = (synchronizer, synchronizer.telemetry.steps if synchronizer is not None else 0)
        if step - first >= self.warmup_steps:
            self.times[phase].append(elapsed)
            if phase == "compressed" and exchanged:
                self.telemetry.append(replace(synchronizer.telemetry.last))
        samples = self.batch_size * trainer.world_size
        pl_module.log_dict(
            {
                "perf/step_time_s": elapsed,
                "perf/samples_per_s": samples / elapsed,
                "perf/baseline_phase": float(phase == "baseline"),
            },
            rank_zero_only=True,
        )
        if self.tokens_per_sample is not None:
            tokens_per_s = samples * self.tokens_per_sample / elapsed
            pl_module.log("perf/tokens_per_s", tokens_per_s, prog_bar=True, rank_zero_only=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        self.validation = {**metrics, "val_step": trainer.global_step}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compressed = self.times["compressed"]
        if not compressed:
            return
        median = statistics.median(compressed)
        summary: dict[str, Any] = {
            "step_time_s": median,
            "step_times_s": compressed,
            "throughput_samples_per_s": self.batch_size * trainer.world_size / median,
            **self.validation,
        }
        if self.tokens_per_sample is not None:
            summary["throughput_tokens_per_s"] = summary["throughput_samples_per_s"] * self.tokens_per_sample
        if self.telemetry:  # over the timed steps only (not the warm-up, e.g. PowerSGD's start_iter)
            raw, sent = (sum(getattr(t, key) for t in self.telemetry) for key in ("raw_bytes", "sent_bytes"))
            summary["compression_ratio"] = raw / sent if sent else float("inf")
            summary["sent_bytes_per_step"] = sent / len(compressed)
            if len(self.telemetry) == len(compressed):  # one exchange per step
                summary["breakdown"] = self._breakdown(median, self.telemetry)
        strategy = trainer.strategy
        if isinstance(strategy, GCFusedStrategy) and strategy.synchronizer is not None:
            report = strategy.synchronizer.plan_report
            if report is not None:
                summary["auto_plan_buckets"] = report["buckets"]
                summary["auto_plan_predicted_step_s"] = report["predicted_step_s"]
                summary["speedup_vs_fp32_allreduce_estimated_by_timeline_model"] = (
                    report["predicted_fp32_allreduce_s"] / report["predicted_step_s"]
                )
            summary["buckets"] = [
                {
                    "bucket": b.index,
                    "tensors": len(b.names),
                    "elements": b.numel,
                    "bytes": b.nbytes,
                    "first": b.names[0],
                }
                for synchronizer in getattr(strategy.synchronizer, "synchronizers", [strategy.synchronizer])
                for b in synchronizer.buckets
            ]
        if self.times["baseline"]:
            baseline = statistics.median(self.times["baseline"])
            summary["baseline_step_time_s"] = baseline
            summary["speedup_vs_fp32_allreduce_measured"] = baseline / median
        else:
            summary["speedup_vs_fp32_allreduce_measured"] = None  # set speedup.baseline_steps to measure it
        self.summary = summary
        if trainer.is_global_zero:
            self._publish(trainer, summary)

    def _publish(self, trainer: pl.Trainer, summary: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                run = logger.experiment
                scalars = {k: v for k, v in summary.items() if k not in ("breakdown", "buckets")}
                run.summary.update(scalars)
                # an offline run keeps its summary in the binary .wandb file alone: a readable copy
                (Path(run.dir) / "wandb-summary.json").write_text(json.dumps(scalars, indent=2))
                if "buckets" in summary:
                    columns = list(summary["buckets"][0])
                    run.log(
                        {
                            "gc/bucket_plan": wandb.Table(
                                columns=columns, data=[list(b.values()) for b in summary["buckets"]]
                            )
                        }
                    )
                if "breakdown" in summary:
                    table = wandb.Table(columns=["part", "seconds"], data=list(summary["breakdown"].items()))
                    run.log(
                        {"gc/step_breakdown": wandb.plot.bar(table, "part", "seconds", title="step time breakdown")}
                    )
                summary["wandb_dir"] = run.dir
            else:
                scalars = {f"summary/{k}": v for k, v in summary.items() if isinstance(v, (int, float))}
                logger.log_metrics(scalars, step=trainer.global_step)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the W&B run, so its files (summary included) are complete also in fork/spawn
        workers, which exit without running W&B's exit handler."""
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero and logger._experiment is not None:
                logger.experiment.finish()

    @staticmethod
    def _breakdown(step_time: float, telemetry: list[StepTelemetry]) -> dict[str, float]:
        """Median seconds per timed step: compression (encode + decode), exposed communication, the rest."""
        compression = statistics.median(t.encode_s + t.decode_s for t in telemetry)
        exposed = statistics.median(t.exposed_wait_s for t in telemetry)
        return {
            "compute": max(0.0, step_time - compression - exposed),
            "encode+decode": compression,
            "exposed communication": exposed,
        }
