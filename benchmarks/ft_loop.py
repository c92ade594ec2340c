"""The plain fault-tolerant training loops of docs/fault_tolerance.md as the fault benchmarks run them
(``fault_chaos.py``, ``heal_large.py``): each step's end, outcome and participants printed as a line
of JSON, until a step named in a stop file that every group took part in; and those lines read back.
And a replica group's launch: one process, or one torchrun of its ranks on one machine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: how many steps past the furthest group's last logged step the stop file names: the groups step
#: in lockstep (a quorum each step), so each reads the file before the step named, even where one
#: was a step ahead, or its step in flight, when the file was written; with a stop one or two steps
#: on, one group could stop while the other, having looked a moment before the file was written,
#: goes on alone and never meets the stop with every group
STOP_MARGIN = 20


def train_until_stopped(sync: Any, optimizer: Any, loss_of: Callable[[int], Any], groups: int, stop: Path) -> None:
    """Steps of ``loss_of(step)`` (the step's loss, computed in the forward pass) until ``stop``,
    once written, names a step this group reached committed with all ``groups``."""
    while True:
        step = sync.start_step()
        with sync.forward_pass():
            loss = loss_of(step)
        loss.backward()
        committed = sync.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        print(json.dumps({"step": step, "end": time.time(), "committed": committed, "with": sync.participants}))
        sys.stdout.flush()
        if committed and sync.participants == groups and stop.exists() and step + 1 >= int(stop.read_text()):
            return


def train_inner_steps_until_stopped(
    sync: Any, optimizer: Any, loss_of: Callable[[int], Any], groups: int, stop: Path
) -> None:
    """DiLoCo's loop (``FaultTolerantDiLoCo``): inner steps of ``loss_of(step)``, each printed as it
    ends (an inner step always applies: ``committed``; ``with``: the last round's participants),
    until ``stop``, once written, names an inner step this group reached at a round that every one
    of ``groups`` contributed to."""
    while True:
        step = sync.committed_steps
        with sync.forward_pass():
            loss = loss_of(step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.after_optimizer_step()
        print(json.dumps({"step": step, "end": time.time(), "committed": True, "with": sync.participants}))
        sys.stdout.flush()
        if sync.together and sync.participants == groups and stop.exists() and step + 1 >= int(stop.read_text()):
            return


def records(log: Path, key: str = "step") -> list[dict]:
    """The JSON lines of a group's log whose first key is ``key`` (every run of it, in order)."""
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.startswith(f'{{"{key}"')]


def together(log: Path, groups: int) -> int:
    """The steps a group's log holds that committed with all ``groups``."""
    return sum(r["committed"] and r["with"] == groups for r in records(log))


def write_stop(stop: Path, logs: list[Path]) -> None:
    """Name the step the groups end at in ``stop``: :data:`STOP_MARGIN` past the last step in
    ``logs``."""
    last = max(r["step"] for log in logs for r in records(log))
    stop.write_text(str(last + STOP_MARGIN))


def launcher(ranks: int) -> list[str]:
    """The command that runs a group's script: this interpreter for one rank, else torchrun of
    ``ranks`` on one machine (``--max-restarts=0``: a group whose rank dies ends, and is started
    again as a whole)."""
    if ranks == 1:
        return [sys.executable]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--max-restarts=0", f"--nproc_per_node={ranks}"]
    return [sys.executable, *torchrun]


def torchrun_ranks(process: subprocess.Popen) -> list[int]:
    """The process ids of the ranks a torchrun ``process`` started (its children)."""
    children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in children.split()]
