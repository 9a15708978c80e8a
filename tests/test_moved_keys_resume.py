"""Old keys keep working for runs, not only for fresh configs: a run recorded before the runtime
and critic settings left the `trainer:` section (its stored config.yaml has `trainer.max_staleness`,
`trainer.critic_lr`, ...) resumes with nothing redone, because the train stage's manifest compares
those settings under their old names (tasks/train.py `_result_settings`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent_core.config import MOVED_KEYS
from agent_core.io.layout import DataRoot
from flows.cli import main as cli_main
from kill_harness import RUN_ID, train_args


def _manifest_times(run_dir: Path) -> dict[str, int]:
    return {p.relative_to(run_dir).as_posix(): p.stat().st_mtime_ns for p in run_dir.glob("**/_manifests/*.json")}


def _as_recorded_before_the_move(config_path: Path) -> list[str]:
    """Rewrite a stored config with every moved key back at its old place; the old keys moved."""
    data = yaml.safe_load(config_path.read_text())
    moved = []
    for old, new in MOVED_KEYS.items():
        new_section, new_key = new.split(".")
        old_section, old_key = old.split(".")
        if old_section == "trainer" and new_key in data.get(new_section, {}):
            data.setdefault(old_section, {})[old_key] = data[new_section].pop(new_key)
            moved.append(old)
    for section in ("runtime", "critic"):
        if not data.get(section):
            data.pop(section, None)
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return moved


@pytest.mark.slow  # a 1-iteration tiny run (gae: the critic's settings count), then its resume: ~20 s
def test_a_run_recorded_with_the_old_keys_resumes_with_nothing_redone(tmp_path):
    args = [*train_args(), "--set", "iterations=1", "--set", "algorithm.estimator=gae", "--data-root", str(tmp_path)]
    assert cli_main(args) == 0
    run = DataRoot(tmp_path).run(RUN_ID)
    moved = _as_recorded_before_the_move(run.config_path)
    assert sorted(moved) == sorted(k for k in MOVED_KEYS if k.startswith("trainer."))
    before = _manifest_times(run.run_dir)
    assert cli_main(["resume", "--run-id", RUN_ID, "--data-root", str(tmp_path)]) == 0
    # every stage "already complete": nothing retrained (the warnings: tests/test_config.py)
    assert _manifest_times(run.run_dir) == before
