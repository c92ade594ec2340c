"""``fault_tolerance.lighthouse=local``: fault-tolerant training on one machine, and a demo of it.

This process starts torchft's lighthouse on loopback and ``fault_tolerance.groups`` replica groups,
each ``python train.py`` with this run's options, one process (``trainer.devices=1``), its own
shard of the data and its own run folder ``group<g>/``. With ``fault_tolerance.kill_group`` and
``kill_at`` set, that group kills itself (SIGKILL) in the first step from global step ``kill_at``
on that every group takes part in, before its exchange; this process starts it again under its
id, once, and it heals from a live peer. Each group records its steps (:class:`StepRecord`); at the
end they are merged into ``fault_tolerance.csv`` (step, group, participating groups, committed,
loss) and plotted in ``fault_tolerance.png`` (each group's loss, and the participants, over the
steps). The loggers (CSV, W&B) get ``gc/participants``, ``gc/committed`` and ``gc/failed_steps``.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from omegaconf import DictConfig

#: the overrides each group gets from this process (the user's own are dropped)
GROUP_KEYS = (
    "fault_tolerance.lighthouse",
    "fault_tolerance.replica_group",
    "fault_tolerance.kill_group",
    "fault_tolerance.kill_at",
    "trainer.devices",
    "trainer.start_method",
    "hydra.run.dir",
)


#: a launcher's variables for one world of ranks, which each group (a world of its own) must not share
LAUNCHER_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


class KillAt(pl.Callback):
    """SIGKILL this process before the backward of the first step from global step ``step`` on
    in which every one of ``groups`` replica groups takes part (the demo's lost node)."""

    def __init__(self, step: int, groups: int) -> None:
        self.step, self.groups = step, groups

    def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: Any) -> None:
        if trainer.global_step >= self.step and trainer.strategy.synchronizer.participants == self.groups:
            os.kill(os.getpid(), signal.SIGKILL)


class FinishTogether(pl.Callback):
    """End a replica group's run at the first step from ``trainer.max_steps`` on that every one of
    ``groups`` groups took part in and committed, so that a group that came back late still finds a
    live peer to heal from, and all end at the same step; or ``wait_s`` seconds after
    ``max_steps`` where one does not come back. Each step past ``max_steps`` is allowed one at a
    time (the LR schedule was made for ``max_steps``, and goes on past its end)."""

    def __init__(self, groups: int, wait_s: float) -> None:
        self.groups, self.wait_s = groups, wait_s
        self.reached: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        loop = trainer.fit_loop.epoch_loop
        if trainer.global_step < loop.max_steps:
            return
        self.reached = self.reached or time.monotonic()
        extra = trainer.strategy.synchronizer.telemetry.last.extra
        together = extra.get("committed") and extra.get("participants") == self.groups
        if not together and time.monotonic() - self.reached <= self.wait_s:
            loop.max_steps = trainer.global_step + 1  # one more step


class StepRecord(pl.Callback):
    """Append each training step of this replica group to ``path`` (CSV: global step, participating
    groups, committed, loss); a group started again appends to the same file."""

    FIELDS = ("step", "participants", "committed", "loss")

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        extra = trainer.strategy.synchronizer.telemetry.last.extra
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        row = [trainer.global_step - 1, int(extra["participants"]), int(extra["committed"]), float(loss)]
        new = not self.path.exists()
        with self.path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(self.FIELDS)
            writer.writerow(row)


def run_replica_groups(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> int:
    """Start the lighthouse and the groups (see the module's docstring); the exit status: 0 where
    every group ended well."""
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse's log: warnings only
    from torchft.coordination import LighthouseServer

    ft = cfg.fault_tolerance
    # the join timeout exceeds the time between two quorums: a step, or DiLoCo's inner phase (docs/fault_tolerance.md)
    join_timeout_ms = 60_000 if cfg.sync.name == "diloco" else 1000
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=ft.min_replicas, join_timeout_ms=join_timeout_ms)
    address = lighthouse.address()
    print(f"lighthouse {address}; {ft.groups} replica groups, outputs in {output_dir}/group<g>", flush=True)
    own = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in GROUP_KEYS]
    app = Path(__file__).resolve().parents[1] / "train.py"
    logs = output_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(group: int, kill_at: Any) -> subprocess.Popen:
        args = [
            *own,
            f"fault_tolerance.lighthouse={address}",
            f"fault_tolerance.replica_group={group}",
            f"fault_tolerance.kill_group={'null' if kill_at is None else group}",
            f"fault_tolerance.kill_at={'null' if kill_at is None else kill_at}",
            "trainer.devices=1",
            "trainer.start_method=popen",  # one process, the group itself (no launcher's child)
            f"hydra.run.dir={output_dir / f'group{group}'}",
        ]
        log = open(logs / f"group{group}.log", "ab")  # noqa: SIM115 (the child writes it)
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}  # each group its own world
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        return subprocess.Popen([sys.executable, str(app), *args], stdout=log, stderr=subprocess.STDOUT, env=env)

    groups = {g: start(g, ft.kill_at if g == ft.kill_group else None) for g in range(ft.groups)}
    restarted = False
    status = 0
    try:
        while groups:
            for g, process in list(groups.items()):
                code = process.poll()
                if code is None:
                    continue
                del groups[g]
                if code == -signal.SIGKILL and g == ft.kill_group and not restarted:
                    print(f"replica group {g} was killed (SIGKILL); starting it again", flush=True)
                    groups[g], restarted = start(g, None), True
                elif code != 0:
                    print(f"replica group {g} ended with status {code}; its log: {logs / f'group{g}.log'}")
                    status = 1
            time.sleep(0.2)
    finally:
        for process in groups.values():
            process.kill()
        lighthouse.shutdown()
    rows = merge_records(output_dir, ft.groups)
    if rows:
        plot(rows, output_dir / "fault_tolerance.png")
        print(f"per-step records: {output_dir / 'fault_tolerance.csv'}; plot: {output_dir / 'fault_tolerance.png'}")
    return status


def merge_records(output_dir: Path, groups: int) -> list[dict[str, Any]]:
    """Every group's :class:`StepRecord` rows (``group<g>/steps.csv``) as ``step, group,
    participants, committed, loss``, written to ``fault_tolerance.csv``."""
    rows = []
    for g in range(groups):
        path = output_dir / f"group{g}" / "steps.csv"
        if path.exists():
            with path.open() as f:
                rows += [
                    {
                        "step": int(r["step"]),
                        "group": g,
                        "participants": int(r["participants"]),
                        "committed": int(r["committed"]),
                        "loss": float(r["loss"]),
                    }
                    for r in csv.DictReader(f)
                ]
    rows.sort(key=lambda r: (r["step"], r["group"]))
    if rows:
        with (output_dir / "fault_tolerance.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Each group's loss over the steps (a failed step marked x), above the participating groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), height_ratios=[3, 1.3])
    for g in sorted({r["group"] for r in rows}):
        mine = [r for r in rows if r["group"] == g]
        (line,) = top.plot([r["step"] for r in mine], [r["loss"] for r in mine], ".", ms=3, label=f"group {g}")
        failed = [r for r in mine if not r["committed"]]
        top.plot([r["step"] for r in failed], [r["loss"] for r in failed], "x", color=line.get_color(), ms=8)
    by_step = {r["step"]: r["participants"] for r in rows}
    steps = sorted(by_step)
    bottom.step(steps, [by_step[s] for s in steps], where="post", color="black")
    top.set_yscale("log")
    top.set_ylabel("training loss (x: step not committed)")
    top.legend(loc="upper right")
    bottom.set_ylabel("participating\ngroups")
    bottom.set_xlabel("global step")
    bottom.set_yticks(range(0, max(by_step.values()) + 1))
    top.set_title("Fault-tolerant training: one replica group killed and restarted")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
