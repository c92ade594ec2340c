"""Where a GPU step's time goes, from torch's profiler: device work, device idle, and host calls.

A configuration can lengthen a step in two ways: it gives the GPU more work (its kernels, on the
compute stream or on a side stream beside backward's), or it makes the GPU wait for the host (a
host that synchronises, or that launches more slowly than the GPU runs). The step times of
``step_overhead.py`` do not tell the two apart; a trace of the step does. For each step, timed
from its start to the ``torch.cuda.synchronize`` that ends it, this module reports

- ``busy``: the time some kernel, copy or fill runs on the device (the union over streams);
- ``idle``: the rest of the step, when the device has nothing to run: waiting for launches;
- ``side``: the device time of the streams other than the busiest one (the compute stream), and
  how much of it runs while the compute stream is idle (``side alone``: overlap that failed);
- the CUDA runtime and driver calls: kernel launches (Triton's and cuBLAS' through the driver API
  too), copies and fills, and the calls that make the host wait (``*Synchronize``, blocking
  ``cudaMemcpy``) besides the one that ends the step.

``exposed ≈ Δbusy + Δidle`` against plain training: a configuration whose exposed time is mostly
``Δidle`` is host-bound, one whose time is ``Δbusy`` does too much device work.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

#: kineto's activity types of work on the device
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
#: kineto's activity types of host calls into the CUDA runtime and driver
HOST_CALLS = ("cuda_runtime", "cuda_driver")


class Event(NamedTuple):
    """One profiled activity: ``kind`` (kineto's activity type), ``name``, ``stream`` (device
    work) and its span in ns."""

    kind: str
    name: str
    stream: str
    start: int
    end: int


@dataclass
class StepProfile:
    """One step's profile (ms and counts; see the module's docstring)."""

    step_ms: float
    busy_ms: float
    idle_ms: float
    side_ms: float
    side_alone_ms: float
    launches: int
    copies: int
    syncs: int
    top_side: list[tuple[str, float]]


def union_ns(spans: Iterable[tuple[int, int]]) -> int:
    """The length of the union of the ``(start, end)`` spans."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def clip(spans: Iterable[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of ``spans`` inside ``[start, end]``."""
    return [(max(s, start), min(e, end)) for s, e in spans if e > start and s < end]


def host_call(name: str) -> str | None:
    """What a runtime or driver call is: ``"sync"`` when it makes the host wait for the device,
    ``"launch"``, ``"copy"`` (copies and fills), or None."""
    if "Synchronize" in name or name == "cudaMemcpy":
        return "sync"
    if "Launch" in name:
        return "launch"
    if "Memcpy" in name or "Memset" in name:
        return "copy"
    return None


def summarize(events: list[Event], start: int, end: int, closing_syncs: int = 0) -> StepProfile:
    """The profile of the step that ran from ``start`` to ``end`` (ns) among ``events``; the host
    synchronisations counted leave out ``closing_syncs``, those that end the step."""
    per_stream: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    names: dict[str, list[tuple[str, int, int]]] = collections.defaultdict(list)
    calls: collections.Counter = collections.Counter()
    for event in events:
        if event.kind in DEVICE_WORK:
            for span in clip([(event.start, event.end)], start, end):
                per_stream[event.stream].append(span)
                names[event.stream].append((event.name, *span))
        elif event.kind in HOST_CALLS and start <= event.start < end:
            calls[host_call(event.name)] += 1
    busy_by_stream = {stream: union_ns(spans) for stream, spans in per_stream.items()}
    compute = max(busy_by_stream, key=busy_by_stream.get, default=None)
    side = [span for stream, spans in per_stream.items() if stream != compute for span in spans]
    busy = union_ns(span for spans in per_stream.values() for span in spans)
    side_busy = union_ns(side)
    # the side streams' time while the compute stream runs nothing: all of it minus the overlap
    with_compute = union_ns(side + per_stream.get(compute, [])) - busy_by_stream.get(compute, 0)
    kernel_time: collections.Counter = collections.Counter()
    for stream, spans in names.items():
        if stream != compute:
            for name, s, e in spans:
                kernel_time[name] += e - s
    return StepProfile(
        step_ms=(end - start) / 1e6,
        busy_ms=busy / 1e6,
        idle_ms=(end - start - busy) / 1e6,
        side_ms=side_busy / 1e6,
        side_alone_ms=with_compute / 1e6,
        launches=calls["launch"],
        copies=calls["copy"],
        syncs=calls["sync"] - closing_syncs,
        top_side=[(name, ns / 1e6) for name, ns in kernel_time.most_common(3)],
    )


def events_of(profiler) -> list[Event]:
    """The activities a finished ``torch.profiler.profile`` recorded, read from its Chrome trace,
    whose categories are kineto's activity types in every torch this project supports (the
    profiler's Python events name their activity types only in newer ones)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        start, end = round(1000 * float(e["ts"])), round(1000 * (float(e["ts"]) + float(e.get("dur", 0))))
        stream = e.get("args", {}).get("stream", e.get("tid", ""))
        events.append(Event(e.get("cat", ""), e.get("name", ""), str(stream), start, end))
    return events


STEP_MARK = "step_profile: step"


def profile_steps(
    runs: dict[str, Callable[[], None]], steps: int = 2, cuda: bool = True
) -> dict[str, list[StepProfile]]:
    """Profile ``steps`` steps of each of ``runs`` (name -> one training step) in one profiler
    trace, a mark spanning each step; on CUDA the device is synchronised around each step
    (``cuda=False``: the host's activities alone)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    synchronize()
    with profile(activities=activities) as profiler:
        for run in runs.values():
            for _ in range(steps):
                synchronize()
                with record_function(STEP_MARK):
                    run()
                    synchronize()
    events = events_of(profiler)
    marks = sorted((e.start, e.end) for e in events if e.kind == "user_annotation" and e.name == STEP_MARK)
    if len(marks) != steps * len(runs):
        raise RuntimeError(f"the profiler recorded {len(marks)} step marks, not {steps * len(runs)}")
    per_step = by_step(events, marks)
    profiles = [summarize(group, start, end, closing_syncs=int(cuda)) for group, (start, end) in zip(per_step, marks)]
    return {name: profiles[i * steps : (i + 1) * steps] for i, name in enumerate(runs)}


def by_step(events: list[Event], marks: list[tuple[int, int]]) -> list[list[Event]]:
    """The device work and host calls that start inside each of the disjoint, sorted ``marks``
    (the device is idle between steps, so no work of a step starts before its mark); the host's
    other activities, most of a trace, are left out."""
    starts = [start for start, _ in marks]
    groups: list[list[Event]] = [[] for _ in marks]
    for event in events:
        if event.kind not in DEVICE_WORK and event.kind not in HOST_CALLS:
            continue
        i = bisect.bisect_right(starts, event.start) - 1
        if i >= 0 and event.start < marks[i][1]:
            groups[i].append(event)
    return groups


def median_profile(profiles: list[StepProfile]) -> StepProfile:
    """Each figure's median over ``profiles``; the side kernels of the first."""
    fields = ("step_ms", "busy_ms", "idle_ms", "side_ms", "side_alone_ms", "launches", "copies", "syncs")
    values = {field: statistics.median(getattr(p, field) for p in profiles) for field in fields}
    return StepProfile(**values, top_side=profiles[0].top_side)


def table(profiles: dict[str, list[StepProfile]], host_ms: dict[str, float]) -> str:
    """A markdown table: per configuration the medians of its steps, and ``host_ms`` (the
    synchroniser's own host time per step, where known)."""
    lines = [
        "| configuration | step (ms) | busy | idle | side | side alone | sync host | launches | copies | host syncs |"
        " side's top kernels (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, steps in profiles.items():
        p = median_profile(steps)
        host = f"{host_ms[name]:.2f}" if name in host_ms else "-"
        top = "; ".join(f"{kernel[:48]} {ms:.2f}" for kernel, ms in p.top_side) or "-"
        lines.append(
            f"| {name} | {p.step_ms:.2f} | {p.busy_ms:.2f} | {p.idle_ms:.2f} | {p.side_ms:.2f} | "
            f"{p.side_alone_ms:.2f} | {host} | {p.launches:.0f} | {p.copies:.0f} | {p.syncs:.0f} | {top} |"
        )
    return "\n".join(lines)
