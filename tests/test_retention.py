"""Checkpoint retention (agent_core/io/retention.py): the rules by hand, the plan on a real run layout
with real manifests, pruning that leaves every manifest matching, and a pruned path's messages."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent_core.config import CheckpointsConfig, PipelineConfig
from agent_core.config_errors import ConfigError
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.manifests import ABSENT, StageRecord, fingerprint, output_size
from agent_core.io.locks import sweep_temporaries
from agent_core.io.retention import (apply_prune, committed_iterations, kept_iterations, plan_prune, prune_path,
                                     reading_checkpoints)
from agent_core.io.tombstones import Tombstone, pruned_message, read_tombstone, tombstone_json, tombstone_path
from agent_core.validation import parse_config


def test_the_rules_by_hand():
    committed = [0, 1, 2, 3, 4, 5]
    policy = CheckpointsConfig(keep_last=2, keep_every=3, keep_best=True)
    kept = kept_iterations(committed, policy, {1: 0.5, 3: 0.5, 4: 0.2})
    # last two: 4, 5; every third: 2 (and 5); best: 3 (ties with 1 go to the later)
    assert sorted(kept) == [2, 3, 4, 5]
    assert kept[5].startswith("newest") and "keep_every=3" in kept[2] and "best dev EM 0.500" in kept[3]
    assert sorted(kept_iterations(committed, CheckpointsConfig(), {})) == [5]
    assert sorted(kept_iterations(committed, CheckpointsConfig(keep_best=False), {1: 0.9})) == [5]
    assert sorted(kept_iterations(committed, CheckpointsConfig(keep_all=True, keep_last=1), {})) == committed
    assert kept_iterations([], CheckpointsConfig(), {}) == {}


def test_the_rules_are_invariant_to_the_order_of_the_scores():
    scores = {0: 0.1, 2: 0.3, 4: 0.3}
    forward = kept_iterations([0, 1, 2, 3, 4, 5], CheckpointsConfig(), scores)
    backward = kept_iterations([0, 1, 2, 3, 4, 5], CheckpointsConfig(), dict(reversed(list(scores.items()))))
    assert forward == backward and sorted(forward) == [4, 5]


def test_a_misspelt_key_fails_at_load_with_the_valid_ones():
    with pytest.raises(ConfigError, match="keep_last"):
        parse_config({"checkpoints": {"keep_lats": 2}})
    assert PipelineConfig().checkpoints == CheckpointsConfig()


def _committed_iteration(run: RunLayout, k: int) -> None:
    """Iteration k as the train stage leaves it: a checkpoint folder, an optimizer state, a train
    manifest that reads k-1's and records its own."""
    checkpoint, optimizer = run.checkpoint_dir(k), run.optimizer_state_path(k)
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(bytes([k]) * 1000)
    optimizer.write_bytes(bytes([k]) * 3000)
    inputs = {"policy": run.policy_dir_before(k), "optimizer": run.optimizer_state_path(k - 1) if k else None}
    StageRecord(run.manifest_path("train", k), "train", inputs=inputs, params={"k": k}).commit(
        {"checkpoint": checkpoint, "optimizer": optimizer})


@pytest.fixture
def run(tmp_path) -> RunLayout:
    run = DataRoot(tmp_path).run("r")
    run.initial_policy_dir.mkdir(parents=True)
    (run.initial_policy_dir / "model.safetensors").write_bytes(b"start")
    return run


def test_pruning_keeps_the_newest_and_every_manifest_still_matches(run):
    for k in range(4):
        _committed_iteration(run, k)
    records = {k: StageRecord(run.manifest_path("train", k), "train", params={"k": k}, inputs={
        "policy": run.policy_dir_before(k), "optimizer": run.optimizer_state_path(k - 1) if k else None})
        for k in range(4)}
    plan = plan_prune(run, CheckpointsConfig())
    assert [(item.kind, item.iteration) for item in plan.items] == [
        ("checkpoint", 0), ("optimizer", 0), ("checkpoint", 1), ("optimizer", 1), ("checkpoint", 2), ("optimizer", 2)]
    assert plan.bytes == 3 * (1000 + 3000) and plan.newest == 3
    before = {k: fingerprint(run.checkpoint_dir(k)) for k in range(4)}
    apply_prune(plan)
    assert [k for k in range(4) if run.checkpoint_dir(k).exists()] == [3] and run.optimizer_state_path(3).is_file()
    for k in range(3):  # a resume skips every stage: inputs and outputs read through the tombstones
        assert fingerprint(run.checkpoint_dir(k)) == before[k] and output_size(run.checkpoint_dir(k)) == 1000
        assert records[k].completed() is not None and records[k + 1].completed() is not None
    assert plan_prune(run, CheckpointsConfig()).items == ()  # nothing more to do: pruning again is a no-op


def test_keep_all_prunes_nothing_and_the_switch_matters(run):
    for k in range(3):
        _committed_iteration(run, k)
    assert plan_prune(run, CheckpointsConfig(keep_all=True)).items == ()
    assert plan_prune(run, CheckpointsConfig(keep_last=3)).items != ()  # optimizer states still go
    assert {i.kind for i in plan_prune(run, CheckpointsConfig(keep_last=3)).items} == {"optimizer"}
    assert len(plan_prune(run, CheckpointsConfig()).items) == 4


def test_an_uncommitted_iteration_is_never_a_candidate(run):
    for k in range(2):
        _committed_iteration(run, k)
    run.checkpoint_dir(2).mkdir(parents=True)  # iteration 2's training is under way: no manifest yet
    (run.checkpoint_dir(2) / "model.safetensors").write_bytes(b"half")
    plan = plan_prune(run, CheckpointsConfig())
    assert {item.iteration for item in plan.items} == {0} and plan.newest == 1


def test_a_pinned_iteration_stays(run):
    for k in range(3):
        _committed_iteration(run, k)
    plan = plan_prune(run, CheckpointsConfig(), pinned=frozenset({0}))
    assert [(i.kind, i.iteration) for i in plan.items] == [("optimizer", 0), ("checkpoint", 1), ("optimizer", 1)]
    assert plan.kept[0] == "in use by a reader"


def test_each_state_a_killed_prune_leaves_is_read_right_and_finished(run):
    """Killed after the tombstone (path still there), or after the rename (a hidden temporary)."""
    for k in range(2):
        _committed_iteration(run, k)
    target = run.checkpoint_dir(0)
    recorded = fingerprint(target)
    tombstone_path(target).write_text(tombstone_json(Tombstone(recorded, 1000, "test", 0.0)))  # killed here
    assert fingerprint(target) == recorded and pruned_message(target) is None  # still there: read as itself
    hidden = target.with_name(".checkpoint.tmp-0a1b2c3d")
    target.rename(hidden)  # killed after the rename
    assert fingerprint(target) == recorded != ABSENT and "pruned by checkpoint retention (test)" in pruned_message(target)
    assert sweep_temporaries(run.run_dir) == [hidden] and not hidden.exists()  # the resume's sweep
    prune_path(run.optimizer_state_path(0), "test")  # the rerun prune finishes the rest
    assert read_tombstone(run.optimizer_state_path(0)) is not None and not run.optimizer_state_path(0).exists()
    assert pruned_message(run.checkpoint_dir(1)) is None  # not pruned


def test_a_rewritten_path_reads_as_itself_not_as_its_old_tombstone(run):
    _committed_iteration(run, 0)
    _committed_iteration(run, 1)
    prune_path(run.checkpoint_dir(0), "test")
    run.checkpoint_dir(0).mkdir()  # the stage redone later writes it again
    (run.checkpoint_dir(0) / "model.safetensors").write_bytes(b"new")
    assert fingerprint(run.checkpoint_dir(0)) != read_tombstone(run.checkpoint_dir(0)).fingerprint
    assert pruned_message(run.checkpoint_dir(0)) is None


def test_best_by_dev_em_is_read_from_the_dev_eval_tables(run):
    for k in range(4):
        _committed_iteration(run, k)
    for k, scores in ((1, [1.0, 0.0]), (2, [0.0, 0.5])):  # what dev_eval writes, as far as EM goes
        pq.write_table(pa.table({"em": scores, "f1": scores}), run.dev_eval_uri(k))
    plan = plan_prune(run, CheckpointsConfig())
    assert sorted(plan.kept) == [1, 3] and {i.iteration for i in plan.items if i.kind == "checkpoint"} == {0, 2}
    assert sorted(plan_prune(run, CheckpointsConfig(keep_best=False)).kept) == [3]


def test_a_checkpoint_an_evaluation_reads_is_left_for_a_later_prune(run):
    for k in range(2):
        _committed_iteration(run, k)
    with reading_checkpoints([run.checkpoint_dir(0)]):
        done = apply_prune(plan_prune(run, CheckpointsConfig()))
        assert [(i.kind, i.iteration) for i in done.items] == [("optimizer", 0)]
        assert done.kept[0] == "in use by a reader" and run.checkpoint_dir(0).is_dir()
    done = apply_prune(plan_prune(run, CheckpointsConfig()))  # the reader is gone: the next prune takes it
    assert [(i.kind, i.iteration) for i in done.items] == [("checkpoint", 0)] and not run.checkpoint_dir(0).exists()
    with pytest.raises(FileNotFoundError):
        with reading_checkpoints([run.checkpoint_dir(0)]):
            pass


def test_the_initial_policy_goes_once_a_warm_started_policy_replaced_it(run):
    StageRecord(run.manifest_path("init_policy"), "init_policy", inputs={}, params={}).commit(
        {"policy": run.initial_policy_dir})
    _committed_iteration(run, 0)
    assert {i.kind for i in plan_prune(run, CheckpointsConfig()).items} == set()  # no warm start: it is the start
    run.warm_start_policy_dir.mkdir()
    (run.warm_start_policy_dir / "model.safetensors").write_bytes(b"warm")
    StageRecord(run.manifest_path("warm_start"), "warm_start", inputs={"policy": run.initial_policy_dir},
                params={}).commit({"policy": run.warm_start_policy_dir})
    warm = StageRecord(run.manifest_path("warm_start"), "warm_start", inputs={"policy": run.initial_policy_dir}, params={})
    assert plan_prune(run, CheckpointsConfig(keep_all=True)).items == ()
    apply_prune(plan_prune(run, CheckpointsConfig()))
    assert not run.initial_policy_dir.exists() and run.has_initial_policy and run.start_policy_dir == run.warm_start_policy_dir
    assert warm.completed() is not None  # the warm start's input reads through the tombstone


def test_a_later_iteration_trained_from_an_older_policy_is_not_committed(run):
    """A resume with a changed setting retrained iteration 0; iteration 1's manifest read the old
    checkpoint 0 and will rerun, so the new checkpoint 0 is what resume reads next: it stays."""
    for k in range(3):
        _committed_iteration(run, k)
    shutil.rmtree(run.checkpoint_dir(0))
    run.optimizer_state_path(0).unlink()
    run.checkpoint_dir(0).mkdir()
    (run.checkpoint_dir(0) / "model.safetensors").write_bytes(b"retrained" * 100)
    run.optimizer_state_path(0).write_bytes(b"retrained")
    StageRecord(run.manifest_path("train", 0), "train", inputs={"policy": run.initial_policy_dir}, params={}).commit(
        {"checkpoint": run.checkpoint_dir(0), "optimizer": run.optimizer_state_path(0)})
    assert committed_iterations(run) == [0]
    assert plan_prune(run, CheckpointsConfig()).items == ()
