"""Every YAML the project reads is bounded while it is composed (issue 55 items 7 and 9,
agent_core/safe_yaml.py): an alias bomb, nesting thousands deep and a 10,000-digit number are each
refused in one line naming the file and the key, exit code 2, through the real `agentr1` (a 1 KB
bomb as `audit --checks` took 8.2 GB until stopped; `train --config` and `--set` spun over 60 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent_core import safe_yaml
from agent_core.safe_yaml import MAX_DEPTH, MAX_DIGITS, MAX_VALUES, YamlLimitError, load_yaml
from flows.cli import main as cli_main
from test_early_errors import recorded_run
from test_late_errors import _agentr1, _one_line

REPO_ROOT = Path(__file__).resolve().parent.parent
SAFETY_NET_S = 30  # a refused bomb takes well under a second; a bomb let through runs until this kills it
EXPANDS = f"its aliases expand to more than {MAX_VALUES:,} values"
TOO_DEEP = f"a value is nested more than {MAX_DEPTH} levels deep"


def bomb(flow: bool = False) -> str:
    """The billion laughs: 9 levels of 9 aliases each, 9**9 = 387 million values from ~300 bytes."""
    levels = [("l0", "[" + ", ".join(["lol"] * 9) + "]")]
    for k in range(1, 10):
        levels.append((f"l{k}", "[" + ", ".join([f"*l{k - 1}"] * 9) + "]"))
    items = [f"{name}: &{name} {value}" for name, value in levels]
    return "{" + ", ".join(items) + "}" if flow else "\n".join(items) + "\n"


def test_every_yaml_of_the_repo_loads_as_pyyaml_loads_it():
    paths = [p for p in REPO_ROOT.glob("**/*.yaml") if ".venv" not in p.parts and "node_modules" not in p.parts]
    assert len(paths) > 10
    for path in paths:
        text = path.read_text()
        assert load_yaml(text, str(path)) == yaml.safe_load(text), path


def test_anchors_aliases_and_merge_keys_still_load():
    text = "base: &b {lr: 0.1, steps: [1, 2]}\nrun: {<<: *b, lr: 0.2}\ncopy: *b\n"
    assert load_yaml(text, "t") == {"base": {"lr": 0.1, "steps": [1, 2]}, "run": {"lr": 0.2, "steps": [1, 2]},
                                    "copy": {"lr": 0.1, "steps": [1, 2]}}


@pytest.mark.parametrize("text, expected", [
    (bomb(), f"f.yaml: {EXPANDS} (at l5, line 6 column 5)"),
    ("big: &a [" + ", ".join(["x"] * 999) + "]\nmany: [" + ", ".join(["*a"] * 101) + "]\n",
     f"f.yaml: {EXPANDS} (at many, line 2 column 7)"),  # wide, not deep: 101 aliases of 1,000 values
    ("a: &a [1, *a]\n",
     "f.yaml: an alias refers to a value that contains it (it never ends) (at a[1], line 1 column 11)"),
    ("seed: " + "[" * 5000 + "]" * 5000, f"f.yaml: {TOO_DEEP} (at seed, "),
    ("x: " + "[" * 65 + "]" * 65, f"f.yaml: {TOO_DEEP} (at x"),  # the key (PyYAML reads ahead) or its path
    ("checks: [{max: " + "9" * 10_000 + "}]",
     "f.yaml: a number 10,000 characters long, more than 100 (at checks[0].max, line 1 column 16)"),
    ("lr: 0." + "1" * 200, "f.yaml: a number 202 characters long, more than 100 (at lr, line 1 column 5)"),
])
@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pyyaml"])
def test_a_document_past_a_bound_is_refused_in_one_line_naming_the_key(text, expected, libyaml, monkeypatch):
    if not libyaml:  # as where PyYAML is installed without libyaml
        monkeypatch.setattr(safe_yaml, "_CLoader", None)
    with pytest.raises(YamlLimitError) as refused:
        load_yaml(text, "f.yaml")
    assert str(refused.value).startswith(expected) and "\n" not in str(refused.value), str(refused.value)


def test_a_document_at_the_bounds_loads():
    assert load_yaml("x: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1), "t")["x"] is not None
    assert load_yaml(f"n: {'9' * MAX_DIGITS}", "t") == {"n": int("9" * MAX_DIGITS)}
    wide = "big: &a [" + ", ".join(["x"] * 999) + "]\nmany: [" + ", ".join(["*a"] * 98) + "]\n"
    assert len(load_yaml(wide, "t")["many"]) == 98  # 99 x 1,001 values with the lists themselves: under the bound


# ---- through the real `agentr1` ------------------------------------------------------------------


def test_train_dry_run_with_a_bomb_as_config_is_refused_in_one_line(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(bomb())
    done = _agentr1("train", "--dry-run", "--config", str(config), "--data-root", str(tmp_path / "d"),
                    timeout=SAFETY_NET_S)
    assert done.returncode == 2, done.stderr[-2000:]
    _one_line(done.stderr, f"{config}: {EXPANDS} (at l5, line 6")
    assert not (tmp_path / "d").exists()


def test_train_dry_run_with_a_bomb_as_set_value_is_refused_in_one_line(tmp_path):
    done = _agentr1("train", "--dry-run", "--config", "tiny", "--data-root", str(tmp_path / "d"),
                    "--set", f"rollout.env_kwargs={bomb(flow=True)}", timeout=SAFETY_NET_S)
    assert done.returncode == 2, done.stderr[-2000:]
    _one_line(done.stderr, "override 'rollout.env_kwargs={l0: &l0 [lol, lol, lol, lol, lol, lol...'",
              f"{EXPANDS} (at l5, ")


def test_audit_checks_with_a_bomb_is_refused_in_one_line(tmp_path):
    recorded_run(tmp_path, "r")
    checks = tmp_path / "bomb.yaml"
    checks.write_text(bomb())
    done = _agentr1("audit", "--data-root", str(tmp_path), "--run-id", "r", "--checks", str(checks),
                    timeout=SAFETY_NET_S)
    assert done.returncode == 2, done.stderr[-2000:]
    _one_line(done.stderr, f"--checks {checks}: {EXPANDS}")


@pytest.mark.parametrize("text, expected", [
    ("checks: " + "[" * 5000 + "]" * 5000 + "\n",
     f"{TOO_DEEP} (at checks, line 1"),  # was a 2,996-line RecursionError
    ("checks: [{name: mine, sql: 'select 1.0 as value', max: " + "9" * 10_000 + "}]\n",
     "a number 10,000 characters long, more than 100 (at checks[0].max, line 1 column 56)"),
    ("thresholds: {kl: {max: " + "9" * 4000 + "}}\n", "(at thresholds.kl.max, line 1 column 24)"),
])
def test_audit_checks_nested_deep_or_with_a_huge_number_names_file_and_key(tmp_path, capsys, text, expected):
    recorded_run(tmp_path, "r")
    checks = tmp_path / "checks.yaml"
    checks.write_text(text)
    assert cli_main(["audit", "--data-root", str(tmp_path), "--run-id", "r", "--checks", str(checks)]) == 2
    captured = capsys.readouterr()
    _one_line(captured.err, f"--checks {checks}: ", expected)
    assert "Traceback" not in captured.out


def test_a_config_file_with_a_huge_number_names_file_and_key(tmp_path, capsys):
    config = tmp_path / "big.yaml"
    config.write_text("seed: " + "9" * 10_000 + "\n")
    assert cli_main(["train", "--dry-run", "--config", str(config), "--data-root", str(tmp_path / "d")]) == 2
    _one_line(capsys.readouterr().err, f"{config}: a number 10,000 characters long, more than 100 (at seed, line 1")
