"""A whole run on a local Ray cluster (docs/scale-out.md): 2 inference replicas, 2 data-parallel
training workers, staleness 1 (rollout k+1 overlaps training k); then the data-parallel step
against the single-process one through real Ray workers, and the stored behaviour log-probs.

Slow: Ray starts in ~5 s and every actor imports torch. Ray's processes carry a marker in their
environment, so the test can tell that none of them outlives the run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from agent_core.io.layout import DataRoot
from agent_core.io.tables import read_table, write_table
from agent_core.training.iteration import TrainJob, job_sequences, run_training
from tasks.train import StaleStepsError, check_staleness

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parent.parent
AGENTR1 = str(Path(sys.executable).with_name("agentr1"))
RUN_ID = "scale-out"


def _ray():
    try:
        import ray
    except ImportError:
        pytest.fail('Ray is missing: `make ray` (pip install -e ".[ray]") installs it; make test-slow does')
    return ray


def _marked_processes(marker: str) -> list[str]:
    """Command lines of the processes whose environment holds `marker` (every Ray process of the run)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(environ.with_name("cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    _ray()
    data_root = tmp_path_factory.mktemp("scale-out") / "data"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must fit 107 bytes
    marker = f"agentr1-test-{uuid.uuid4().hex}"
    env = {**os.environ, "AGENTR1_RAY_TEMP_DIR": temp_dir, "AGENTR1_TEST_MARKER": marker, "RAY_AUTH_MODE": "disabled"}
    overrides = ["cluster.address=local", "cluster.num_cpus=2", "cluster.rollout_replicas=2", "cluster.replica_cpus=0.5",
                 "cluster.worker_cpus=0.5",
                 "cluster.trainer_workers=2", "iterations=3", "runtime.max_staleness=1", "trainer.epochs=30",
                 "dev_eval.every=0",
                 "checkpoints.keep_all=true"]  # the tests below rebuild iteration 2's job from checkpoint 1
    command = [AGENTR1, "train", "--config", "tiny", "--data-root", str(data_root), "--run-id", RUN_ID]
    for item in overrides:
        command += ["--set", item]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    deadline, lingering = time.monotonic() + 30, _marked_processes(marker)
    while lingering and time.monotonic() < deadline:  # ray.shutdown returns before its last agents exit
        time.sleep(1)
        lingering = _marked_processes(marker)
    yield data_root, lingering, done.stdout + done.stderr
    shutil.rmtree(temp_dir, ignore_errors=True)


def _tables(data_root: Path, name: str) -> list[dict]:
    run = DataRoot(data_root).run(RUN_ID)
    return [row for k in range(3) for row in read_table(name, run.table_uri(k, name)).to_pylist()]  # validated


def test_a_run_on_local_ray_completes_with_valid_tables_and_no_process_left(cluster_run):
    data_root, lingering, log = cluster_run
    assert lingering == []
    steps = _tables(data_root, "steps")
    assert {s["served_by"] for s in steps} == {"replica-0", "replica-1"}
    assert "2 training workers joined (gloo)" in log
    for name in ("rewards", "advantages", "train_metrics"):
        assert _tables(data_root, name)


def test_the_policy_version_of_every_step_is_the_one_served_and_one_behind(cluster_run):
    data_root, _, _ = cluster_run
    versions = {(s["iteration"], s["policy_version"]) for s in _tables(data_root, "steps")}
    assert versions == {(0, 0), (1, 0), (2, 1)}  # staleness 1: rollout k+1 used the policy before training k
    shown = subprocess.run([AGENTR1, "query", "--data-root", str(data_root),
                            "select iteration, policy_version, served_by, count(*) as steps from steps "
                            "group by all order by all"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    lines = [line.split() for line in shown.stdout.splitlines()]
    assert ["2", "1", "replica-0"] == lines[-3][:3] or ["2", "1", "replica-1"] == lines[-2][:3], shown.stdout


def test_rollout_of_the_next_iteration_starts_before_training_ends(cluster_run):
    data_root, _, _ = cluster_run
    steps, metrics = _tables(data_root, "steps"), _tables(data_root, "train_metrics")
    for k in (0, 1):
        first_step_next = min(s["generated_at"] for s in steps if s["iteration"] == k + 1)
        trained = [m for m in metrics if m["iteration"] == k]
        assert trained[0]["started_at"] < first_step_next < trained[0]["finished_at"], k


def test_stale_steps_beyond_the_cap_are_refused(cluster_run):
    data_root, _, _ = cluster_run
    uri = DataRoot(data_root).run(RUN_ID).table_uri(2, "steps")
    assert check_staleness(uri, 2, max_staleness=1) == 1
    with pytest.raises(StaleStepsError, match=r"18 of 18 steps come from policy version 1, 1 behind; "
                                              r"runtime.max_staleness=0"):
        check_staleness(uri, 2, max_staleness=0)
    assert check_staleness(uri, 1, max_staleness=0) == 0


def test_training_on_stale_steps_uses_their_stored_behaviour_logprobs(cluster_run, tmp_path):
    """The ratio's denominator is what the behaviour policy sampled with, not the trained policy's."""
    data_root, _, _ = cluster_run
    run = DataRoot(data_root).run(RUN_ID)
    job = _job(run, 2, tmp_path, "token-mean")
    stored = [lp for s in _tables(data_root, "steps") if s["iteration"] == 2 for lp in s["response_logprobs"]]
    sequences = job_sequences(job)
    old = [lp for q in sequences for lp, a in zip(q.old_logprobs, q.action_mask) if a]
    assert sorted(old) == pytest.approx(sorted(stored), abs=1e-6)
    # the tiny run's policy barely moves, so make the behaviour policy visibly different: stored
    # log-probs 0.5 lower mean ratio exp(0.5) > 1 + clip on every action token
    job = _with_signal(job, tmp_path)
    table = pq.read_table(job.steps_uri)
    lowered = [[lp - 0.5 for lp in row] for row in table.column("response_logprobs").to_pylist()]
    rows = table.set_column(table.schema.get_field_index("response_logprobs"), "response_logprobs",
                            pa.array(lowered, table.schema.field("response_logprobs").type)).to_pylist()
    shifted = dataclasses.replace(job, steps_uri=write_table("steps", rows, str(tmp_path / "steps.parquet")),
                                  checkpoint_dir=str(tmp_path / "shifted"), optimizer_out=str(tmp_path / "shifted.pt"))
    (as_stored,), _ = run_training(job)
    (as_shifted,), _ = run_training(shifted)
    # ratio 1 clips nothing; ratio e^0.5 clips every token whose advantage is positive (about half)
    assert as_stored.clipfrac == 0 and as_stored.kl == pytest.approx(0, abs=1e-6)
    assert as_shifted.clipfrac > 0.3 and as_shifted.kl > 0.1


def _job(run, iteration: int, out: Path, agg_mode: str) -> TrainJob:
    """The run's training job of `iteration` (tiny's trainer settings), writing under `out`."""
    from agent_core.config import AlgorithmConfig, TrainerConfig
    from tasks.train import train_job

    policy = run.initial_policy_dir if iteration == 0 else run.checkpoint_dir(iteration - 1)
    trainer = TrainerConfig(mini_batches=1, lr=3e-4, loss_agg_mode=agg_mode)
    job = train_job(run, iteration, run.table_uri(iteration, "steps"), run.table_uri(iteration, "advantages"),
                    str(policy), trainer, AlgorithmConfig(), 1.0, 1)
    return dataclasses.replace(job, checkpoint_dir=str(out / "checkpoint"), optimizer_out=str(out / "optimizer.pt"))


def _with_signal(job: TrainJob, out: Path) -> TrainJob:
    """The job on a copy of its advantages with a random signal (a tiny run's GRPO groups often have none)."""
    table = pq.read_table(job.advantages_uri)
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(len(a), generator=generator).tolist() for a in table.column("advantages").to_pylist()]
    rows = table.set_column(table.schema.get_field_index("advantages"), "advantages",
                            pa.array(values, table.schema.field("advantages").type)).to_pylist()
    return dataclasses.replace(job, advantages_uri=write_table("advantages", rows, str(out / "advantages.parquet")))


# One aggregation through Ray (a start of two workers is ~25 s): every mode's two-worker step
# against one process is tests/test_data_parallel.py's (the same DDP step, without Ray).
@pytest.mark.parametrize("agg_mode", ["seq-mean-token-mean"])
def test_two_ray_workers_train_the_parameters_of_one_process(cluster_run, tmp_path, agg_mode):
    from agent_core.cluster.runtime import ClusterSpec, connect, disconnect
    from agent_core.cluster.trainers import TrainerGroup, TrainerSpec

    data_root, _, _ = cluster_run
    run = DataRoot(data_root).run(RUN_ID)
    job = _with_signal(_job(run, 0, tmp_path / "single", agg_mode), tmp_path)
    run_training(job)
    parallel = dataclasses.replace(job, checkpoint_dir=str(tmp_path / "dp" / "checkpoint"),
                                   optimizer_out=str(tmp_path / "dp" / "optimizer.pt"))
    os.environ.setdefault("AGENTR1_RAY_TEMP_DIR", tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    connect(ClusterSpec("local", num_cpus=2))
    try:
        group = TrainerGroup(TrainerSpec(workers=2))
        try:
            results, _ = group.train(parallel)
        finally:
            group.shutdown()
    finally:
        disconnect()
    single = load_file(str(Path(job.checkpoint_dir) / "model.safetensors"))
    dp = load_file(str(Path(parallel.checkpoint_dir) / "model.safetensors"))
    original = load_file(str(Path(job.policy_dir) / "model.safetensors"))
    assert single.keys() == dp.keys()
    assert any(not torch.equal(single[k], original[k]) for k in single)  # the step changed something
    for key in single:
        torch.testing.assert_close(dp[key], single[key], atol=1e-6, rtol=1e-5, msg=key)
    assert not any(r.skipped for r in results)


def test_staleness_one_overlaps_rollout_and_training_without_a_cluster_too(tmp_path):
    """The overlap is the flow's (a Prefect task submitted to its thread pool), not Ray's."""
    data_root = tmp_path / "data"
    command = [AGENTR1, "train", "--config", "tiny", "--data-root", str(data_root), "--run-id", RUN_ID,
               "--set", "iterations=3", "--set", "runtime.max_staleness=1", "--set", "trainer.epochs=30",
               "--set", "dev_eval.every=0"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps, metrics = _tables(data_root, "steps"), _tables(data_root, "train_metrics")
    assert {(s["iteration"], s["policy_version"]) for s in steps} == {(0, 0), (1, 0), (2, 1)}
    assert {s["served_by"] for s in steps} == {None}
    for k in (0, 1):
        trained = [m for m in metrics if m["iteration"] == k][0]
        assert trained["started_at"] < min(s["generated_at"] for s in steps if s["iteration"] == k + 1) < trained["finished_at"]


def test_a_training_worker_error_is_raised_as_itself_and_stops_the_group(cluster_run, tmp_path):
    from agent_core.cluster.runtime import ClusterSpec, connect, disconnect
    from agent_core.cluster.trainers import TrainerGroup, TrainerSpec
    from agent_core.io.checkpoints import CheckpointError

    data_root, _, _ = cluster_run
    job = _job(DataRoot(data_root).run(RUN_ID), 0, tmp_path, "token-mean")
    broken = dataclasses.replace(job, policy_dir=str(tmp_path / "no-such-policy"))
    os.environ.setdefault("AGENTR1_RAY_TEMP_DIR", tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    connect(ClusterSpec("local", num_cpus=2))
    try:
        group = TrainerGroup(TrainerSpec(workers=2))
        with pytest.raises(CheckpointError, match="no-such-policy does not exist"):
            group.train(broken)
        ray = _ray()
        with pytest.raises(ray.exceptions.RayActorError):  # stopped: its workers are gone
            ray.get(group.workers[0].address.remote(), timeout=60)
    finally:
        disconnect()
    assert not Path(job.checkpoint_dir).exists()  # nothing written
