"""Rank 0's memory during a save does not grow with the world size (benchmarks/checkpoint_memory.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from checkpoint_memory import measure  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def test_rank_0_peak_memory_during_a_save_does_not_grow_with_the_world_size():
    """32 MB of residual state per rank at W = 1, 2, 4: with per-rank files rank 0's peak stays
    under 1.5 states at every W, so it never holds a second rank's state (the peak itself moves by a
    few MB with the allocator's reuse of freed pages); gathering every rank's state into rank 0 (the
    control, which shows the measurement sees growth) adds at least 2 states per extra rank."""
    results = {w: measure(w, 32) for w in (1, 2, 4)}
    state = results[1][0]
    files = {w: peaks["per-rank files"] for w, (_, peaks) in results.items()}
    gathered = {w: peaks["gathered"] for w, (_, peaks) in results.items()}
    assert all(peak <= 1.5 * state for peak in files.values()), files
    assert gathered[4] >= gathered[1] + 3 * 2 * state * 0.8, gathered
