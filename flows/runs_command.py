"""`agentr1 runs`: every run under a data root with its status, iterations, last dev EM, failed
episodes and algorithm (agent_core/io/run_status.py) and its disk use, then the total; a moved data
root's MLflow store is re-rooted first."""

from __future__ import annotations

import math
import sys
from pathlib import Path


def runs_command(data_root: Path) -> int:
    """Exit 0 when every run was read whole; 1 when anything (a run's file, mlflow.db) could not be:
    the readable runs are still listed, and each problem is one line on stderr (like `ls`, a script
    sees that the listing is incomplete without parsing it)."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.run_status import list_runs, printable

    root = DataRoot(data_root)
    problems = _reroot_mlflow_store(root)
    rows, run_problems = list_runs(root)
    problems += run_problems
    if not rows:
        print(f"agentr1: no runs under {root.runs_dir}")
    else:
        _print_table(root, rows)
    for problem in problems:
        print(f"agentr1: runs: {printable(problem)}", file=sys.stderr)
    return 1 if problems else 0


def _print_table(root, rows) -> None:
    from agent_core.io.run_status import one_line

    disk, runs_bytes, artifacts_bytes = _disk(root, rows)
    width = max(len("run"), *(len(r.run_id) for r in rows))
    algorithm_width = max(len("algorithm"), *(len(r.algorithm) for r in rows))
    print(f"{'run':<{width}}  {'status':<8}  {'iterations':>10}  {'dev EM':>6}  {'failed episodes':>15}  "
          f"{'algorithm':<{algorithm_width}}  {'disk':>8}")
    for r, used in zip(rows, disk):
        planned = "?" if r.iterations_planned is None else str(r.iterations_planned)
        # nan: not evaluated yet; None: its table is unreadable
        dev = "?" if r.last_dev_em is None else "-" if math.isnan(r.last_dev_em) else f"{r.last_dev_em:.3f}"
        failed = "?" if r.failed_episodes is None else "{}/{}".format(*r.failed_episodes)
        line = (f"{r.run_id:<{width}}  {r.status:<8}  {f'{r.iterations_done}/{planned}':>10}  {dev:>6}  "
                f"{failed:>15}  {r.algorithm:<{algorithm_width}}  {used:>8}")
        print(line + (f"  ({one_line(r.detail, 500)})" if r.detail else ""))
    total = f"total: {runs_bytes} on disk in {len(rows)} run{'s' * (len(rows) != 1)}"
    print(total + (f"; MLflow artifacts (mlartifacts/): {artifacts_bytes} more" if artifacts_bytes else ""))


def _disk(root, rows) -> tuple[list[str], str, str | None]:
    """Each run folder's disk use, all of them, and what the MLflow artifacts hold beyond them (None:
    nothing), readable: a stat walk counting each inode once (a registered version's files are hard
    links of the run's checkpoint: counted with the run while it keeps them, with mlartifacts/ after
    retention pruned them)."""
    from agent_core.io.disk_use import disk_uses, human_bytes

    folders = [root.run(r.run_id).run_dir for r in rows]
    own, added = disk_uses([*folders, root.mlflow_artifacts])
    artifacts = human_bytes(added[-1]) if added[-1] else None  # 0: no mlartifacts/
    return [human_bytes(n) for n in own[:-1]], human_bytes(sum(added[:-1])), artifacts


def _reroot_mlflow_store(root) -> list[str]:
    """A moved or copied data root: point its MLflow store here, so `mlflow models serve` works next.
    A damaged store is one line, not the end of the listing (the runs are listed from their folders)."""
    import sqlite3

    from agent_core.io.mlflow_store import reroot_store
    from agent_core.io.run_status import one_line

    try:
        rewritten = reroot_store(root.mlflow_tracking_uri, root.mlflow_artifacts)
    except (sqlite3.Error, OSError) as error:
        return [f"mlflow.db ({root.mlflow_db}): the MLflow store is unreadable ({one_line(error)}); runs are listed "
                "from their folders; restore it from a backup, or move it aside and the next run starts a new one"]
    if rewritten:
        print(f"agentr1: the MLflow store moved with the data root: {rewritten} artifact locations now point under {root.path}")
    return []
