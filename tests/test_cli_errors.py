"""Bad command-line input fails early: exit code 2, one line on stderr, no traceback, nothing created,
and before a Prefect server is started."""

from __future__ import annotations

import pytest

import flows.cli as cli
from flows.cli import main as cli_main


@pytest.fixture
def no_server(monkeypatch):
    """Fail the test if a command got as far as configuring Prefect (which starts its server)."""
    def started(*args, **kwargs):
        raise AssertionError("the command configured Prefect before rejecting its input")
    monkeypatch.setattr(cli, "configure_environment", started)


def _one_line_error(capsys, expected: str) -> None:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentr1: error: ") and expected in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_unknown_stage(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    assert cli_main(["rerun", "--run-id", "r", "--iteration", "0", "--stage", "rollut", "--data-root", str(root)]) == 2
    _one_line_error(capsys, "unknown --stage 'rollut'; valid stages: prepare_data, rollout")
    assert not root.exists()


def test_rerun_of_a_run_that_does_not_exist(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    assert cli_main(["rerun", "--run-id", "nope", "--iteration", "0", "--stage", "rollout", "--data-root", str(root)]) == 2
    _one_line_error(capsys, "no run 'nope' under")
    assert not root.exists()


def test_a_data_root_that_is_a_file(tmp_path, capsys, no_server):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli_main(["train", "--config", "tiny", "--data-root", str(afile)]) == 2
    _one_line_error(capsys, "is a file; it must be a folder")
    assert afile.read_text() == "x"


def test_query_on_a_data_root_without_tables(tmp_path, capsys):
    root = tmp_path / "empty"
    assert cli_main(["query", "select 1", "--data-root", str(root)]) == 2
    _one_line_error(capsys, f"no tables under {root}")
    assert not root.exists()


@pytest.mark.parametrize("overrides, expected", [
    (["rollout.group_size=abc"], "rollout.group_size (set by --set rollout.group_size=abc): got 'abc'; it must be a valid integer"),
    (["policy.source=pth"], "policy.source (set by --set policy.source=pth): got 'pth'; it must be 'tiny', 'path' or 'smollm2'"),
    (["rollout.temperature=-1"], "rollout.temperature (set by --set rollout.temperature=-1): got -1; it must be greater than or equal to 0"),
    (["rollout.group_siz=3"], "unknown config key 'rollout.group_siz'; valid keys here: engine, vllm, hf, group_size"),
    (["trainer=3"], "trainer (set by --set trainer=3): got 3; it must be a section"),
    (["algorithm.estimator=grpoo"], "algorithm.estimator (set by --set algorithm.estimator=grpoo): unknown advantage estimator 'grpoo'; valid"),
    (["rollout.env_kwargs={tools: [search"], "override 'rollout.env_kwargs={tools: [search': its value is not valid YAML"),
    (["policy.source=path", "policy.path=Qwen/Qwen2-0.5B"], "'Qwen/Qwen2-0.5B' is not a local folder; it looks like a Hugging Face Hub id"),
    (["policy.source=path", "policy.path=no/such/dir/here"], "checkpoint directory no/such/dir/here does not exist"),
    (["policy.source=path"], "policy.source=path needs policy.path"),
    (["rollout.engine=vllm", "rollout.vllm.python=/no/vllm/bin/python"], "run `make vllm`"),
])
def test_a_bad_override_is_blamed_in_one_line_before_anything_starts(tmp_path, capsys, no_server, overrides, expected):
    root = tmp_path / "data"
    argv = ["train", "--config", "tiny", "--data-root", str(root)]
    for item in overrides:
        argv += ["--set", item]
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    line = captured.err.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in captured.err + captured.out, captured.err
    assert line.startswith("agentr1: error: ") and expected.lower() in line.lower(), line
    assert "errors.pydantic.dev" not in line and "[type=" not in line  # pydantic's noise is trimmed
    assert not root.exists()  # nothing created: no data root, no run folder


def test_a_bad_value_in_a_config_file_blames_the_file_not_an_override(tmp_path, capsys, no_server):
    config = tmp_path / "mine.yaml"
    config.write_text("rollout:\n  group_size: many\n")
    assert cli_main(["train", "--config", str(config), "--set", "seed=3", "--data-root", str(tmp_path / "data")]) == 2
    _one_line_error(capsys, f"rollout.group_size (set by {config}): got 'many'")


def test_the_train_flow_checks_the_policy_path_before_it_makes_a_run_folder(tmp_path):
    from agent_core.config import ConfigError
    from agent_core.validation import build_config
    from flows.train import train

    root = tmp_path / "data"
    config = build_config({"data_root": str(root), "run_id": "r1", "policy": {"source": "path", "path": "org/model"}})
    with pytest.raises(ConfigError, match="looks like a Hugging Face Hub id"):
        train.fn(config)
    assert not (root / "runs").exists()
