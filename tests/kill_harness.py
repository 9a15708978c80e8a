"""Kill-and-resume harness: run `agentr1 train` in a subprocess, SIGKILL it at a chosen moment,
check that nothing half-written is visible, resume it, and compare the result with a clean run.

Kill moments come from failpoints (agent_core/failpoints.py): a clean run records every failpoint
it passes (its trace); a kill point is "the n-th visit of failpoint X", i.e. one position in that
trace, and the run is deterministic (seeded, lock-step tool turns), so a fresh run reaches the
same position. Timed kills (a random delay) cover moments between failpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
from mlflow.tracking import MlflowClient

from agent_core.failpoints import FAILPOINT_ENV, TRACE_ENV
from agent_core.io.checkpoints import check_checkpoint
from agent_core.io.layout import RUN_TABLES, DataRoot
from agent_core.io.manifests import fingerprint, read_manifest
from agent_core.io.tables import read_table
from agent_core.io.tombstones import read_tombstone

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_ID = "killed"
# Deterministic and quick: lock-step tool turns, no dev eval; an entropy bonus so every update
# changes the weights (the untrained tiny policy earns no reward, so GRPO alone would not).
OVERRIDES = ("rollout.straggler_wait_s=.inf", "dev_eval.every=0", "trainer.entropy_coef=0.05")
TIMING_COLUMNS = {"train_metrics": ("seconds", "tokens_per_s", "started_at", "finished_at"), "steps": ("generated_at",)}


@dataclass(frozen=True)
class KillPoint:
    """One kill: the failpoint spec (name@n), or a delay in seconds; and where in the run it lands."""

    spec: str | None
    delay_s: float | None
    stage: str  # the stage running when the process died
    iteration: str  # "setup" before iteration 0, else the iteration number
    seconds: float = 0.0  # how long the kill and the resume took

    def describe(self) -> str:
        moment = self.spec if self.spec else f"after {self.delay_s:.1f} s"
        took = f"  ({self.seconds:.0f} s)" if self.seconds else ""
        return f"{moment:<50} iteration {self.iteration:<5} stage {self.stage}{took}"


def prefect_api_url() -> str:
    """The URL of this test process's temporary Prefect API (started if need be), for subprocesses:
    a process of its own would spend 8-17 s starting one (migrating a fresh database)."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url


def run_cli(args: list[str], data_root: Path, *, failpoint: str | None = None, trace: Path | None = None,
            kill_after_s: float | None = None, timeout_s: float = 600, prefect_api: str | None = None,
            survivors: list[int] | None = None) -> tuple[int, str]:
    """Run `python -m flows.cli ARGS` with the Prefect API at `prefect_api`, or its own temporary one
    (state under `data_root`); (returncode, output). `survivors`, if given, receives the pids of the
    process group still alive when the process ended on its own (before the group is killed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AGENTR1_"))}
    env.update(PREFECT_HOME=str(data_root / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_TO_API_ENABLED="false", PYTHONPATH=str(REPO_ROOT))
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    if failpoint:
        env[FAILPOINT_ENV] = failpoint
    if trace:
        env[TRACE_ENV] = str(trace)
    command = [sys.executable, "-m", "flows.cli", *args, "--data-root", str(data_root)]
    log_path = data_root.parent / f"{data_root.name}.{int(time.time() * 1000)}.log"
    with open(log_path, "w") as log:
        # Its own session, so the whole group can be killed: a SIGKILLed agentr1 leaves Prefect's
        # temporary API server (its child) running, and a timed kill kills the group like a lost machine.
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            if kill_after_s is None:
                process.wait(timeout=timeout_s)
            else:  # the delay counts from the run's start: its recorded config, after the interpreter's start-up
                _wait_for(lambda: process.poll() is not None or _started(data_root), timeout_s)
                process.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            if kill_after_s is None:
                _kill_group(process.pid)
                raise
        if survivors is not None and process.poll() is not None:
            survivors += group_members(process.pid)
        _kill_group(process.pid)
        code = process.wait(timeout=60)
    return code, log_path.read_text()


def _started(data_root: Path) -> bool:
    return any(data_root.glob("runs/*/config.yaml"))


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("wait", timeout_s)
        time.sleep(0.05)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)
    except ProcessLookupError:
        pass


def train_args(run_id: str = RUN_ID) -> list[str]:
    args = ["train", "--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--run-id", run_id]
    for override in OVERRIDES:
        args += ["--set", override]
    return args


def read_trace(path: Path) -> list[str]:
    return path.read_text().split() if path.is_file() else []


def kill_points_of(trace: list[str]) -> list[KillPoint]:
    """Every position of a clean run's trace as a kill point (spec name@n), with its stage."""
    seen: Counter = Counter()
    points, stage, iteration = [], "setup", "setup"
    for name in trace:
        seen[name] += 1
        if name.startswith("stage:") and name.endswith(":start"):
            stage = name.split(":")[1]
            if stage == "prepare_data":
                iteration = str(0 if iteration == "setup" else int(iteration) + 1)
        points.append(KillPoint(f"{name}@{seen[name]}", None, _stage_label(name, stage), iteration))
    return points


def _stage_label(name: str, stage: str) -> str:
    if name.startswith(("save_policy", "checkpoint:", "save_optimizer")):
        return f"{stage} (checkpoint writing)"
    if name.startswith("write_table") or name.startswith("manifest"):
        return f"{stage} (output writing)"
    return stage


def stage_at_death(trace: list[str]) -> tuple[str, str]:
    """(stage, iteration) a killed process was in, from its own trace."""
    points = kill_points_of(trace)
    return (points[-1].stage, points[-1].iteration) if points else ("startup", "setup")


def visible_problems(data_root: Path, run_id: str = RUN_ID) -> list[str]:
    """What a reader could see half-done: every visible table must read and validate, every visible
    checkpoint must be complete, every manifest's outputs must be what it recorded, and SQL over the
    data root must work."""
    problems = []
    run = DataRoot(data_root).run(run_id)
    for path in sorted(run.run_dir.glob("iteration=*/*.parquet")):
        try:
            read_table("eval" if path.stem == "dev_eval" else path.stem, path)  # health, ledger: their own schemas
        except Exception as error:  # noqa: BLE001 - any failure is a finding
            problems.append(f"{path}: {error}")
    for directory in [run.initial_policy_dir, *run.run_dir.glob("iteration=*/checkpoint")]:
        if directory.exists():
            try:
                check_checkpoint(directory)
            except Exception as error:  # noqa: BLE001
                problems.append(str(error))
    for manifest_path in run.run_dir.glob("**/_manifests/*.json"):
        manifest = read_manifest(manifest_path)
        for name, output in (manifest.outputs.items() if manifest else []):
            if fingerprint(output) != manifest.output_fingerprints[name]:
                problems.append(f"{manifest_path}: output {name} ({output}) is not what the manifest recorded")
    if list(run.run_dir.glob("iteration=*/steps.parquet")):
        glob = str(run.run_dir / "iteration=*" / "steps.parquet")
        # A connection of its own: kill_and_resume runs in several threads at once, and DuckDB's
        # module-level default connection (duckdb.sql) is one object they would share ("connection is busy").
        with duckdb.connect() as con:
            con.execute("select count(*) from read_parquet(?, hive_partitioning=true)", [glob]).fetchall()
    return problems


def snapshot(data_root: Path, run_id: str = RUN_ID) -> dict[str, object]:
    """The run's tables (minus wall-clock columns) and checkpoint file hashes, for equality."""
    run = DataRoot(data_root).run(run_id)
    result: dict[str, object] = {f"initial/{file.name}": hashlib.sha256(file.read_bytes()).hexdigest()
                                 for file in sorted(run.initial_policy_dir.glob("*.safetensors"))}
    for iteration_dir in sorted(run.run_dir.glob("iteration=*")):
        k = int(iteration_dir.name.split("=")[1])
        for table in RUN_TABLES:
            rows = pq.read_table(run.table_uri(k, table)).to_pylist()
            for row in rows:
                for column in TIMING_COLUMNS.get(table, ()):
                    row.pop(column, None)
                if "info" in row:  # seconds inside the step info are wall-clock too
                    row["info"] = {key: v for key, v in json.loads(row["info"]).items() if not key.endswith("_seconds")}
            result[f"{k}/{table}"] = rows
        if not run.checkpoint_dir(k).is_dir():  # pruned by retention: the resumed run must have pruned it too
            result[f"{k}/checkpoint"] = "pruned" if read_tombstone(run.checkpoint_dir(k)) else "missing"
            continue
        for file in sorted(run.checkpoint_dir(k).iterdir()):
            result[f"{k}/checkpoint/{file.name}"] = hashlib.sha256(file.read_bytes()).hexdigest()
    result["registered"] = registered_iterations(data_root)  # what registry retention kept
    return result


def registered_iterations(data_root: Path, model_name: str = "agentr1-policy") -> list[int]:
    """The iteration tag of every registered model version in the data root's MLflow store."""
    client = MlflowClient(DataRoot(data_root).mlflow_tracking_uri)
    return sorted(int(v.tags["iteration"]) for v in client.search_model_versions(f"name='{model_name}'"))


def kill_and_resume(point: KillPoint, data_root: Path, reference: dict, iterations: int,
                    prefect_api: str | None = None) -> tuple[KillPoint, list[str]]:
    """Kill a fresh run at `point`, check what is visible, resume it; (the point with the stage it hit,
    the failures found: empty when it passed)."""
    trace = data_root.parent / f"{data_root.name}.trace"
    started = time.perf_counter()
    code, output = run_cli(train_args(), data_root, failpoint=point.spec, trace=trace, kill_after_s=point.delay_s,
                           prefect_api=prefect_api)
    if point.spec is None:  # a timed kill: where it landed is the last failpoint the process passed
        point = dataclasses.replace(point, **dict(zip(("stage", "iteration"), stage_at_death(read_trace(trace)))))
    if code != -9:
        return point, [f"the run was not killed (exit {code}); last output:\n{output[-2000:]}"]
    failures = [f"after the kill: {p}" for p in visible_problems(data_root)]
    code, output = run_cli(["resume", "--run-id", RUN_ID], data_root, prefect_api=prefect_api)
    if code != 0:
        return point, failures + [f"resume failed (exit {code}):\n{output[-3000:]}"]
    failures += [f"after resuming: {p}" for p in visible_problems(data_root)]
    failures += snapshot_differences(reference, snapshot(data_root))
    if registered_iterations(data_root) != reference.get("registered"):
        failures.append(f"model versions by iteration: {registered_iterations(data_root)}, want those of the "
                        f"uninterrupted run: {reference.get('registered')}")
    failures += [f"left behind: {p}" for p in leftover_files(data_root)]
    return dataclasses.replace(point, seconds=time.perf_counter() - started), failures


def snapshot_differences(reference: dict, got: dict) -> list[str]:
    """One line per table or checkpoint file of `got` (a resumed run's snapshot) that is not the
    uninterrupted run's."""
    return ([f"{key} differs from the uninterrupted run" for key in sorted(reference) if got.get(key) != reference[key]]
            + [f"{key} exists only in the resumed run" for key in sorted(got.keys() - reference.keys())])


def leftover_files(data_root: Path, run_id: str = RUN_ID) -> list[Path]:
    """Hidden files a writer left in the run (temporaries, staging folders); the run's lock excepted."""
    return [p for p in DataRoot(data_root).run(run_id).run_dir.rglob(".*") if p.name != ".lock"]
