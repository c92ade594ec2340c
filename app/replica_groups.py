"""``fault_tolerance.lighthouse=local``: fault-tolerant training on one machine, and a demo of it.

This process starts torchft's lighthouse on loopback and ``fault_tolerance.groups`` replica groups,
each ``python train.py`` with this run's options, one process (or the ``trainer.devices`` that the
command line sets), its own shard of the data and its own run folder ``group<g>/``; their
checkpoints go to one folder (``checkpoint_dir``, by default ``checkpoints/`` beside the groups'
folders). With ``fault_tolerance.kill_group`` and ``kill_at`` set, that group kills itself
(SIGKILL) in the first step from global step ``kill_at`` on that every group takes part in, before
its exchange; this process starts it again under its id, once, and it heals from a live peer. Each
group records its steps (:class:`StepRecord`) and, at its end, a digest of its parameters
(:class:`ParameterDigest`); at the end the steps are merged into ``fault_tolerance.csv`` (step,
group, participating groups, committed, loss, time) and plotted in ``fault_tolerance.png`` (each
group's loss, and the participants, over the steps), and the console says what happened
(:func:`describe`). The loggers (CSV, W&B) get ``gc/participants``, ``gc/committed`` and
``gc/failed_steps``.
"""

from __future__ import annotations

import csv
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig

from gc_strategy.sync.fault_tolerance.lighthouse import HEARTBEAT_TIMEOUT_S
from gc_strategy.sync.fault_tolerance.torchft_setup import require_torchft

#: the overrides each group gets from this process (the user's own are dropped)
GROUP_KEYS = (
    "fault_tolerance.lighthouse",
    "fault_tolerance.replica_group",
    "fault_tolerance.kill_group",
    "fault_tolerance.kill_at",
    "trainer.devices",
    "trainer.start_method",
    "checkpoint_dir",
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


class StepRecord(pl.Callback):
    """Append each training step of this replica group to ``path`` (CSV: global step, participating
    groups, committed, the group's first rank's loss, the wall-clock time), from that rank alone; a
    group started again appends to the same file."""

    FIELDS = ("step", "participants", "committed", "loss", "time")

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        if not trainer.is_global_zero:  # the group's launch: its ranks report one round
            return
        report = trainer.strategy.synchronizer.last_round
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        row = [trainer.global_step - 1, report.participants, int(report.committed), float(loss), time.time()]
        new = not self.path.exists()
        with self.path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(self.FIELDS)
            writer.writerow(row)


class ParameterDigest(pl.Callback):
    """At the end of training, write the SHA-256 of the parameters this replica group holds alike
    with the others to ``path`` (the synchroniser's ``replicated_parameters``: DiLoCo's outer
    ones): groups that end together hold the same ones, to the bit (each keeps its own buffers,
    such as BatchNorm's statistics)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(parameter_digest(trainer.strategy.synchronizer.replicated_parameters()) + "\n")


def parameter_digest(parameters: dict[str, Any]) -> str:
    """The SHA-256 of ``parameters``: each one's name and bytes, in order (sharded by FSDP2: this
    rank's shards, which the first rank of every group holds alike). The bytes are read from a
    copy: ``numpy()`` makes a tensor's storage unresizable for good, and FSDP2 frees its gathered
    parameters by resizing theirs."""
    digest = hashlib.sha256()
    for name, tensor in parameters.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().clone().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def group_devices(cfg: DictConfig, overrides: list[str]) -> int:
    """A demo group's ranks: ``trainer.devices`` where the command line sets it, else 1 (one
    process per group, so that the groups share a small machine)."""
    set_here = any(o.split("=", 1)[0].lstrip("+") == "trainer.devices" for o in overrides)
    return cfg.trainer.devices if set_here else 1


def run_replica_groups(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> int:
    """Start the lighthouse and the groups (see the module's docstring); the exit status: 0 where
    every group ended well."""
    require_torchft()  # quiet, and the lighthouse's log at warnings only
    from torchft.coordination import LighthouseServer

    ft = cfg.fault_tolerance
    # the join timeout exceeds the time between two quorums: a step, or DiLoCo's inner phase (docs/fault_tolerance.md)
    join_timeout_ms = 60_000 if cfg.sync.name == "diloco" else 1000
    # a silent group is not counted for longer than the groups take to find it silent (silence_s)
    heartbeat_timeout_ms = int(min(HEARTBEAT_TIMEOUT_S, ft.silence_s) * 1000)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=ft.min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    address = lighthouse.address()
    devices = group_devices(cfg, overrides)
    checkpoints = cfg.checkpoint_dir if cfg.checkpoint_dir is not None else output_dir / "checkpoints"
    each = f"{devices} process{'es' if devices > 1 else ''} each"
    named = plural(ft.groups, "replica group")
    print(f"lighthouse {address}; {named} ({each}), outputs in {output_dir}/group<g>", flush=True)
    own = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in GROUP_KEYS]
    script = Path(__file__).resolve().parents[1] / "train.py"
    logs = output_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(group: int, kill_at: Any) -> subprocess.Popen:
        args = [
            *own,
            f"fault_tolerance.lighthouse={address}",
            f"fault_tolerance.replica_group={group}",
            f"fault_tolerance.kill_group={'null' if kill_at is None else group}",
            f"fault_tolerance.kill_at={'null' if kill_at is None else kill_at}",
            f"trainer.devices={devices}",
            "trainer.start_method=popen",  # the group's first rank is the process started here
            f"checkpoint_dir={checkpoints}",
            f"hydra.run.dir={output_dir / f'group{group}'}",
        ]
        log = open(logs / f"group{group}.log", "ab")  # noqa: SIM115 (the child writes it)
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}  # each group its own world
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        return subprocess.Popen([sys.executable, str(script), *args], stdout=log, stderr=subprocess.STDOUT, env=env)

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
                    log = logs / f"group{g}.log"
                    print(f"replica group {g} ended with status {code}; the end of its log ({log}):", flush=True)
                    print(log_tail(log), flush=True)
                    status = 1
            time.sleep(0.2)
    finally:
        for process in groups.values():
            process.kill()
        lighthouse.shutdown()
    rows = merge_records(output_dir, ft.groups)
    if rows:
        plot(rows, output_dir / "fault_tolerance.png")
        digests = {g: read_digest(output_dir / f"group{g}" / "parameters.sha256") for g in range(ft.groups)}
        print("\n".join(describe(rows, ft.groups, ft.kill_group, digests)))
        print(f"per-step records: {output_dir / 'fault_tolerance.csv'}; plot: {output_dir / 'fault_tolerance.png'}")
    return status


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a group's log, indented: why a group failed, where it is read."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no log)"]
    return "\n".join(f"  | {line.rstrip()}" for line in text[-lines:])


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def read_digest(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def describe(rows: list[dict[str, Any]], groups: int, killed: int | None, digests: dict[int, str | None]) -> list[str]:
    """What happened, from every group's records: the kill and the steps it failed, the restarted
    group's heal, and where and how every group ended."""
    lines = []
    failed = [r for r in rows if r["group"] != killed and not r["committed"]]
    if killed is not None and failed:
        kill_step, kill_time = failed[0]["step"], failed[0]["time"]
        lost = {g: sum(1 for r in failed if r["group"] == g) for g in range(groups) if g != killed}
        each = {f"{n}" for n in lost.values()}
        losses = (
            f"{plural(next(iter(lost.values())), 'step')} each"
            if len(each) == 1
            else ", ".join(f"group {g} {plural(n, 'step')}" for g, n in lost.items())
        )
        lines.append(
            f"replica group {killed} was killed (SIGKILL) in step {kill_step}: that step failed on the others "
            f"and was applied nowhere; they went on without it and lost {losses}"
        )
        back = [r for r in rows if r["group"] == killed and r["time"] > kill_time]
        if back:
            lines.append(
                f"replica group {killed} was started again, healed from a live peer and took part from step "
                f"{back[0]['step']}, {back[0]['time'] - kill_time:.1f} s after the kill (its start-up included)"
            )
        else:
            lines.append(f"replica group {killed} was started again but took no step")
    last = {g: max(r["step"] for r in rows if r["group"] == g) for g in sorted({r["group"] for r in rows})}
    ends = sorted(set(last.values()))
    end = f"ended at step {ends[0]}" if len(ends) == 1 else "ended at steps " + ", ".join(map(str, last.values()))
    known = {d for d in digests.values() if d is not None}
    if len(known) == 1 and None not in digests.values():
        same = f"with the same parameters, to the bit (SHA-256 {next(iter(known))[:12]})"
    elif len(known) > 1:
        same = "with different parameters: " + ", ".join(f"group {g} {d[:12]}" for g, d in digests.items() if d)
    else:
        same = "(a group wrote no digest of its parameters)"
    lines.append(f"{'all ' if len(last) > 1 else ''}{plural(len(last), 'replica group')} {end}, {same}")
    return lines


def merge_records(output_dir: Path, groups: int) -> list[dict[str, Any]]:
    """Every group's :class:`StepRecord` rows (``group<g>/steps.csv``) as ``step, group,
    participants, committed, loss, time``, written to ``fault_tolerance.csv``."""
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
                        "time": float(r["time"]),
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
