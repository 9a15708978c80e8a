"""A run's status for `agentr1 runs`: running, finished, failed or killed, with its progress.

The training flow records how it ended in `runs/<id>/status.json`; a live writer holds the run's lock, and a
run neither locked nor recorded as ended reads as killed. A finished run stays finished when a later command
on it fails without committing any stage (`record_run_failure`). In `list_runs` a file that cannot be read
shows as `?` in its run's row and is named in one line.
Design notes: docs/architecture.md §11 (agent_core/io/run_status.py).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import duckdb
import yaml

from agent_core.io.atomic import write_text_atomic
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.locks import lock_is_held
from agent_core.io.summaries import eval_scores
from agent_core.safe_yaml import YamlLimitError, load_yaml

END_STATUSES = ("finished", "failed", "stopped")  # stopped: by the audit (audit.on_alert: stop), resumable


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    status: str  # running | finished | failed | stopped | killed
    iterations_done: int
    iterations_planned: int | None  # None: the run recorded no config
    last_dev_em: float | None  # nan: no dev evaluation yet; None: its table is unreadable
    algorithm: str  # "?": not recorded, or unreadable
    failed_episodes: tuple[int, int] | None  # (failed, all) over the run's steps tables; None: one is unreadable
    detail: str | None  # the error of a failed run, the audit's reason of a stopped one
    problems: tuple[str, ...] = ()  # one line per file that could not be read (`list_runs`)


def record_run_end(run: RunLayout, status: str, detail: str | None = None) -> None:
    """Record how the run's training process ended (status: one of END_STATUSES)."""
    if status not in END_STATUSES:
        raise ValueError(f"unknown run end status {status!r}; valid: {', '.join(END_STATUSES)}")
    write_text_atomic(run.status_path, json.dumps({"status": status, "detail": detail}) + "\n")


def record_run_failure(run: RunLayout, detail: str, stages_committed: int) -> str:
    """Record that a training process on the run failed with `detail`, unless the run was recorded
    finished and the process committed no stage (module docstring); the status now recorded. On a disk
    too full for status.json the record stays as it was (read as killed if there is none), so the
    error being handled, likely that same full disk, is the one the caller raises."""
    recorded, _ = _recorded(run)
    if recorded == "finished" and stages_committed == 0:
        return "finished"
    try:
        record_run_end(run, "failed", detail)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        return recorded or "killed"
    return "failed"


def _recorded(run: RunLayout) -> tuple[str | None, str | None]:
    """The recorded end; (None, None) when none is, or the record is damaged (then it reads as killed)."""
    status, detail, _ = _read_record(run)
    return status, detail


def _read_record(run: RunLayout) -> tuple[str | None, str | None, str | None]:
    """(status, detail, problem): problem says why a status.json that is there was not read."""
    if not os.path.lexists(run.status_path):
        return None, None, None
    try:
        data = json.loads(_read_own_file(run.status_path))
    except _NotRead as error:
        return None, None, f"status.json not read: {one_line(error)}: read as killed"
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON
        return None, None, f"status.json unreadable ({one_line(error)}): read as killed"
    status = data.get("status") if isinstance(data, dict) else None
    detail = data.get("detail") if isinstance(data, dict) else None
    if status not in END_STATUSES or not isinstance(detail, (str, type(None))):
        return None, None, f"status.json records no known end ({one_line(json.dumps(data))}): read as killed"
    return status, detail, None


MAX_FILE_BYTES = 1 << 20  # a run's config.yaml is ~3 KB, its status.json less


class _NotRead(OSError):
    """A run file not read: a symbolic link, not a regular file, or too big (`_read_own_file`)."""


def _read_own_file(path: Path) -> str:
    """The text of a run's own file, which the pipeline writes as a regular file; _NotRead for anything
    else, unread: a symbolic link (to /dev/zero it never ends), a FIFO (it blocks), over MAX_FILE_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _NotRead(f"a symbolic link (to {os.readlink(path)}), not followed") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _NotRead("not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise _NotRead(f"{info.st_size:,} bytes, more than {MAX_FILE_BYTES:,}")
        return handle.read(MAX_FILE_BYTES + 1).decode()


def _read_config(run: RunLayout, problems: list[str]) -> tuple[int | None, str]:
    """(iterations planned, algorithm) from the run's config.yaml; (None, "?") where it cannot say,
    with the reason added to `problems`."""
    if not os.path.lexists(run.config_path):
        return None, "?"
    try:
        config = load_yaml(_read_own_file(run.config_path), "config.yaml")
    except _NotRead as error:
        problems.append(f"config.yaml not read: {one_line(error)}")
        return None, "?"
    except YamlLimitError as error:  # an alias bomb, nesting, a 10,000-digit number: its own line
        problems.append(one_line(error))
        return None, "?"
    except (OSError, ValueError, yaml.YAMLError) as error:  # ValueError: not UTF-8
        mark = getattr(error, "problem_mark", None)
        where = f"{error.problem}, line {mark.line + 1} column {mark.column + 1}" if mark else error
        problems.append(f"config.yaml unreadable ({one_line(where)})")
        return None, "?"
    if not isinstance(config, dict):
        problems.append(f"config.yaml is a {type(config).__name__}, not a mapping of settings")
        return None, "?"
    planned, iterations = None, config.get("iterations", 0)
    if isinstance(iterations, int) and not isinstance(iterations, bool):
        planned = iterations
    else:
        problems.append(f"config.yaml: iterations is {one_line(repr(iterations))}, not a whole number")
    algorithm = config.get("algorithm") or {}
    if not isinstance(algorithm, dict):
        problems.append(f"config.yaml: algorithm is a {type(algorithm).__name__}, not a mapping")
        return planned, "?"
    return planned, printable(str(algorithm.get("estimator", "?")))


def _last_dev_em(run: RunLayout, done: list[int], problems: list[str], con: duckdb.DuckDBPyConnection) -> float | None:
    """The dev EM of the last evaluated iteration in `done` (nan: none evaluated yet; None: the one
    to show is unreadable, named in `problems`). Read from the last iteration back."""
    for k in reversed(done):
        try:
            em = eval_scores(run.dev_eval_uri(k), con)[0]
        except (duckdb.Error, OSError, ValueError, TypeError) as error:  # truncated, garbage, no `em`
            problems.append(f"iteration={k}/dev_eval.parquet unreadable ({one_line(error)}): dev EM shown as ?")
            return None
        if not math.isnan(em):
            return em
    return math.nan


def _failed_episodes(run: RunLayout, problems: list[str], con: duckdb.DuckDBPyConnection) -> tuple[int, int] | None:
    """(episodes that ended in an error, all episodes) over every steps table the run has written, the
    table of a rollout whose episodes all failed too (it stopped the run: agentr1 runs says so)."""
    tables = [uri for k in run.iterations() if Path(uri := run.table_uri(k, "steps")).is_file()]
    if not tables:
        return 0, 0
    try:
        failed, episodes = con.execute(
            "select count(*) filter (where termination = 'error'), count(*) from read_parquet(?) where done",
            [tables]).fetchall()[0]
    except (duckdb.Error, OSError) as error:
        problems.append(f"a steps table is unreadable ({one_line(error)}): failed episodes shown as ?")
        return None
    return int(failed), int(episodes)


def run_status(run: RunLayout, con: duckdb.DuckDBPyConnection | None = None) -> RunStatus:
    """The run's row for `agentr1 runs`; what a damaged file hides is `?` (None), with one line in
    `problems` naming the file and what is wrong with it. `con`: a DuckDB connection to reuse
    (`list_runs` shares one: opening one per run cost more than its queries)."""
    if con is None:
        with duckdb.connect() as own:
            return run_status(run, own)
    problems: list[str] = []
    planned, algorithm = _read_config(run, problems)
    done = [k for k in run.iterations() if run.manifest_path("log_iteration", k).is_file()]
    last_dev_em = _last_dev_em(run, done, problems, con)
    recorded, detail, problem = _read_record(run)
    if problem:
        problems.append(problem)
    status = "running" if lock_is_held(run.lock_path) else (recorded or "killed")
    return RunStatus(
        run_id=run.run_id, status=status, iterations_done=len(done), iterations_planned=planned,
        last_dev_em=last_dev_em, algorithm=algorithm, failed_episodes=_failed_episodes(run, problems, con),
        detail=detail if status in ("failed", "stopped") else None, problems=tuple(problems),
    )


def list_runs(root: DataRoot) -> tuple[list[RunStatus], list[str]]:
    """Every run under `root` that can be listed, and one line ("<run>: <problem>") per problem met:
    a run's damaged file (the run is still listed, `?` there) or a folder that cannot be a run.
    Hidden folders (`.ipynb_checkpoints`) and files are not runs: skipped without a word."""
    if not root.runs_dir.is_dir():
        return [], []
    try:
        folders = sorted(p.name for p in root.runs_dir.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError as error:
        return [], [f"{root.runs_dir}: unreadable ({one_line(error)})"]
    rows, problems = [], []
    with duckdb.connect() as con:
        for name in folders:
            try:
                run = root.run(name)
            except ValueError:
                problems.append(f"{printable(repr(name))}: not a run id (letters, digits, '.', '_', '-'), skipped")
                continue
            try:
                rows.append(run_status(run, con))
            except Exception as error:  # noqa: BLE001 (one run's damage must never hide the others)
                problems.append(f"{name}: unreadable ({type(error).__name__}: {one_line(error)}), not listed")
                continue
            problems += [f"{name}: {problem}" for problem in rows[-1].problems]
    return rows, problems


def printable(text: str) -> str:
    """`text` with control characters escaped (`\\x1b`): a file's bytes never drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line(error: object, limit: int = 200) -> str:
    """An error (or text) as one printable line of at most `limit` characters: its first line (DuckDB
    and YAML add context lines)."""
    text = printable(" ".join(next((line for line in str(error).splitlines() if line.strip()), "").split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."
