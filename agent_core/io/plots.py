"""PNG plots for reports: learning curves per algorithm and the final table as bars.

matplotlib with the Agg backend (no display); each function writes one PNG atomically (temporary
name, then rename) and returns its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from agent_core.io.atomic import atomic_file  # noqa: E402

# Curves of several arms often coincide (same start, same score): each gets its own marker, line
# style and a small horizontal offset, so no series hides another.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_LINESTYLES = ("-", "--", "-.", ":")


def _save(figure, path: Path) -> Path:
    try:
        with atomic_file(path, "wb") as sink:
            figure.savefig(sink, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(figure)
    return Path(path)


def plot_curves(curves: Mapping[str, Sequence[tuple[int, float]]], *, title: str, ylabel: str, path: Path,
                xlabel: str = "iteration") -> Path:
    """One line per name: (iteration, value) points, e.g. dev EM per iteration for each algorithm.

    Iterations are whole numbers, so the x axis has integer ticks only.
    """
    figure, axis = plt.subplots(figsize=(7, 4))
    drawn = [(name, points) for name, points in sorted(curves.items()) if points]
    for k, (name, points) in enumerate(drawn):
        xs, ys = zip(*sorted(points))
        shift = 0.15 * (k / (len(drawn) - 1) - 0.5) if len(drawn) > 1 else 0.0  # spread over 0.15 iterations
        axis.plot([x + shift for x in xs], ys, marker=_MARKERS[k % len(_MARKERS)],
                  linestyle=_LINESTYLES[k % len(_LINESTYLES)], markersize=5, alpha=0.85, label=name)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="best")
    return _save(figure, path)


def plot_bars(values: Mapping[str, tuple[float, float]], *, title: str, ylabel: str, path: Path) -> Path:
    """One bar per name with an error bar: name -> (mean, std), in the given order."""
    names = list(values)
    means = [values[n][0] for n in names]
    stds = [values[n][1] for n in names]
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(names)), 4))
    axis.bar(range(len(names)), means, yerr=stds, capsize=4, color="#4C72B0")
    axis.set_xticks(range(len(names)))
    axis.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(axis="y", alpha=0.3)
    for i, mean in enumerate(means):
        axis.text(i, mean, f"{mean:.3f}", ha="center", va="bottom", fontsize=7)
    return _save(figure, path)
