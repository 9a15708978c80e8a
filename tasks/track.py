"""Tracking stages: one MLflow run per training run; per-iteration metrics; registered checkpoints.

Not every checkpoint need become a model version (`tracking.register_every`): iteration k is
registered when k + 1 is a multiple of it, when it is the run's last, and when its dev EM reaches
the best dev EM among the model's versions. The last keeps `latest` the run's final policy; the
new best keeps `best` the same checkpoint that registering every iteration would point it at
(the highest dev EM, ties the later), since a checkpoint that is not registered cannot be aliased.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from agent_core.audit.report import health_section
from agent_core.config import PipelineConfig
from agent_core.io.atomic import write_text_atomic
from agent_core.io.episode_traces import log_episode_traces
from agent_core.io.layout import RUN_TABLES, DataRoot, RunLayout
from agent_core.io.manifests import StageRecord, read_manifest
from agent_core.io.summaries import IterationSummary, iteration_summary
from agent_core.io.run_report import plot_run_curves, run_table_markdown
from agent_core.io.tracking import Tracker
from tasks._common import completed_outputs, stage_logger, stage_task


@dataclass(frozen=True)
class TrackingRef:
    tracking_uri: str
    artifact_location: str
    experiment: str
    mlflow_run_id: str
    model_name: str = ""  # the registered model of the run's checkpoints (tracking.registered_model_name())
    algorithm: str = ""  # the advantage estimator, a tag of every registered version
    register_every: int = 1  # tracking.register_every
    iterations: int = 0  # the run's iterations, the last of which is always registered (0: unknown)
    traces: int = 0  # tracking.traces: episodes per iteration logged as MLflow traces


def _tracker(ref: TrackingRef) -> Tracker:
    return Tracker(ref.tracking_uri, ref.artifact_location, ref.experiment)


@stage_task(name="start_tracking")
def start_tracking(run: RunLayout, config: PipelineConfig) -> TrackingRef:
    root = DataRoot(Path(config.data_root))
    uri = config.tracking.tracking_uri or root.mlflow_tracking_uri
    artifacts = root.mlflow_artifacts.resolve().as_uri()
    tracker = Tracker(uri, artifacts, config.tracking.experiment)
    # A run resumed with a changed config keeps its MLflow run; the changes become `changed.*` tags.
    mlflow_run_id = tracker.start_run(run.run_id, config.flat(), tags={"data_root": str(Path(config.data_root).resolve())},
                                      on_change="tag")
    stage_logger("start_tracking").info("MLflow run %s in experiment %r (%s)", mlflow_run_id, config.tracking.experiment, uri)
    return TrackingRef(uri, artifacts, config.tracking.experiment, mlflow_run_id,
                       config.tracking.registered_model_name(), config.algorithm.estimator,
                       config.tracking.register_every, config.iterations, config.tracking.traces)


def _registration_due(ref: TrackingRef, iteration: int) -> bool:
    """Whether `iteration` is registered by schedule: every register_every-th and the last."""
    last = ref.iterations <= 0 or iteration >= ref.iterations - 1
    return last or (iteration + 1) % ref.register_every == 0


def _registers(ref: TrackingRef, tracker: Tracker, model_name: str, iteration: int, dev_em: float) -> bool:
    """By schedule, or because its dev EM reaches the model's best (`best` would point at it)."""
    if _registration_due(ref, iteration):
        return True
    if not math.isfinite(dev_em):
        return False
    best = tracker.best_dev_em(model_name)
    return best is None or dev_em >= best


@dataclass(frozen=True)
class IterationReport:
    summary: IterationSummary
    model_name: str
    model_version: int | None  # None: the iteration's checkpoint is not a registered version


@stage_task(name="log_iteration")
def log_iteration(run: RunLayout, iteration: int, ref: TrackingRef, checkpoint_dir: str,
                  model_name: str | None = None) -> IterationReport:
    """Log the iteration's metrics and, when due (module docstring), register its checkpoint as a
    version of `model_name` (default: the ref's), tagged with its dev EM and algorithm, once: a
    resumed run whose iteration was already logged from the same tables and checkpoint logs nothing
    again (and `register_checkpoint` never registers an iteration twice)."""
    model_name = model_name or ref.model_name
    if not model_name:
        raise ValueError("log_iteration needs a model name: pass model_name or a TrackingRef from start_tracking")
    summary = iteration_summary(run, iteration)
    tracker = _tracker(ref)
    record = StageRecord(run.manifest_path("log_iteration", iteration), "log_iteration",
                         inputs={"checkpoint": checkpoint_dir,
                                 **{name: run.table_uri(iteration, name) for name in RUN_TABLES}},
                         params={"mlflow_run_id": ref.mlflow_run_id, "model_name": model_name})
    logged = completed_outputs(record, True, f"iteration {iteration} tracking") is not None
    stage_metrics: dict[str, float] = {}
    if not logged:
        metrics = summary.metrics()
        rollout = read_manifest(run.manifest_path("rollout", iteration))
        if rollout is not None and rollout.metrics.get("seconds"):
            metrics["rollout_tokens_per_s"] = summary.generated_tokens / rollout.metrics["seconds"]
        if ref.traces:
            started = time.perf_counter()
            traced = log_episode_traces(tracker, ref.mlflow_run_id, run, iteration, ref.traces)
            metrics["traces_seconds"] = stage_metrics["traces_seconds"] = time.perf_counter() - started
            stage_logger("log_iteration").info("iteration %d: %d episodes logged as MLflow traces in %.2fs",
                                               iteration, traced, metrics["traces_seconds"])
        tracker.log_metrics(ref.mlflow_run_id, metrics, step=iteration)
    if not Path(checkpoint_dir).exists():  # pruned by checkpoint retention, its version (if any) with it
        version = tracker.find_checkpoint(ref.mlflow_run_id, model_name, iteration)
    elif _registers(ref, tracker, model_name, iteration, summary.dev_em):
        version = tracker.register_checkpoint(ref.mlflow_run_id, Path(checkpoint_dir), model_name, iteration,
                                              dev_em=summary.dev_em, algorithm=ref.algorithm or None)
    else:  # registered before (a resumed run with another register_every), or None
        version = tracker.find_checkpoint(ref.mlflow_run_id, model_name, iteration)
    if not logged:
        record.commit({}, stage_metrics)
    stage_logger("log_iteration").info(
        "iteration %d: mean reward %.3f, EM %.3f, dev EM %.3f, %.2f steps/episode, loss %.4f -> %s",
        iteration, summary.mean_reward, summary.em, summary.dev_em, summary.steps_per_episode, summary.loss,
        f"{model_name} v{version.version}" if version
        else f"not registered (tracking.register_every={ref.register_every})",
    )
    return IterationReport(summary, model_name, version.version if version else None)


def run_artifact_key(run_id: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes only."""
    return "agentr1-run-" + re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")


@stage_task(name="report_run")
def report_run(run: RunLayout, ref: TrackingRef, summaries: list[IterationSummary], start_dev_em: float,
               model: str) -> str:
    """The end-of-run report: the learning curves as PNGs and the iteration table as markdown, written
    to the run's report folder, logged to the MLflow run (`report/`) and published as a Prefect
    markdown artifact (shown under the flow run in the UI); returns the artifact key. Rewritten whole
    on a rerun: it is cheap and derived only from the summaries."""
    markdown = run_table_markdown(run.run_id, summaries, start_dev_em, model=model) + health_section(run)
    plot_run_curves(summaries, run.report_dir / "curves", start_dev_em)
    write_text_atomic(run.report_dir / "report.md", markdown)
    _tracker(ref).log_artifacts(ref.mlflow_run_id, run.report_dir, "report")
    key = run_artifact_key(run.run_id)
    create_markdown_artifact(markdown=markdown, key=key, description=f"agentr1 run {run.run_id}")
    stage_logger("report_run").info("report: %s (curves/*.png, MLflow artifacts report/, Prefect artifact %s)",
                                    run.report_dir / "report.md", key)
    return key


@stage_task(name="finish_tracking")
def finish_tracking(ref: TrackingRef, config_text: str, metrics: dict[str, float] | None = None) -> None:
    """Log the run's config (and run-level `metrics`, e.g. the start policy's dev EM), end the run."""
    tracker = _tracker(ref)
    if metrics:
        tracker.log_metrics(ref.mlflow_run_id, metrics, step=0)
    tracker.log_text(ref.mlflow_run_id, config_text, "config.yaml")
    tracker.end_run(ref.mlflow_run_id)
