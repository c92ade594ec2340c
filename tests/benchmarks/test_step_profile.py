"""The step profile's arithmetic (busy, idle, side streams, host calls) on events written out, and
its plumbing through torch's profiler on the CPU."""

from __future__ import annotations

import sys

import torch
from locations import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from step_profile import Event, by_step, profile_steps, summarize, table, union_ns  # noqa: E402

MS = 1_000_000  # ns


def test_the_union_of_spans_counts_overlaps_once():
    assert union_ns([]) == 0
    assert union_ns([(0, 10), (5, 15), (20, 30)]) == 25
    assert union_ns([(20, 30), (0, 40)]) == 40
    assert union_ns([(0, 10), (10, 20)]) == 20


def test_a_step_splits_into_device_work_idle_time_and_side_streams():
    """A 10 ms step: the compute stream (7) runs 1-5 and 6-9 ms, a side stream (13) runs 4-7 ms
    (1 ms of it while the compute stream is idle); work outside the step is left out; the host
    launched three kernels, copied once, synchronised twice (one of them ends the step)."""
    events = [
        Event("kernel", "conv", "7", 1 * MS, 5 * MS),
        Event("kernel", "conv", "7", 6 * MS, 9 * MS),
        Event("kernel", "topk", "13", 4 * MS, 6 * MS),
        Event("gpu_memcpy", "Memcpy DtoD", "13", 6 * MS, 7 * MS),
        Event("kernel", "next step", "7", 11 * MS, 12 * MS),
        Event("cuda_runtime", "cudaLaunchKernel", "", 0, 1),
        Event("cuda_runtime", "cudaLaunchKernel", "", 2 * MS, 2 * MS + 1),
        Event("cuda_driver", "cuLaunchKernel", "", 3 * MS, 3 * MS + 1),
        Event("cuda_runtime", "cudaMemcpyAsync", "", 3 * MS, 3 * MS + 1),
        Event("cuda_runtime", "cudaStreamSynchronize", "", 4 * MS, 5 * MS),
        Event("cuda_runtime", "cudaDeviceSynchronize", "", 9 * MS, 10 * MS),
        Event("cuda_runtime", "cudaLaunchKernel", "", 11 * MS, 11 * MS + 1),
        Event("cpu_op", "aten::add", "", 2 * MS, 3 * MS),
    ]
    p = summarize(events, 0, 10 * MS, closing_syncs=1)
    assert (p.step_ms, p.busy_ms, p.idle_ms) == (10, 8, 2)
    assert (p.side_ms, p.side_alone_ms) == (3, 1)
    assert (p.launches, p.copies, p.syncs) == (3, 1, 1)
    assert p.top_side == [("topk", 2), ("Memcpy DtoD", 1)]


def test_each_event_goes_to_the_step_it_starts_in():
    """Device work and host calls are grouped by the mark they start in; what starts between or
    after the marks, and the host's own ops, go nowhere."""
    marks = [(0, 10), (20, 30)]
    events = [
        Event("kernel", "a", "7", 1, 5),
        Event("cuda_runtime", "cudaLaunchKernel", "", 0, 1),
        Event("kernel", "between", "7", 12, 14),
        Event("gpu_memset", "b", "7", 25, 26),
        Event("cpu_op", "aten::add", "", 21, 22),
        Event("kernel", "after", "7", 31, 32),
    ]
    assert [[e.name for e in group] for group in by_step(events, marks)] == [["a", "cudaLaunchKernel"], ["b"]]


def test_profiled_steps_are_told_apart_by_their_marks_on_the_cpu():
    """Two configurations, two steps each, through torch's profiler: four steps, in order, each
    with its host time and no device work."""
    x = torch.randn(64, 64)
    runs = {"one matmul": lambda: x @ x, "ten matmuls": lambda: [x @ x for _ in range(10)]}
    profiles = profile_steps(runs, steps=2, cuda=False)
    assert list(profiles) == list(runs) and all(len(steps) == 2 for steps in profiles.values())
    for steps in profiles.values():
        for p in steps:
            assert p.step_ms > 0 and p.busy_ms == 0 and p.idle_ms == p.step_ms and p.launches == 0
    rows = table(profiles, {"one matmul": 0.5}).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| one matmul |") and "| 0.50 |" in rows[2]
