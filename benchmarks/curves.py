"""What the time-to-target benchmarks share (``time_to_accuracy.py``, ``time_to_perplexity.py``): one
configuration run on the emulated nodes, and the report: the table, every run, and a plot of each
configuration's measurements against training time in its first round."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import run_ranks

Runs = dict[str, list[dict[str, Any]]]


def run_configuration(
    arguments: list[str], out: Path, tag: str, links: list, per_node: int, port: int, timeout_s: float
) -> tuple[list[dict[str, Any]], str | None]:
    """Run ``python *arguments RESULT.json`` on every rank of ``links`` (``per_node`` a node, one
    thread each), each writing its ``RESULT.json`` under ``out/runs`` and its output under
    ``out/logs`` (named by ``tag``): every rank's result, or why the run failed."""
    world_size = len(links) * per_node
    results = [out / "runs" / f"{tag}-rank{r}.json" for r in range(world_size)]
    logs = [out / "logs" / f"{tag}-rank{r}.log" for r in range(world_size)]
    why = run_ranks([[*arguments, str(path)] for path in results], links, per_node, port, 1, logs, timeout_s)
    return ([] if why else [json.loads(path.read_text()) for path in results]), why


def plot_curves(runs: Runs, path: Path, metric: str, label: str, title: str, decorate: Callable[[Any], None]) -> None:
    """Each configuration's first round, ``metric`` against training seconds (a dashed line for a
    control, named with ``(control)``); ``decorate(axis)`` adds the target and the limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for name, results in runs.items():
        if "failed" in results[0]:
            continue
        points = results[0]["points"]
        style = "--" if name.endswith("(control)") else "-"
        axis.plot([p["train_s"] for p in points], [p[metric] for p in points], style, marker=".", label=name)
    decorate(axis)
    axis.set_xlabel("training wall time (s), evaluations excluded")
    axis.set_ylabel(label)
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(out: Path, runs: Runs, table: str, plot: Callable[[Path], None], figure: str) -> None:
    """``results.md`` (the table, also printed), ``runs.json`` and the plot ``figure`` in ``out``."""
    (out / "results.md").write_text(table + "\n")
    (out / "runs.json").write_text(json.dumps(runs))
    plot(out / figure)
    print(table)
    print(f"outputs: {out}")
