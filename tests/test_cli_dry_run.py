"""`agentr1 train --dry-run`: the resolved config, checked and printed, and nothing started or written."""

from __future__ import annotations

from pathlib import Path

import yaml

from agent_core.validation import build_config, load_config
from flows.cli import main as cli_main

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    data_root = tmp_path / "data"
    code = cli_main(["train", "--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--set", "trainer.lr=0.002",
                     "--run-id", "dry", "--data-root", str(data_root), "--dry-run"])
    assert code == 0
    printed = build_config(yaml.safe_load(capsys.readouterr().out))
    expected = load_config(REPO_ROOT / "configs" / "tiny.yaml",
                           ["trainer.lr=0.002", "run_id=dry", f"data_root={data_root}"])
    assert printed == expected and printed.trainer.lr == 0.002
    assert not data_root.exists()


def test_dry_run_still_refuses_a_bad_config(tmp_path, capsys):
    code = cli_main(["train", "--set", "trainer.policy_loss=ppo", "--data-root", str(tmp_path / "d"), "--dry-run"])
    assert code == 2
    assert "unknown policy loss 'ppo'; valid policy loss names: gspo, ppo_clip" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
