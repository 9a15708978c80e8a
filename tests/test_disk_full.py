"""Disk full survived (issue 56, item 5), with real `agentr1` processes (slow, ~5 min on 2 cores).

A chain of runs: `AGENTR1_FAILPOINT=<name>@1=enospc` makes a write raise OSError(ENOSPC) where the disk
would refuse it, at each write path in turn (a table, a manifest, a checkpoint, the optimizer state on the
background writer, MLflow's registration, the ledger), each resume getting one step further. After each:
exit code 1, one `agentr1: error:` line naming the file (or the data root) and the resume command, no
traceback, nothing half-written visible, the run recorded as failed; the last resume's tables and checkpoints
equal an uninterrupted run's. And a real small filesystem: a tmpfs data root in a mount namespace of its
own, filled by the run itself (the disk budget stops it before a checkpoint), then out of inodes (a real
ENOSPC from the kernel that no budget foresees), then freed (`mount -o remount`) and resumed. Prefect's
state lives in that data root, so this case is the test of Prefect's own writes on a full disk (a
failpoint cannot reach its server process).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_core.io.layout import DataRoot
from agent_core.io.run_status import run_status
from flows.cli import main as cli_main
from kill_harness import (
    REPO_ROOT,
    RUN_ID,
    leftover_files,
    prefect_api_url,
    run_cli,
    snapshot,
    snapshot_differences,
    train_args,
    visible_problems,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]

# A ~19 MiB policy (5M parameters): two checkpoints, their optimizer states and the rest do not fit in
# SMALL_DISK with the margin; every iteration's files are kept (retention would make room).
SIZE = ("policy.hidden_size=384", "policy.intermediate_size=1536", "policy.num_heads=4",
        "checkpoints.keep_all=true", "checkpoints.disk_margin_mb=8")
SMALL_DISK = "108m"  # iteration 0 fits; iteration 1's checkpoint is refused with ~24 MiB free (it needs 35 + 8)
INODES_AFTER_BUDGET_STOP = 3  # inodes left when the budget-stopped run resumes: its checkpoint staging runs out

# (failpoint, what the error line names): each visit is the first of its kind in that process, the
# stages before it being skipped by their manifests.
CHAIN = (
    ("write_table:steps.parquet:temp_written", "iteration=0/steps.parquet"),
    ("manifest:rollout:temp_written", "iteration=0/_manifests/rollout.json"),
    ("save_policy:staged", "iteration=0/checkpoint"),
    ("save_optimizer:temp_written", "iteration=0/optimizer.pt"),  # on the background writer thread
    ("tracking:checkpoint_artifacts_logged", "no space left on device under "),  # MLflow: no file named
    ("write_table:ledger.parquet:temp_written", "iteration=0/ledger.parquet"),
)


def _args() -> list[str]:
    args = train_args()
    for override in SIZE:
        args += ["--set", override]
    return args


@pytest.fixture(scope="module")
def prefect_api():
    return prefect_api_url()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_api):
    """An uninterrupted run of the same config (in this process): its snapshot."""
    data_root = tmp_path_factory.mktemp("reference")
    assert cli_main([*_args(), "--data-root", str(data_root)]) == 0
    return snapshot(data_root)


def _stopped_by_a_full_disk(code: int, output: str, data_root: Path, names: str) -> list[str]:
    """What is wrong with how a run stopped by a full disk ended: the exit code, its one line, what a
    reader or a resume could see half-written, a temporary left behind, the recorded status."""
    problems = [] if code == 1 else [f"exit code {code}, want 1"]
    said = [line for line in output.splitlines() if line.startswith("agentr1: error:")]
    if len(said) != 1 or names not in said[0] or f"`agentr1 resume --run-id {RUN_ID} --data-root " not in said[0]:
        problems.append(f"want one error line naming {names!r} and the resume, got {said}")
    if "Traceback" in output:
        problems.append("a traceback was printed")
    problems += visible_problems(data_root)
    problems += [f"left behind (a failed write removes its own temporary): {p}" for p in leftover_files(data_root)]
    status = run_status(DataRoot(data_root).run(RUN_ID))
    if status.status != "failed" or not status.detail or ("No space left" not in status.detail
                                                          and "not enough disk" not in status.detail):
        problems.append(f"run status {status.status} ({status.detail}), want failed for a full disk")
    return problems + ([output[-3000:]] if problems else [])


def _resumed_like_the_reference(code: int, output: str, data_root: Path, reference: dict) -> list[str]:
    if code != 0:
        return [f"the last resume failed (exit {code}):\n{output[-3000:]}"]
    # the snapshot holds the registered iterations too: those retention kept in the uninterrupted run
    return (visible_problems(data_root) + snapshot_differences(reference, snapshot(data_root))
            + [f"left behind: {p}" for p in leftover_files(data_root)]
            + ([] if run_status(DataRoot(data_root).run(RUN_ID)).status == "finished" else ["not recorded finished"]))


@pytest.mark.timeout(900)
def test_enospc_at_every_write_path_stops_in_one_line_and_the_resumes_end_as_an_uninterrupted_run(
        reference, tmp_path, prefect_api, capsys):
    data_root = tmp_path / "data"
    args = _args()
    for failpoint, names in CHAIN:
        started = time.perf_counter()
        code, output = run_cli(args, data_root, failpoint=f"{failpoint}@1=enospc", prefect_api=prefect_api)
        problems = _stopped_by_a_full_disk(code, output, data_root, names)
        with capsys.disabled():
            print(f"\n  {'ok    ' if not problems else 'FAILED'} ENOSPC at {failpoint:<45} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        assert not problems, "\n".join(problems)
        args = ["resume", "--run-id", RUN_ID]
    code, output = run_cli(args, data_root, prefect_api=prefect_api)
    assert not (failures := _resumed_like_the_reference(code, output, data_root, reference)), "\n".join(failures)


# ---- a real small filesystem ---------------------------------------------------------------------------


class SmallDisk:
    """A tmpfs at `mount` in a mount namespace held open by a sleeping process; `agentr1` runs in it
    with `nsenter`, and this process sees it at `/proc/<pid>/root<mount>`."""

    def __init__(self, mount: Path, size: str):
        self.mount = mount
        mount.mkdir(parents=True)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             f"mount -t tmpfs -o size={size} tmpfs '{mount}' && echo ready && exec sleep 3600"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        said = self.holder.stdout.readline().strip()
        if said != "ready":
            self.close()
            pytest.skip(f"no tmpfs in a mount namespace here (root and CAP_SYS_ADMIN needed): {said}")
        self.data_root = Path(f"/proc/{self.holder.pid}/root{mount}") / "data"  # as this process sees it

    def run(self, args: list[str], timeout_s: float = 300) -> tuple[int, str]:
        """`agentr1 ARGS` inside the namespace, with its own Prefect server whose state is in the tmpfs."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AGENTR1_"))}
        env.update(PREFECT_HOME=str(self.mount / "data" / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_LOGGING_TO_API_ENABLED="false", PYTHONPATH=str(REPO_ROOT))
        command = ["nsenter", "-t", str(self.holder.pid), "-m", "--", sys.executable, "-m", "flows.cli", *args,
                   "--data-root", str(self.mount / "data")]
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout_s)
        finally:
            _kill_group(process.pid)  # a Prefect server it left would keep the tmpfs mounted
        return process.wait(), output

    def remount(self, options: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", "--", "mount", "-o", f"remount,{options}",
                        str(self.mount)], check=True, capture_output=True)

    def inodes_used(self) -> int:
        return os.statvfs(self.data_root).f_files - os.statvfs(self.data_root).f_ffree

    def close(self) -> None:
        _kill_group(self.holder.pid)  # the namespace, and its tmpfs, end with it
        self.holder.wait(timeout=30)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("a tmpfs in a mount namespace needs root, unshare and nsenter")
    disk = SmallDisk(tmp_path / "small", SMALL_DISK)
    yield disk
    disk.close()


@pytest.mark.timeout(900)
def test_a_tmpfs_data_root_filled_by_the_run_itself_then_freed_resumes_to_the_uninterrupted_run(
        reference, small_disk, tmp_path, capsys):
    started = time.perf_counter()
    code, output = small_disk.run(_args())  # stops at the disk budget: bytes
    problems = _stopped_by_a_full_disk(code, output, small_disk.data_root, "not enough disk for iteration ")
    assert not problems, "\n".join(problems)
    assert "agentr1 prune --run-id" in output and "MiB free" in output
    said = [line for line in output.splitlines() if line.startswith("agentr1: error:")]

    # more bytes, but inodes for only a few files: the kernel's own ENOSPC mid-write, past any budget
    small_disk.remount(f"size=400m,nr_inodes={small_disk.inodes_used() + INODES_AFTER_BUDGET_STOP}")
    code, output = small_disk.run(["resume", "--run-id", RUN_ID])
    problems = _stopped_by_a_full_disk(code, output, small_disk.data_root, "no space left on device")
    assert not problems, "\n".join(problems)
    said += [line for line in output.splitlines() if line.startswith("agentr1: error:")]

    small_disk.remount("nr_inodes=100000")  # space freed: the same run resumes in the same namespace
    code, output = small_disk.run(["resume", "--run-id", RUN_ID])
    # checked in a copy: MLflow's URI resolves /proc/<pid>/root away, to this namespace's empty folder
    copied = shutil.copytree(small_disk.data_root, tmp_path / "copied", symlinks=True)
    assert not (failures := _resumed_like_the_reference(code, output, copied, reference)), "\n".join(failures)
    with capsys.disabled():
        print(f"\n  small disk: budget stop, inode ENOSPC, resumed ({time.perf_counter() - started:.0f} s):",
              flush=True)
        for line in said:
            print(f"    {line[:300]}", flush=True)
