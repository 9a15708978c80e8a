"""`agentr1 prune`: apply checkpoint retention (the `checkpoints:` section) to existing runs, e.g. runs
recorded before retention existed or a run whose rules were loosened. `--dry-run` lists what would go
and the bytes freed. A run being written (its lock held) is refused; one line per problem, and the
other runs are still pruned."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from agent_core.io.disk_use import freed_by_deleting, human_bytes


def prune_command(data_root: Path, run_ids: list[str], overrides: list[str], dry_run: bool) -> int:
    """Exit 0 when every named run (all runs without names) was pruned or had nothing to prune; 1 when
    one could not be (in use, no config, ...): those are one line each on stderr."""
    from agent_core.io.layout import DataRoot, check_id

    root = DataRoot(data_root)
    names = [check_id("run id", run_id) for run_id in run_ids] or root.run_ids()
    if not names:
        print(f"agentr1: no runs under {root.runs_dir}")
        return 0
    problems, total = [], 0
    for run_id in names:
        try:
            total += _prune_run(data_root, run_id, overrides, dry_run)
        except Exception as error:  # noqa: BLE001 - any run's problem is one line; the others go on
            problems.append(f"run {run_id}: {' '.join(str(error).split())}")
    verb = "would free" if dry_run else "freed"
    print(f"agentr1: prune {verb} {human_bytes(total)} in {len(names) - len(problems)} run(s)"
          + (" (dry run: nothing deleted)" if dry_run else ""))
    for problem in problems:
        print(f"agentr1: prune: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _prune_run(data_root: Path, run_id: str, overrides: list[str], dry_run: bool) -> int:
    from agent_core.io.locks import check_run_free, run_lock, sweep_temporaries
    from agent_core.io.retention import apply_prune, plan_prune
    from flows.configs_lookup import recorded_config

    run, config = recorded_config(data_root, run_id)
    if overrides:
        from agent_core.validation import load_config

        config = load_config(run.config_path, [f"data_root={data_root}", *overrides])
    check_run_free(run.lock_path, run_id)  # a run being written: refused in one line
    with run_lock(run.lock_path, run_id):
        plan = plan_prune(run, config.checkpoints)
        for item in plan.items:
            where = "start" if item.iteration < 0 else f"iteration {item.iteration}"
            print(f"  {run_id}  {where:<14}  {item.kind:<16}  {human_bytes(item.bytes):>9}  ({item.reason})")
        if dry_run:  # a checkpoint and its registered version share their files (hard links): counted together
            versions = _registered(data_root, run_id, config, set(plan.kept), dry_run=True)
            freed = freed_by_deleting(*(item.path for item in plan.items), *(v.path for v in versions))
        else:  # the files first, so a version's bytes count once its checkpoint is gone (tasks/prune.py)
            sweep_temporaries(run.run_dir)  # what a killed prune or writer left
            plan = apply_prune(plan)
            versions = _registered(data_root, run_id, config, set(plan.kept), dry_run=False)
            freed = plan.bytes + sum(v.bytes_freed for v in versions)
    kept = ", ".join(f"{k} ({why})" for k, why in sorted(plan.kept.items())) or "none committed"
    print(f"  {run_id}: {len(plan.items)} file(s), {len(versions)} model version(s), {human_bytes(freed)}; "
          f"checkpoints kept: {kept}")
    return freed


def _registered(data_root: Path, run_id: str, config, keep: set[int], dry_run: bool) -> list:
    """The run's registered versions retention lets go (deleted unless `dry_run`), one line each."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.registry_retention import prune_registered_versions

    if config.checkpoints.keep_all:
        return []
    uri = config.tracking.tracking_uri or DataRoot(Path(data_root)).mlflow_tracking_uri
    versions = prune_registered_versions(uri, config.tracking.registered_model_name(), run_id, keep, dry_run=dry_run)
    for version in versions:
        what = f"model version {version.version}" if version.version is not None else "model files"
        print(f"  {run_id}  {f'iteration {version.iteration}':<14}  {what:<16}  "
              f"{human_bytes(version.bytes_freed):>9}")
    return versions


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", dest="run_ids", action="append", default=[], metavar="ID",
                        help="a run to prune (repeat for more; default: every run under the data root)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="retention rules for this prune, e.g. --set checkpoints.keep_last=2 (the run's own otherwise)")
    parser.add_argument("--dry-run", action="store_true", help="list what would go and the bytes freed; delete nothing")


def disk_full_line(config, error: BaseException) -> str | None:
    """The one line `agentr1 train`/`resume` prints when a full disk (or the disk budget) stopped the run,
    with how to free space and continue; None for any other error."""
    from agent_core.io.disk_budget import DiskBudgetError, disk_full_cause, disk_full_summary
    from agent_core.io.layout import DataRoot
    from agent_core.io.run_status import printable

    cause = disk_full_cause(error)
    if cause is None:
        return None
    root, run_id = Path(config.data_root).resolve(), config.run_id
    how = ("" if isinstance(cause, DiskBudgetError)  # the budget's message already says how to free space
           else f" free space (`agentr1 prune --run-id {run_id}` frees old checkpoints),")
    if not DataRoot(root).run(run_id).config_path.is_file():
        then = "run the same command again"
    else:
        then = f"continue with `agentr1 resume --run-id {run_id} --data-root {shlex.quote(str(root))}`"
    return f"agentr1: error: run {run_id} stopped: {printable(disk_full_summary(cause, root))};{how} then {then}"
