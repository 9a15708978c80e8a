"""The experiment's report stage: plots (PNG), the results page (markdown) and an MLflow run with
both, from the evaluation's tables and each arm's training curves."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa

from agent_core.eval.experiment import (
    BASELINE_TITLES,
    ArmCurve,
    ExperimentConfig,
    MethodEm,
    results_markdown,
    target_checks,
)
from agent_core.eval.report import AVERAGE, eval_report
from agent_core.io.atomic import write_text_atomic
from agent_core.io.layout import DataRoot
from agent_core.io.plots import plot_bars, plot_curves
from agent_core.io.portable_paths import portable
from agent_core.io.tables import read_table
from agent_core.io.tracking import Tracker
from tasks._common import stage_logger, stage_task

EXPERIMENT_EXPERIMENT = "agentr1-experiment"


def _titled(markdown: str, titles: dict[str, str]) -> str:
    """The eval report's rows named by title instead of label."""
    for label, title in titles.items():
        markdown = re.sub(rf"^\| {re.escape(label)} \|", f"| {title} |", markdown, flags=re.MULTILINE)
    return markdown


def _notes(path: str | None) -> str:
    if path is None:
        return ""
    if not Path(path).is_file():
        raise FileNotFoundError(f"experiment notes_path not found: {path} (relative to the experiment file)")
    return Path(path).read_text()


@stage_task(name="experiment_report")
def experiment_report(exp: ExperimentConfig, data_root: str, experiment_id: str, eval_uris: list[str],
                      curves: dict[str, ArmCurve], command: str, wall_seconds: float, setup: list[str],
                      notes_path: str | None = None) -> str:
    """Write the plots and the results page (exp.report_path, exp.plots_dir; `notes_path`'s markdown
    appended), log both and the final scores to MLflow; return the page's path."""
    log = stage_logger("experiment_report")
    report = eval_report(pa.concat_tables([read_table("eval", uri) for uri in eval_uris]))
    titles = {**BASELINE_TITLES, **{arm.name: arm.title for arm in exp.arms}}
    em = {m: MethodEm(report.cell(m, AVERAGE).em.mean, report.cell(m, AVERAGE).em.std) for m in report.methods}

    page = Path(exp.report_path)
    plots_dir = Path(exp.plots_dir)
    paths = {
        "Held-out dev EM per iteration": plot_curves(
            {titles[n]: c.dev_em for n, c in curves.items()}, title="Dev EM (greedy) while training",
            ylabel="dev EM", path=plots_dir / "dev_em.png", xlabel="RL iterations done (0: the warm-started policy)"),
        "Mean episode reward per iteration": plot_curves(
            {titles[n]: c.reward for n, c in curves.items()}, title="Mean episode reward of the rollouts",
            ylabel="reward", path=plots_dir / "reward.png", xlabel="iteration"),
        f"{exp.eval_split.capitalize()} EM per method": plot_bars(
            {titles[m]: (em[m].mean, em[m].std) for m in report.methods},
            title=f"{exp.eval_split} EM, mean ± std over {exp.eval_seeds} seeds", ylabel="EM",
            path=plots_dir / "final_em.png"),
    }
    relative = {title: _relative(path, page.parent) for title, path in paths.items()}
    checks = target_checks(exp, em)
    # The page gets committed: no machine paths (the command's --data-root, a plot outside the page's folder)
    text = portable(results_markdown(exp, command=command, wall_seconds=wall_seconds,
                                     eval_table=_titled(report.markdown(), titles), checks=checks, curves=curves,
                                     plots=relative, setup=setup, notes=_notes(notes_path)),
                    {"data root": data_root})
    write_text_atomic(page, text)

    root = DataRoot(Path(data_root))
    tracker = Tracker(root.mlflow_tracking_uri, root.mlflow_artifacts.resolve().as_uri(), EXPERIMENT_EXPERIMENT)
    mlflow_run_id = tracker.start_run(experiment_id, {"experiment": exp.name, "command": command})
    tracker.log_metrics(mlflow_run_id, {**{f"em/{m}": s.mean for m, s in em.items()},
                                        "wall_seconds": wall_seconds,
                                        "targets_met": float(sum(c.met for c in checks))}, step=0)
    tracker.log_text(mlflow_run_id, text, "results.md")
    tracker.log_artifacts(mlflow_run_id, plots_dir, "plots")
    tracker.end_run(mlflow_run_id)
    for check in checks:
        log.info("target %s: %s (%s)", "met" if check.met else "NOT met", check.target, check.detail)
    log.info("results page %s, plots in %s, MLflow run %s", page, plots_dir, mlflow_run_id)
    return str(page)


def _relative(path: Path, start: Path) -> str:
    """The link from the page's folder `start` to `path`: relative, `../` where it lies outside."""
    return os.path.relpath(Path(path).resolve(), start.resolve())
