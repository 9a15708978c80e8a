"""Evaluation stages: one method x seed over a dataset split -> an `eval` table; then the report
(markdown file, MLflow metrics in experiment "agentr1-eval", a Prefect markdown artifact).

The agent methods roll out through the one rollout entry point (agent_core/drivers `roll_out`) in
the run's envs, with the run's loop settings and scorer (`run_eval_settings`), so whatever env a run
trains in (agent_program included) evaluates with no code of its own."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pyarrow as pa
from prefect.artifacts import create_markdown_artifact

from agent_core.config import DevEvalConfig, PipelineConfig
from agent_core.drivers import DataAccess
from agent_core.eval.methods import EVAL_METHODS, EvalSettings
from agent_core.eval.report import EvalReport, eval_report
from agent_core.io.atomic import write_text_atomic
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import read_table, rows_of, table_exists, write_table
from agent_core.io.tracking import Tracker
from tasks._common import (
    DatasetUris,
    completed_outputs,
    read_corpus,
    split_prompts,
    stage_logger,
    stage_progress,
    stage_task,
)

EVAL_EXPERIMENT = "agentr1-eval"


def _evaluate_into(uri: str, registered: str, checkpoint: str, prompts: list, dataset: DatasetUris,
                   settings: EvalSettings, data_root: str, **columns) -> float:
    """Run the registered method `registered` with the policy at `checkpoint`; write its episodes
    (plus the constant `columns`: eval_id, method label, split) as the eval table `uri`; return the mean EM.
    A program of env agent_program may search the dataset's corpus table and sees nothing else of `data_root`."""
    settings = dataclasses.replace(settings, access=DataAccess(dataset.corpus_uri, data_root))
    episodes = EVAL_METHODS.get(registered)(Path(checkpoint), prompts, read_corpus(dataset.corpus_uri), settings)
    write_table("eval", rows_of(episodes, checkpoint=str(checkpoint), seed=settings.seed, **columns), uri)
    return sum(e.em for e in episodes) / max(len(episodes), 1)


@stage_task(name="evaluate")
def evaluate(data_root: str, eval_id: str, method: str, checkpoint: str, dataset: DatasetUris, split: str,
             settings: EvalSettings, limit: int | None = None, runs_as: str | None = None) -> str:
    """Run `method` (or the registered method `runs_as`, `method` being its label) with the policy at
    `checkpoint` on the split; write and return its eval table. An existing table for this eval id,
    method and seed is kept (a resumed flow skips it)."""
    log = stage_logger("evaluate")
    uri = DataRoot(Path(data_root)).eval_table_uri(eval_id, method, settings.seed)
    if table_exists(uri):
        log.info("%s seed %d: already evaluated (%s)", method, settings.seed, uri)
        return uri
    prompts = split_prompts(dataset, split, limit)
    with stage_progress("evaluate", f"eval {method} seed {settings.seed}", "prompts"):
        em = _evaluate_into(uri, runs_as or method, checkpoint, prompts, dataset, settings, data_root,
                            eval_id=eval_id, method=method, split=split)
    log.info("%s seed %d: %d prompts, EM %.3f -> %s", method, settings.seed, len(prompts), em, uri)
    return uri


def run_eval_settings(config: PipelineConfig, greedy: bool, temperature: float | None = None) -> EvalSettings:
    """Envs, loop settings (context mode, observation cut, budgets: `EvalSettings.spec`), scorer,
    retrieval depth, tool format and engine as the run trains with them."""
    rollout = config.rollout
    return EvalSettings(
        greedy=greedy, temperature=rollout.temperature if temperature is None else temperature,
        max_new_tokens=rollout.max_new_tokens, max_steps=rollout.max_steps,
        max_context_tokens=rollout.max_context_tokens, top_k=config.data.top_k,
        tool_format=rollout.env_kwargs.get("tool_format", "tag"),
        instructions=rollout.instructions, engine=rollout.engine,
        max_batch_size=rollout.max_batch_size, vllm=rollout.vllm, device=config.device,
        rollout=rollout, scorer=config.reward.scorer,
    )


def _compared(settings: EvalSettings) -> dict:
    """The settings a dev eval's manifest compares: all but the device and the data access (placement
    changes no answer beyond float rounding, a moved data root no answer at all, and runs recorded
    before they existed still resume); of the run's rollout
    section, what changes an answer: the loop and sampling (`spec`) and the envs."""
    compared = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("device", "rollout", "access")}
    if settings.rollout is not None:
        cfg = settings.rollout_config()
        compared["rollout"] = {"spec": settings.spec(), "env": cfg.env, "env_kwargs": cfg.env_kwargs,
                               "instructions": cfg.instructions}
    return compared


@stage_task(name="dev_eval")
def dev_eval(run: RunLayout, iteration: int | None, policy_dir: str, dataset: DatasetUris, cfg: DevEvalConfig,
             settings: EvalSettings, resume: bool = True) -> str:
    """Held-out EM of the policy at `policy_dir` during training (DevEvalConfig): the `agent` method on
    the first `cfg.prompts` prompts of `cfg.split`; writes the eval table `run.dev_eval_uri(iteration)`."""
    uri = run.dev_eval_uri(iteration)
    record = StageRecord(run.manifest_path("dev_eval", iteration), "dev_eval",
                         inputs={"policy": policy_dir, "dataset_prompts": dataset.prompts_uri,
                                 "corpus": dataset.corpus_uri},
                         params={"dev_eval": cfg, "settings": _compared(settings)})
    which = "start" if iteration is None else f"iteration {iteration}"
    if (done := completed_outputs(record, resume, f"{which} dev eval")) is not None:
        return done["eval"]
    prompts = split_prompts(dataset, cfg.split, cfg.prompts)
    with stage_progress("dev_eval", f"dev eval {which}", "prompts"):
        em = _evaluate_into(uri, "agent", policy_dir, prompts, dataset, settings, str(run.data_root),
                            eval_id=f"{run.run_id}-dev-{'start' if iteration is None else iteration}", method="agent",
                            split=cfg.split)
    record.commit({"eval": uri})
    stage_logger("dev_eval").info("%s: %s EM %.3f over %d prompts (policy %s)", which, cfg.split, em, len(prompts),
                                  policy_dir)
    return uri


@stage_task(name="write_eval_report")
def write_eval_report(data_root: str, eval_id: str, table_uris: list[str]) -> EvalReport:
    """The report over the given eval tables, written as markdown to evals/<eval_id>/report.md."""
    table = pa.concat_tables([read_table("eval", uri) for uri in table_uris])
    report = eval_report(table)
    path = write_text_atomic(DataRoot(Path(data_root)).eval_report_path(eval_id), report.markdown())
    stage_logger("write_eval_report").info("eval %s: report at %s", eval_id, path)
    return report


@stage_task(name="log_eval")
def log_eval(data_root: str, eval_id: str, report: EvalReport, params: dict, tracking_uri: str | None = None) -> str:
    """One MLflow run per evaluation (tagged with the eval id): params, metrics, report.md."""
    root = DataRoot(Path(data_root))
    tracker = Tracker(tracking_uri or root.mlflow_tracking_uri, root.mlflow_artifacts.resolve().as_uri(), EVAL_EXPERIMENT)
    mlflow_run_id = tracker.start_run(eval_id, params, tags={"data_root": str(root.path.resolve())})
    tracker.log_metrics(mlflow_run_id, report.metrics(), step=0)
    tracker.log_text(mlflow_run_id, report.markdown(), "report.md")
    tracker.end_run(mlflow_run_id)
    return mlflow_run_id


def artifact_key(eval_id: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "eval-" + re.sub(r"[^a-z0-9-]+", "-", eval_id.lower()).strip("-")


@stage_task(name="publish_eval_report")
def publish_eval_report(eval_id: str, report: EvalReport) -> str:
    """The report as a Prefect markdown artifact (shown in the UI under the flow run); its key."""
    key = artifact_key(eval_id)
    create_markdown_artifact(markdown=report.markdown(), key=key, description=f"agentr1 eval {eval_id}")
    return key


def settings_params(settings: EvalSettings) -> dict:
    """The settings as flat MLflow params (the seed varies per table and is logged separately; the
    data access is set per table, from the dataset)."""
    flat = {}
    for key, value in dataclasses.asdict(settings).items():
        if key == "access":
            continue
        if hasattr(value, "model_dump"):  # a config section (rollout, vllm): settings.<key>.<field>
            value = value.model_dump(mode="json")
        if isinstance(value, dict):
            flat.update({f"settings.{key}.{k}": v for k, v in value.items()})
        elif key != "seed":
            flat[f"settings.{key}"] = value
    return flat
