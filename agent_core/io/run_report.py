"""The end of a training run, for people: learning curves as PNG files and the iteration table as markdown.

The curves are drawn from the same `IterationSummary` rows that are logged to MLflow as metrics, so
a PNG and the MLflow chart of one metric show the same points; an iteration without a value (dev EM
when it was not evaluated, KL before a reference exists) is left out rather than drawn as zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent_core.io.plots import plot_curves
from agent_core.io.summaries import IterationSummary


@dataclass(frozen=True)
class Curve:
    """One PNG: the file stem, its title and y label, and the summary fields drawn as lines (field -> label)."""

    stem: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]


RUN_CURVES = (
    Curve("reward", "Mean episode reward (the combined reward trained on)", "reward", (("mean_reward", "train"),)),
    Curve("em", "Exact match", "EM", (("em", "train rollouts (sampled)"), ("dev_em", "dev (greedy, held out)"))),
    Curve("tool_calls", "Tool calls per episode", "calls", (("tool_calls_per_episode", "train"),)),
    Curve("turns", "Turns (steps) per episode", "steps", (("steps_per_episode", "train"),)),
    Curve("kl", "KL to the reference policy", "KL", (("kl", "train"),)),
    Curve("entropy", "Policy entropy on action tokens", "nats", (("entropy", "train"),)),
)


def plot_run_curves(summaries: Sequence[IterationSummary], out_dir: Path, start_dev_em: float = math.nan) -> list[Path]:
    """One PNG per curve of RUN_CURVES in `out_dir`; `start_dev_em` (the policy RL started from) is
    drawn at iteration -1 of the dev EM line. Returns the files written."""
    written = []
    for curve in RUN_CURVES:
        lines = {}
        for field, label in curve.series:
            points = [(s.iteration, float(getattr(s, field))) for s in summaries]
            if field == "dev_em" and math.isfinite(start_dev_em):
                points = [(-1, start_dev_em), *points]
            lines[label] = [(x, y) for x, y in points if math.isfinite(y)]
        written.append(plot_curves(lines, title=curve.title, ylabel=curve.ylabel, path=Path(out_dir) / f"{curve.stem}.png"))
    return written


_TABLE_COLUMNS = (("mean reward", "mean_reward"), ("train EM", "em"), ("dev EM", "dev_em"),
                  ("failed episodes", "failed_episodes"),
                  ("tool calls/episode", "tool_calls_per_episode"), ("steps/episode", "steps_per_episode"),
                  ("loss", "loss"), ("KL", "kl"), ("entropy", "entropy"))


def run_table_markdown(run_id: str, summaries: Sequence[IterationSummary], start_dev_em: float = math.nan,
                       model: str | None = None) -> str:
    """The end-of-run table as markdown: one row per iteration, `-` where a value does not apply."""
    header = "| iteration | " + " | ".join(name for name, _ in _TABLE_COLUMNS) + " |"
    lines = [f"# agentr1 run `{run_id}`", ""]
    if model:
        lines += [f"Registered model: {model}", ""]
    lines += [header, "|" + "---:|" * (len(_TABLE_COLUMNS) + 1)]
    start = ["start"] + ["-"] * len(_TABLE_COLUMNS)
    start[1 + [field for _, field in _TABLE_COLUMNS].index("dev_em")] = _cell(start_dev_em)
    lines.append("| " + " | ".join(start) + " |")
    for s in summaries:
        lines.append("| " + " | ".join([str(s.iteration), *(_cell(getattr(s, f)) for _, f in _TABLE_COLUMNS)]) + " |")
    lines += ["", "train EM: the iteration's sampled rollouts; dev EM: greedy decoding on held-out dev prompts "
                  "after the iteration; start: the policy RL started from."]
    return "\n".join(lines) + "\n"


def _cell(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return "-" if not math.isfinite(value) else f"{value:.3f}"
