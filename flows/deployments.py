"""The flows of the deployments in prefect.yaml: their parameters are what a user types, not
internal objects.

    prefect deployment run agentr1-train-from-config/train --param config=tiny --param overrides='["seed=3"]'
    prefect deployment run agentr1-evaluate-run/eval --param run_id=train-20260101-120000-ab12

`train_from_config` is `agentr1 train --config C --set K=V`, `evaluate_run` is `agentr1 eval --run-id R`;
`evaluate_training_run` is the one implementation of the latter, which the command calls too.
A flow run started by a worker never went through `configure_environment`: Prefect, MLflow and
Hugging Face take their settings from the worker's environment.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import flow

from agent_core.config_errors import deployment_overrides
from agent_core.io.layout import RunLayout, new_run_id
from agent_core.io.tombstones import pruned_message
from agent_core.validation import load_config
from flows.configs_lookup import recorded_config, resolve_config
from flows.environment import quiet_progress_bars
from flows.eval import EvalResult, evaluate_methods, run_checkpoints
from flows.train import TrainResult, train
from tasks.evaluate import run_eval_settings

EVAL_METHODS_DEFAULT = ("naive_rag", "base_tool_call", "agent")


@flow(name="agentr1-train-from-config", log_prints=True)
def train_from_config(
    config: str | list[str] = "tiny",
    overrides: list[str] = [],  # noqa: B006 - a parameter schema's default; never mutated
    data_root: str = "data",
    run_id: str | None = None,
) -> TrainResult:
    """Train with `config`, a YAML file (a relative path is read from the worker's working directory)
    or the name of a shipped config (`tiny`, `demo`, `algos/ppo`, ...), or a list of them layered in
    order as repeated `agentr1 train --config` are (`["tiny", "mine.yaml"]`: later ones win key by
    key), changed by `overrides` as `agentr1 train --set` takes them (`seed=3`,
    `rollout.group_size=8`; applied last, so they win over `data_root`). Tables go under
    `data_root`. A fresh run id unless `run_id` is given; the id of an existing run resumes it."""
    quiet_progress_bars()
    configs = [config] if isinstance(config, str) else list(config)
    # a bad value is blamed on the deployment parameter that set it: a worker's user typed no --set
    layers = [*deployment_overrides([f"data_root={data_root}"], "data_root"), *deployment_overrides(overrides),
              *deployment_overrides([f"run_id={run_id}"] if run_id else [], "run_id")]
    pipeline = load_config([resolve_config(name) for name in configs], layers)
    if pipeline.run_id is None:
        pipeline = pipeline.model_copy(update={"run_id": new_run_id("train")})
    print(f"agentr1: run {pipeline.run_id}: config {config} with overrides {list(overrides) or 'none'}; "
          f"data root {pipeline.data_root}")
    return train(pipeline)


@flow(name="agentr1-evaluate-run", log_prints=True)
def evaluate_run(
    run_id: str,
    data_root: str = "data",
    iteration: int | None = None,
    checkpoint: str | None = None,
    methods: list[str] = ["naive_rag", "base_tool_call", "agent"],  # noqa: B006 - as above
    split: str = "test",
    seeds: int = 3,
    limit: int | None = None,
    greedy: bool = False,
    temperature: float | None = None,
    eval_id: str | None = None,
) -> EvalResult:
    """Evaluate `methods` of run `run_id` over a dataset split, seeds 0..seeds-1: eval tables under
    `<data_root>/evals/<eval_id>/`, the report, MLflow metrics and a Prefect artifact. The agent runs
    the checkpoint of `iteration`, or `checkpoint` (a folder or a `models:/` URI), or the run's last."""
    quiet_progress_bars()
    result = evaluate_training_run(data_root, run_id, methods, iteration=iteration, checkpoint=checkpoint,
                                   split=split, seeds=seeds, limit=limit, greedy=greedy, temperature=temperature,
                                   eval_id=eval_id)
    print(f"agentr1: eval {result.eval_id} of run {run_id} ({split} split)\n{result.markdown}")
    return result


def evaluate_training_run(
    data_root: str,
    run_id: str,
    methods: Sequence[str] = EVAL_METHODS_DEFAULT,
    *,
    iteration: int | None = None,
    checkpoint: str | None = None,
    split: str = "test",
    seeds: int = 3,
    limit: int | None = None,
    greedy: bool = False,
    temperature: float | None = None,
    eval_id: str | None = None,
) -> EvalResult:
    """`agentr1 eval --run-id` and the eval deployment: the run's dataset, budgets and sampling
    settings (greedy, or the run's temperature unless `temperature` is given), its start policy for
    the baselines and the chosen checkpoint for the agent, through the eval flow."""
    if seeds < 1 or (limit is not None and limit < 1):
        raise ValueError(f"seeds and limit must be >= 1, got seeds={seeds} limit={limit}")
    run, config = recorded_config(data_root, run_id)
    checkpoints = run_checkpoints(run, list(methods), _agent_checkpoint(run, iteration, checkpoint),
                                  config.tracking.tracking_uri)
    return evaluate_methods(
        data_root, checkpoints, list(methods), data=config.data, split=split, seeds=list(range(seeds)),
        settings=run_eval_settings(config, greedy, temperature), limit=limit, eval_id=eval_id,
        tracking_uri=config.tracking.tracking_uri,
    )


def _agent_checkpoint(run: RunLayout, iteration: int | None, checkpoint: str | None) -> str | None:
    """The checkpoint of `iteration` (runs/<id>/iteration=<k>/checkpoint), else `checkpoint` as given."""
    if iteration is None:
        return checkpoint
    if checkpoint is not None:
        raise ValueError(f"give iteration or checkpoint, not both (got iteration={iteration}, checkpoint={checkpoint!r})")
    path = run.checkpoint_dir(iteration)
    if not path.is_dir():
        saved = [k for k in run.iterations() if run.checkpoint_dir(k).is_dir()]
        pruned = pruned_message(path)
        raise FileNotFoundError(f"run {run.run_id!r} has no checkpoint of iteration {iteration} at {path}"
                                + (f" ({pruned})" if pruned else "")
                                + f"; iterations with one: {', '.join(map(str, saved)) or 'none yet'}")
    return str(path)
