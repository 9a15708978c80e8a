"""The command line's checks of what names a run, an iteration, a split or a checkpoint, made before
a Prefect server starts: each bad value is one line naming it (issue 39, item 10), not an error from
inside a flow after the server started."""

from __future__ import annotations

from pathlib import Path

# What each rerunnable stage reads of its iteration (tables by name; "policy": the policy it starts from).
STAGE_INPUTS = {
    "prepare_data": (),
    "rollout": ("prompts", "policy"),
    "label_rewards": ("steps", "prompts"),
    "compute_advantages": ("steps", "rewards"),
    "train": ("steps", "advantages", "policy"),
}


def check_run_id(run_id: str, option: str = "--run-id") -> str:
    """A run id names one folder under runs/: `../x`, `a/b` or an absolute path is refused."""
    from agent_core.io.layout import check_id

    try:
        return check_id("run id", run_id)
    except ValueError as error:
        raise ValueError(f"{option}: {error}") from None


def check_rerun_inputs(data_root: str | Path, run_id: str, iteration: int, stage: str) -> None:
    """The iteration is one of the run's (its recorded config's `iterations`) and what the stage reads
    of it exists; ValueError or FileNotFoundError in one line otherwise."""
    from agent_core.io.tombstones import pruned_message
    from flows.configs_lookup import recorded_config

    run, config = recorded_config(data_root, run_id)
    done = run.iterations()
    has = f"it has {_iterations(done)} so far" if done else "it has none so far"
    if not 0 <= iteration < config.iterations:
        raise ValueError(f"--iteration {iteration}: run {run_id!r} has iterations 0 to {config.iterations - 1} "
                         f"(its config: iterations: {config.iterations}); {has}")
    missing = [str(path) for path in (_input_path(run, iteration, name) for name in STAGE_INPUTS[stage])
               if not path.exists()]
    pruned = [message for path in missing if (message := pruned_message(path))]
    if pruned:
        raise FileNotFoundError(f"--iteration {iteration} --stage {stage}: {pruned[0]}")
    if missing:
        raise FileNotFoundError(f"--iteration {iteration} --stage {stage}: run {run_id!r} has not written what "
                                f"{stage} reads yet ({', '.join(missing)}); {has}")


def _input_path(run, iteration: int, name: str) -> Path:
    return run.policy_dir_before(iteration) if name == "policy" else Path(run.table_uri(iteration, name))


def _iterations(done: list[int]) -> str:
    return f"iteration {done[0]}" if len(done) == 1 else f"iterations {', '.join(map(str, done))}"


def check_eval_inputs(data_root: str | Path, run_id: str, split: str, checkpoint: str | None,
                      iteration: int | None) -> None:
    """`agentr1 eval`'s split, --checkpoint folder and --iteration, checked before Prefect starts
    (a registered `models:/` checkpoint is resolved by the command itself)."""
    from agent_core.data.loaders import SPLITS
    from agent_core.io.model_registry import is_model_uri
    from agent_core.io.tombstones import read_tombstone
    from flows.configs_lookup import recorded_config

    if split not in SPLITS:
        raise ValueError(f"--split {split!r}: unknown dataset split; valid splits: {', '.join(SPLITS)}")
    run, config = recorded_config(data_root, run_id)
    check_registered_checkpoint(run, config, checkpoint)
    if checkpoint is not None and not is_model_uri(checkpoint) and not Path(checkpoint).is_dir():
        what = "is not a folder" if Path(checkpoint).exists() else "does not exist"
        raise FileNotFoundError(f"--checkpoint {checkpoint}: {what}; give a checkpoint folder or a registered "
                                "model models:/NAME/VERSION or models:/NAME@ALIAS")
    if iteration is not None and not run.checkpoint_dir(iteration).is_dir():
        done = [k for k in run.iterations() if run.checkpoint_dir(k).is_dir()]
        pruned = "it was pruned by checkpoint retention (the run's checkpoints: section); " if read_tombstone(
            run.checkpoint_dir(iteration)) else ""
        raise FileNotFoundError(f"--iteration {iteration}: run {run_id!r} has no checkpoint of iteration {iteration}; "
                                + pruned + (f"it has checkpoints of {_iterations(done)}" if done else "it has none yet"))


def check_registered_checkpoint(run, config, checkpoint: str | None) -> None:
    """A `models:/` checkpoint resolved as the eval flow resolves it (flows.eval.run_checkpoints),
    without Prefect: ModelRegistryError (a ValueError) names what does exist. The version it finds is
    downloaded into the data root's models/ cache, which the eval then reuses."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.model_registry import is_model_uri, registered_checkpoint

    if is_model_uri(checkpoint):
        root = DataRoot(run.data_root)
        registered_checkpoint(checkpoint, config.tracking.tracking_uri or root.mlflow_tracking_uri, root.path)
