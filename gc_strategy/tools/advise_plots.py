"""Plots of the advisor's answers (``python -m gc_strategy.tools.advise --plot FILE``): the predicted step
of each configuration against the bf16 allreduce, or a projection's speedups as the cluster grows.
Needs matplotlib (``pip install "gc-strategy[app]"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASELINE_COLOUR, CONFIG_COLOUR = "#888888", "#2a7ab9"


def check_can_plot(path: str) -> None:
    """Refuse, before any measurement, a plot that could not be written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--plot {path}: needs matplotlib; install it with pip install 'gc-strategy[app]'") from None
    if not Path(path).resolve().parent.is_dir():
        raise ValueError(f"--plot = {path!r} is invalid; allowed: a file in a folder that exists")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_predictions(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Horizontal bars of each row's predicted step (the bf16 allreduce first, in grey), labelled with
    its speedup over the bf16 allreduce."""
    plt = _pyplot()
    names = [row["configuration"].replace(",", ",\n") for row in rows]
    seconds = [row["predicted step (s)"] for row in rows]
    figure, axis = plt.subplots(figsize=(8, 1.0 + 0.55 * len(rows)))
    colours = [BASELINE_COLOUR] + [CONFIG_COLOUR] * (len(rows) - 1)
    bars = axis.barh(names[::-1], seconds[::-1], color=colours[::-1])
    speedups = [f"{row['speedup vs bf16 allreduce']:.2f}x" for row in rows]
    axis.bar_label(bars, labels=speedups[::-1], padding=3, fontsize=7)
    axis.axvline(seconds[0], color="black", linewidth=0.8)
    axis.set_xlabel("predicted step (s); labels: speedup over the bf16 allreduce")
    axis.set_title(title, fontsize=8, wrap=True)
    axis.tick_params(axis="y", labelsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_projection(title: str, speedups: dict[tuple[str, int], dict[str, float]], path: str) -> None:
    """One panel per inter-node rate: each configuration's speedup over the flat bf16 allreduce
    (``speedups[rate, gpus][configuration]``) against the number of GPUs (log scale)."""
    plt = _pyplot()
    rates = list(dict.fromkeys(rate for rate, _ in speedups))
    figure, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.5), sharey=True, squeeze=False)
    for axis, rate in zip(axes[0], rates):
        gpus = [count for r, count in speedups if r == rate]
        for spec in speedups[rate, gpus[0]]:
            line = [speedups[rate, count][spec] for count in gpus]
            axis.plot(gpus, line, marker="o", linestyle="--" if "hierarchy=node" in spec else "-", label=spec)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xticks(gpus, [str(count) for count in gpus])
        axis.set_xlabel("GPUs")
        axis.set_title(f"{rate} between nodes", fontsize=9)
    axes[0][0].set_ylabel("speedup over a flat bf16 allreduce (model)")
    axes[0][-1].legend(fontsize=6, loc="best")
    figure.suptitle(title, fontsize=8, wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
