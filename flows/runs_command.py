"""`agentr1 runs`: every run under a data root with its status, iterations, last dev EM, failed
episodes and algorithm (agent_core/io/run_status.py); a moved data root's MLflow store is re-rooted first."""

from __future__ import annotations

import math
import sys
from pathlib import Path


def runs_command(data_root: Path) -> int:
    """Exit 0 when every run was read whole; 1 when anything (a run's file, mlflow.db) could not be:
    the readable runs are still listed, and each problem is one line on stderr (like `ls`, a script
    sees that the listing is incomplete without parsing it)."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.run_status import list_runs, one_line, printable

    root = DataRoot(data_root)
    problems = _reroot_mlflow_store(root)
    rows, run_problems = list_runs(root)
    problems += run_problems
    if not rows:
        print(f"agentr1: no runs under {root.runs_dir}")
    else:
        width = max(len("run"), *(len(r.run_id) for r in rows))
        print(f"{'run':<{width}}  {'status':<8}  {'iterations':>10}  {'dev EM':>6}  {'failed episodes':>15}  algorithm")
        for r in rows:
            planned = "?" if r.iterations_planned is None else str(r.iterations_planned)
            # nan: not evaluated yet; None: its table is unreadable
            dev = "?" if r.last_dev_em is None else "-" if math.isnan(r.last_dev_em) else f"{r.last_dev_em:.3f}"
            failed = "?" if r.failed_episodes is None else "{}/{}".format(*r.failed_episodes)
            line = (f"{r.run_id:<{width}}  {r.status:<8}  {f'{r.iterations_done}/{planned}':>10}  {dev:>6}  "
                    f"{failed:>15}  {r.algorithm}")
            print(line + (f"  ({one_line(r.detail, 500)})" if r.detail else ""))
    for problem in problems:
        print(f"agentr1: runs: {printable(problem)}", file=sys.stderr)
    return 1 if problems else 0


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
