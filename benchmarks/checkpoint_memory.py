"""Rank 0's peak memory while the synchroniser's state is saved, against the world size.

Each of ``W`` gloo ranks (forked processes on this machine) holds residual error-feedback state
for a stack of linear layers of ``--state-mb`` megabytes of fp32 parameters. Rank 0's peak resident
memory during the save, above its resident memory just before, is read from Linux's ``VmHWM``
(reset through ``/proc/self/clear_refs``). Two ways to save:

- ``per-rank files`` (what the strategy does, :mod:`gc_strategy.integrations.checkpoint`): every rank writes its
  own state beside the checkpoint;
- ``gathered``: every rank's state gathered into rank 0 (``all_gather_object``), as one checkpoint
  file would hold them.

    python benchmarks/checkpoint_memory.py --state-mb 64 --world-sizes 1 2 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from cli import integer_at_least
from torch import nn

from gc_strategy import GradientSynchronizer, build_components
from gc_strategy.integrations.checkpoint import save_rank_states
from gc_strategy.tools.ranks import run_ranks

METHODS = ("per-rank files", "gathered")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_during(action) -> float:
    """Peak resident memory during ``action()`` above the resident memory before it, in MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status_kb("VmRSS")
    action()
    return (_status_kb("VmHWM") - before) / 1024


def _gather(synchronizer: GradientSynchronizer, world_size: int) -> None:
    """Every rank's state gathered on every rank, as one checkpoint file holding them all needs."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, synchronizer.state_dict())


def _rank(rank: int, world_size: int, state_mb: int, folder: str) -> tuple[float, dict[str, float]]:
    """(state MB per rank, {method: this rank's peak MB above its resident memory})."""
    width = 1024
    layers = max(1, state_mb * 2**20 // (4 * width * width))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    c = build_components("randk", "residual", density=0.01, fusion="single")
    synchronizer = GradientSynchronizer(model, c)
    model(torch.randn(4, width)).square().mean().backward()  # one step: the residuals are full
    peaks = {}
    for method in METHODS:
        dist.barrier()
        if method == "per-rank files":
            peaks[method] = _peak_during(lambda: save_rank_states(synchronizer, os.path.join(folder, f"w{world_size}")))
        else:
            peaks[method] = _peak_during(lambda: _gather(synchronizer, world_size))
    return layers * width * width * 4 / 2**20, peaks


def measure(world_size: int, state_mb: int) -> tuple[float, dict[str, float]]:
    """(state MB per rank, {method: rank 0's peak MB above its resident memory}) at ``world_size``."""
    with tempfile.TemporaryDirectory() as folder:
        return run_ranks(_rank, world_size, state_mb, folder, timeout=600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mb", type=integer_at_least(4), default=64, help="error-feedback state per rank")
    parser.add_argument("--world-sizes", type=integer_at_least(1), nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        parser.error("the peak memory is read from Linux's /proc/self/status; run it on Linux")
    print(f"{'world size':>10} {'state per rank MB':>18} " + " ".join(f"{m + ' MB':>18}" for m in METHODS))
    for world_size in args.world_sizes:
        state, peaks = measure(world_size, args.state_mb)
        print(f"{world_size:>10} {state:>18.1f} " + " ".join(f"{peaks[m]:>18.1f}" for m in METHODS))


if __name__ == "__main__":
    main()
