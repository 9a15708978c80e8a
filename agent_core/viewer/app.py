"""The trace viewer's pages (docs/guides/view-your-runs.md): runs, a run, an iteration's episodes, an
episode. A Flask app over agent_core/io/trace_view.py, read-only; charts by plotly.js, served from the
`plotly` package's own file (no network at run time). Each page reads only what it shows, so a
damaged table breaks the pages that show it and no other."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

from flask import Flask, abort, redirect, render_template, request, send_file

from agent_core.io.checkpoints import load_tokenizer
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.summaries import IterationSummary
from agent_core.io.ui_links import ExternalUIs
from agent_core.io.row_filter import FILTER_TIMEOUT_S
from agent_core.io.trace_view import (EPISODE_COLUMNS, ViewError, episode_sql, episode_steps, iteration_episodes,
                                      prompt_episodes, run_iterations, run_table_rows, runs_overview, RunOverview)

CURVES = ("mean_reward", "em", "dev_em", "steps_per_episode", "kl", "entropy", "clipfrac")


def create_app(data_root: Path, uis: ExternalUIs | None = None, filter_timeout: float = FILTER_TIMEOUT_S) -> Flask:
    """The viewer over `data_root` (nothing is read until a page is asked for); `uis`: MLflow's and
    Prefect's UIs, linked from the runs page while they answer; `filter_timeout`: seconds an episode
    filter may run (agent_core/io/row_filter.py)."""
    app = Flask(__name__)
    root = DataRoot(Path(data_root))
    tokenizers = _Tokenizers()
    uis = uis or ExternalUIs()

    @app.get("/")
    def runs() -> str:
        overview, problems = runs_overview(root)
        return render_template("runs.html", runs=overview, problems=problems, data_root=str(root.path),
                               fmt=_fmt, money=_money, uis=uis.reachable())

    @app.get("/to/<ui>/<run_id>")
    def external(ui: str, run_id: str):
        lookups = {"mlflow": uis.mlflow_run_url, "prefect": uis.prefect_flow_run_url}
        if ui not in lookups:
            abort(404)
        _run(root, run_id)
        url = lookups[ui](run_id)
        if url is None:
            return _error(f"run {run_id} was not found in {ui}'s UI at "
                          f"{uis.mlflow_url if ui == 'mlflow' else uis.prefect_url} (is it served from this data "
                          "root? README, \"Look at what the agent did\")", 404, back="/")
        return redirect(url)

    @app.get("/run/<run_id>")
    def run(run_id: str):
        layout = _run(root, run_id)
        try:
            iterations = run_iterations(layout)
        except ViewError as error:
            return _error(str(error), 500)
        health, health_error = _rows_or_error(layout, "health", "iteration, check_name")
        ledger, ledger_error = _rows_or_error(layout, "ledger", "iteration, stage")
        return render_template("run.html", run_id=run_id, iterations=iterations, curves=_curves(iterations),
                               health=health, health_error=health_error, ledger=ledger, ledger_error=ledger_error,
                               fmt=_fmt)

    @app.get("/run/<run_id>/iteration/<int:iteration>")
    def iteration(run_id: str, iteration: int):
        layout = _run(root, run_id)
        where = request.args.get("where", "")
        order_by = request.args.get("sort", "episode_id")
        descending = request.args.get("desc", "") == "1"
        try:
            episodes = iteration_episodes(layout, iteration, where, order_by, descending, filter_timeout)
        except ViewError as error:
            return _error(str(error), 400, back=f"/run/{run_id}/iteration/{iteration}", where=where)
        return render_template("iteration.html", run_id=run_id, iteration=iteration, episodes=episodes,
                               columns=EPISODE_COLUMNS, where=where, sort=order_by, desc=descending, fmt=_fmt)

    @app.get("/run/<run_id>/iteration/<int:iteration>/episode/<episode_id>")
    def episode(run_id: str, iteration: int, episode_id: str):
        layout = _run(root, run_id)
        try:
            steps = episode_steps(layout, iteration, episode_id, tokenizers.of(layout))
        except ViewError as error:
            return _error(str(error), 404)
        scale = max([abs(t.advantage) for s in steps for t in s.action if t.trained] + [1e-9])
        return render_template("episode.html", run_id=run_id, iteration=iteration, episode_id=episode_id,
                               steps=steps, scale=scale, sql=episode_sql(run_id, iteration, episode_id),
                               shade=_shade, fmt=_fmt)

    @app.get("/compare")
    def compare():
        """One prompt's episodes in two iterations or two runs: ?prompt_id=P&a=RUN/K&b=RUN/K."""
        prompt_id = request.args.get("prompt_id", "")
        sides = []
        for key in ("a", "b"):
            run_id, _, k = request.args.get(key, "").rpartition("/")
            if not (prompt_id and run_id and k.isdigit()):
                return _error("compare needs ?prompt_id=P&a=RUN/ITERATION&b=RUN/ITERATION", 400)
            try:
                sides.append((run_id, int(k), prompt_episodes(_run(root, run_id), int(k), prompt_id)))
            except ViewError as error:
                return _error(str(error), 400)
        return render_template("compare.html", prompt_id=prompt_id, sides=sides, fmt=_fmt)

    @app.get("/static/plotly.min.js")
    def plotly_js():
        import plotly

        return send_file(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", max_age=86400)

    return app


class _Tokenizers:
    """One tokenizer per run (its initial policy's), loaded on first use."""

    def __init__(self):
        self._lock, self._cache = threading.Lock(), {}

    def of(self, run: RunLayout):
        with self._lock:
            if run.run_id not in self._cache:
                self._cache[run.run_id] = load_tokenizer(run.start_policy_dir)  # the initial one may be pruned
            return self._cache[run.run_id]


def _run(root: DataRoot, run_id: str) -> RunLayout:
    try:
        layout = root.run(run_id)
    except ValueError:
        abort(404)
    if not layout.run_dir.is_dir():
        abort(404)
    return layout


def _rows_or_error(run: RunLayout, table: str, order: str) -> tuple[list[dict[str, Any]], str | None]:
    try:
        return run_table_rows(run, table, order), None
    except ViewError as error:
        return [], str(error)


def _error(message: str, status: int, back: str | None = None, where: str = ""):
    return render_template("error.html", message=message, back=back, where=where), status


def _curves(iterations: list[IterationSummary]) -> str:
    """The run page's curves as plotly traces (JSON): one per metric, nan as a gap."""
    xs = [s.iteration for s in iterations]
    traces = [{"x": xs, "y": [None if math.isnan(v) else v for v in (getattr(s, name) for s in iterations)],
               "name": name, "mode": "lines+markers"} for name in CURVES]
    return json.dumps(traces)


def _shade(value: float | None, scale: float) -> str:
    """A token's background: green for a positive advantage, red for a negative one, by size."""
    if value is None:
        return "transparent"
    alpha = min(1.0, abs(value) / scale) * 0.6 + 0.1
    return f"rgba(0,160,0,{alpha:.2f})" if value >= 0 else f"rgba(220,0,0,{alpha:.2f})"


def _money(run: RunOverview) -> str:
    """The run's cost where the ledger has a price, else its stages' wall time."""
    if run.cost is not None:
        return f"{run.cost:.2f} {run.currency}".strip()
    if run.wall_seconds is not None:
        return f"{run.wall_seconds / 60:.1f} min"
    return "?"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.3f}"
    return str(value)
