"""The evaluation flow: methods x seeds over one dataset split -> `eval` tables -> the paper table.

Writes `<data_root>/evals/<eval_id>/<method>/seed=<s>/eval.parquet` per method and seed, the
markdown report to `<data_root>/evals/<eval_id>/report.md`, logs the cells as MLflow metrics (a
run in experiment "agentr1-eval", same store as training) and publishes the report as a Prefect
markdown artifact. `run_checkpoints` and `run_eval_settings` derive the inputs from a training
run (what `agentr1 eval --run-id` does): its checkpoints, and its envs, scorer and loop settings
(context mode, observation cut, budgets: agent_core/rollout/spec.py), so any env a run trains in
evaluates as it trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefect import flow

from agent_core.config import DataConfig
from agent_core.eval.methods import EVAL_METHODS, EvalSettings
from agent_core.io.layout import DataRoot, RunLayout, check_id, new_run_id
from agent_core.io.model_registry import is_model_uri, registered_checkpoint
from agent_core.io.retention import reading_checkpoints
from agent_core.rollout.engines import shutdown_engines
from flows.environment import quiet_progress_bars
from tasks.evaluate import evaluate, log_eval, publish_eval_report, settings_params, write_eval_report
from tasks.prepare_data import DatasetUris, prepare_dataset


@dataclass(frozen=True)
class EvalResult:
    eval_id: str
    report_path: str
    markdown: str
    table_uris: list[str]
    tracking_uri: str
    mlflow_run_id: str
    artifact_key: str


def run_checkpoints(run: RunLayout, methods: Sequence[str], checkpoint: str | None = None,
                    tracking_uri: str | None = None) -> dict[str, str]:
    """Which policy each method runs with: naive_rag and base_tool_call the policy RL started from
    (the warm-started one if the run has it, else the initial policy); agent `checkpoint` (a
    directory, or a registered version: models:/<name>/<version> or models:/<name>@<alias>, looked
    up in `tracking_uri`, default the data root's store, and downloaded under the data root), or the
    run's last checkpoint."""
    chosen = {}
    for method in methods:
        EVAL_METHODS.check(method)
        if method == "agent":
            if is_model_uri(checkpoint):
                root = DataRoot(run.data_root)
                last = registered_checkpoint(checkpoint, tracking_uri or root.mlflow_tracking_uri, root.path)
            else:
                last = Path(checkpoint) if checkpoint else run.last_checkpoint_dir()
            if last is None:
                raise FileNotFoundError(f"run {run.run_id!r} has no checkpoint yet under {run.run_dir}; pass --checkpoint")
            chosen[method] = str(last)
        else:
            chosen[method] = str(run.start_policy_dir)
    return chosen


def _check_inputs(methods: Sequence[str], checkpoints: Mapping[str, str], seeds: Sequence[int],
                  data: DataConfig | None, dataset: DatasetUris | None, method_of: Mapping[str, str]) -> None:
    """Fail before any model runs: unknown methods, missing checkpoints, no seeds, no dataset."""
    if not methods:
        raise ValueError(f"no eval methods given; valid methods: {', '.join(EVAL_METHODS.names())}")
    for method in methods:
        EVAL_METHODS.check(method_of.get(method, method))
        check_id("eval method label", method)
        if method not in checkpoints:
            raise ValueError(f"eval method {method!r} has no checkpoint; checkpoints given for: {', '.join(checkpoints) or '(none)'}")
        if not Path(checkpoints[method]).is_dir():
            raise FileNotFoundError(f"checkpoint of eval method {method!r} not found: {checkpoints[method]}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be a non-empty list of distinct seeds, got {list(seeds)}")
    if (data is None) == (dataset is None):
        raise ValueError("give exactly one of data (a dataset config) and dataset (prepared dataset uris)")


@flow(name="agentr1-eval", log_prints=True)
def evaluate_methods(
    data_root: str,
    checkpoints: dict[str, str],
    methods: list[str] | None = None,
    data: DataConfig | None = None,
    dataset: DatasetUris | None = None,
    split: str = "test",
    seeds: list[int] | None = None,
    settings: EvalSettings = EvalSettings(),
    limit: int | None = None,
    eval_id: str | None = None,
    tracking_uri: str | None = None,
    method_of: dict[str, str] | None = None,
) -> EvalResult:
    """Evaluate `methods` (default: every method in `checkpoints`) with `seeds` (default 0, 1, 2).

    A method is a name in EVAL_METHODS, or a label that `method_of` maps to one (e.g. several
    trained checkpoints as {"grpo": "agent", "ppo": "agent"}); the eval table's `method` column
    holds the label.
    """
    quiet_progress_bars()  # a worker's flow run never went through configure_environment
    # a training run's retention leaves the checkpoints read here until the evaluation ends
    held = sorted({path for path in checkpoints.values() if Path(path).is_dir()})
    try:
        with reading_checkpoints(held):
            return _evaluate_methods(data_root, checkpoints, methods, data, dataset, split, seeds, settings, limit,
                                     eval_id, tracking_uri, method_of)
    finally:
        shutdown_engines()  # vLLM servers stay warm across methods and seeds, not after the evaluation


def _evaluate_methods(data_root, checkpoints, methods, data, dataset, split, seeds, settings, limit, eval_id,
                      tracking_uri, method_of) -> EvalResult:
    methods = list(methods or checkpoints)
    seeds = list(range(3)) if seeds is None else list(seeds)
    method_of = dict(method_of or {})
    _check_inputs(methods, checkpoints, seeds, data, dataset, method_of)
    eval_id = check_id("eval id", eval_id) if eval_id else new_run_id("eval")
    if dataset is None:
        dataset = prepare_dataset(data_root, data)
    uris = [
        evaluate(data_root, eval_id, method, checkpoints[method], dataset, split,
                 dataclasses.replace(settings, seed=seed), limit, method_of.get(method))
        for method in methods
        for seed in seeds
    ]
    report = write_eval_report(data_root, eval_id, uris)
    params = {"methods": ",".join(methods), "seeds": ",".join(map(str, seeds)), "split": split, "limit": limit,
              "dataset_id": dataset.dataset_id, **{f"checkpoint.{m}": checkpoints[m] for m in methods},
              **settings_params(settings)}
    mlflow_run_id = log_eval(data_root, eval_id, report, params, tracking_uri)
    key = publish_eval_report(eval_id, report)
    root = DataRoot(Path(data_root))
    return EvalResult(
        eval_id=eval_id, report_path=str(root.eval_report_path(eval_id)), markdown=report.markdown(),
        table_uris=uris, tracking_uri=tracking_uri or root.mlflow_tracking_uri, mlflow_run_id=mlflow_run_id,
        artifact_key=key,
    )
