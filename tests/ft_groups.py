"""Replica groups as process trees started by the fault-tolerance tests (tests/sync/fault_tolerance/):
each the leader of its own process group (setsid), killed when its test ends
(tests/sync/fault_tolerance/conftest.py)."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from locations import ROOT, TESTS

from app.replica_groups import LAUNCHER_KEYS

WORKER = TESTS / "ft_worker.py"
#: a replica group of several ranks: torchrun with a rendezvous of its own on this machine
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=0"]
#: the groups a test started: none outlives it
STARTED: list[subprocess.Popen] = []


def group_env(**extra: str) -> dict[str, str]:
    """A replica group's environment: a world of its own, sharing no launcher's variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    return {**env, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT), **extra}


def start(
    lighthouse: str,
    group: int,
    groups: int,
    out: Path,
    *extra: str,
    ranks: int = 1,
    node: Any = None,
    torchrun: bool = False,
) -> subprocess.Popen:
    """Replica group ``group`` of tests/ft_worker.py: one process, or ``ranks`` started by one
    torchrun of its own (one rank too, with ``torchrun``); on loopback, or on an emulated ``node``
    (benchmarks/netns.py)."""
    args = ["--lighthouse", lighthouse, "--group", str(group), "--groups", str(groups)]
    args += ["--out", str(out / f"{group}.pt")]
    launcher = [sys.executable] if ranks == 1 and not torchrun else [*TORCHRUN, f"--nproc_per_node={ranks}"]
    if node is None:
        return launch([*launcher, str(WORKER), *args, *extra], out / f"{group}.log")
    command = [*node.command, *launcher, str(WORKER), *args, "--host", node.address, *extra]
    return launch(command, out / f"{group}.log", GLOO_SOCKET_IFNAME=node.interface)


def launch(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    """``command`` in a process group of its own (killed when the test ends), writing to ``log``."""
    with open(log, "ab") as file:
        process = subprocess.Popen(command, env=group_env(**env), stdout=file, stderr=file, start_new_session=True)
    STARTED.append(process)
    return process


def finish(process: subprocess.Popen, out: Path, group: int, timeout: float = 240, load: bool = True) -> dict | None:
    """Wait for group ``group`` to end well; its results (``OUT/GROUP.pt``)."""
    assert process.wait(timeout=timeout) == 0, (out / f"{group}.log").read_text()[-3000:]
    return torch.load(out / f"{group}.pt") if load else None


def same(a: object, b: object) -> bool:
    """Whether two states are equal to the bit."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def third_killed_and_restarted(lighthouse: str, out: Path, options: list[str], dying: list[str]) -> list[dict]:
    """Three groups started together, the third with ``dying`` (it kills itself: SIGKILL), started
    again under its id; every group's results once all have ended."""
    together = ["--barrier", str(out)]
    groups = [start(lighthouse, g, 3, out, *options, *together, *(dying if g == 2 else [])) for g in range(3)]
    groups[2].wait(timeout=120)
    assert groups[2].returncode == -signal.SIGKILL
    groups[2] = start(lighthouse, 2, 3, out, *options)
    return [finish(p, out, g) for g, p in enumerate(groups)]
