"""Errors before anything starts (issue 29, item 4): a policy path without its source, a YAML syntax
error, an unknown registered model, version or alias, a run another process is writing, a bad
deployment parameter; and Ctrl-C during a run says how to resume it. Each early error: exit code 2,
one line, nothing created under the data root, no Prefect server started."""

from __future__ import annotations

import fcntl
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import flows.cli as cli
from agent_core.config import ConfigError
from agent_core.io.config_files import save_config
from agent_core.io.layout import DataRoot
from agent_core.validation import build_config, load_config
from flows.cli import main as cli_main

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = REPO_ROOT / "configs" / "tiny.yaml"

# MLflow 3.17's SQLAlchemy store triggers this deprecation itself; nothing for us to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def _one_line_error(capsys, *expected: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentr1: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out, captured.err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def recorded_run(root: Path, run_id: str = "r1") -> Path:
    """A run folder with its recorded config, as a run that started writes it (nothing else)."""
    config = load_config(TINY, [f"data_root={root}", f"run_id={run_id}"])
    run = DataRoot(root).run(run_id)
    run.config_path.parent.mkdir(parents=True)
    save_config(config, run.config_path)
    return run.run_dir


# ---- policy.path without policy.source: path -------------------------------------------------------


def test_a_policy_path_with_the_tiny_source_is_refused_naming_both_keys(tmp_path, capsys, no_server):
    root, model = tmp_path / "data", tmp_path / "model"
    model.mkdir()
    assert cli_main(["train", "--config", "tiny", "--data-root", str(root), "--set", f"policy.path={model}"]) == 2
    _one_line_error(capsys, f"(set by --set policy.path={model})", "policy.path", "policy.source is 'tiny'",
                    "set policy.source=path")
    assert not root.exists()


def test_a_policy_path_in_a_file_is_blamed_on_the_file(tmp_path, capsys, no_server):
    config = tmp_path / "mine.yaml"
    config.write_text("policy:\n  path: /some/model\n")
    assert cli_main(["train", "--config", str(config), "--data-root", str(tmp_path / "data")]) == 2
    _one_line_error(capsys, f"policy (set by {config}): policy.path=/some/model is set but policy.source is 'tiny'")
    with pytest.raises(ConfigError, match="policy.source is 'tiny'"):  # any loader, not only the command
        build_config({"policy": {"source": "tiny", "path": "/some/model"}})
    assert build_config({"policy": {"source": "smollm2", "path": "/some/model"}}).policy.path == "/some/model"


# ---- a YAML syntax error -----------------------------------------------------------------------------


def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, capsys, no_server):
    config = tmp_path / "broken.yaml"
    config.write_text("rollout:\n  group_size: 3\n   engine: hf\n")
    root = tmp_path / "data"
    assert cli_main(["train", "--config", str(config), "--data-root", str(root)]) == 2
    _one_line_error(capsys, f"{config}:3:10: not valid YAML: mapping values are not allowed here")
    assert not root.exists()


# ---- registered models, versions and aliases ---------------------------------------------------------


@pytest.fixture(scope="module")
def registry_root(tmp_path_factory) -> Path:
    """A recorded run and an MLflow store with model `early-policy`: version 1 (its files are never
    read: every lookup below fails before a download) and no aliases."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("registry")
    recorded_run(root)
    client = MlflowClient(DataRoot(root).mlflow_tracking_uri, registry_uri=DataRoot(root).mlflow_tracking_uri)
    client.create_registered_model("early-policy")
    client.create_model_version("early-policy", source=(root / "nowhere").as_uri())
    return root


@pytest.mark.parametrize("uri, expected", [
    ("models:/nope@best", "no registered model 'nope' in sqlite:"),
    ("models:/early-policy@best", "model 'early-policy' has no alias 'best'; its aliases: (none)"),
    ("models:/early-policy/7", "model 'early-policy' has no version 7; its versions: 1"),
])
def test_an_unknown_model_version_or_alias_fails_before_prefect(registry_root, capsys, no_server, uri, expected):
    before = _files(registry_root)
    started = time.perf_counter()
    assert cli_main(["eval", "--run-id", "r1", "--data-root", str(registry_root), "--checkpoint", uri]) == 2
    _one_line_error(capsys, expected)
    assert time.perf_counter() - started < 15  # was 25 s: the temporary server started first
    assert _files(registry_root) == before  # no models/ cache, no PREFECT_HOME


# ---- the run's writer lock ---------------------------------------------------------------------------


@pytest.fixture
def locked_run(tmp_path):
    """A recorded run whose lock another holder has (this test's own open file: flock is per open file)."""
    root = tmp_path / "data"
    run_dir = recorded_run(root)
    with open(run_dir / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.write("4242\n")
        handle.flush()
        yield root


@pytest.mark.parametrize("argv", [
    ["resume", "--run-id", "r1"],
    ["train", "--config", "tiny", "--run-id", "r1"],
    ["rerun", "--run-id", "r1", "--iteration", "0", "--stage", "rollout"],
])
def test_a_second_writer_fails_at_once_in_one_line(locked_run, capsys, no_server, argv):
    before = _files(locked_run)
    started = time.perf_counter()
    assert cli_main([*argv, "--data-root", str(locked_run)]) == 2
    assert time.perf_counter() - started < 10  # was 35 s and a traceback
    _one_line_error(capsys, "run 'r1' is being written by another process (pid 4242; lock ")
    assert _files(locked_run) == before


# ---- a bad deployment parameter ----------------------------------------------------------------------


def test_a_deployment_override_is_blamed_as_a_deployment_parameter(tmp_path):
    from flows.deployments import train_from_config

    root = tmp_path / "data"
    with pytest.raises(ConfigError) as caught:
        train_from_config.fn(config=str(TINY), overrides=["rollout.group_size=abc"], data_root=str(root))
    message = str(caught.value)
    assert "rollout.group_size (set by deployment parameter overrides: rollout.group_size=abc)" in message, message
    assert "--set" not in message
    assert not root.exists()


def test_the_data_root_option_is_blamed_as_itself():
    from agent_core.config_errors import Override, value_origin

    overrides = ["seed=3", Override("data_root=/x", "--data-root /x")]
    assert value_origin("data_root", "tiny.yaml", overrides) == "--data-root /x"
    assert value_origin("seed", "tiny.yaml", overrides) == "--set seed=3"
    assert value_origin("rollout.group_size", "tiny.yaml", overrides) == "tiny.yaml"


# ---- Ctrl-C ------------------------------------------------------------------------------------------


def _flow_interrupted_after_it_recorded_its_config(config):
    """The train flow, interrupted where a Ctrl-C lands: after its first stage wrote the run's config."""
    run = DataRoot(Path(config.data_root)).run(config.run_id)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run.config_path)
    raise KeyboardInterrupt


@pytest.fixture
def flow_interrupted(monkeypatch):
    monkeypatch.setattr(cli, "configure_environment", lambda data_root: None)
    monkeypatch.setattr(cli, "start_temporary_server", lambda: None)
    monkeypatch.setattr("flows.train.train", _flow_interrupted_after_it_recorded_its_config)


def _one_interrupted_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err + captured.out, captured.err
    assert lines[0].startswith("agentr1: interrupted: run r1 stopped"), lines[0]
    return lines[0]


@pytest.mark.parametrize("command", ["train", "resume"])
def test_ctrl_c_during_a_run_prints_the_resume_command_and_exits_130(tmp_path, capsys, flow_interrupted, command):
    root = tmp_path / "data"
    if command == "resume":
        recorded_run(root)
    argv = ["train", "--config", "tiny"] if command == "train" else ["resume"]
    assert cli_main([*argv, "--run-id", "r1", "--data-root", str(root)]) == 130
    assert f"`agentr1 resume --run-id r1 --data-root {root.resolve()}`" in _one_interrupted_line(capsys)


def test_ctrl_c_before_the_run_recorded_anything_says_to_start_it_again(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "configure_environment", lambda data_root: None)
    monkeypatch.setattr(cli, "start_temporary_server", _raise_keyboard_interrupt)  # while the server starts
    assert cli_main(["train", "--config", "tiny", "--run-id", "r1", "--data-root", str(tmp_path / "data")]) == 130
    assert "before it recorded anything: run the same command again" in _one_interrupted_line(capsys)


def _raise_keyboard_interrupt(*args, **kwargs):
    raise KeyboardInterrupt


class _Output:
    """A child's output lines, read on a thread, so that waiting for one line can time out."""

    def __init__(self, process: subprocess.Popen):
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=lambda: [self.lines.put(line) for line in process.stdout], daemon=True)
        self.reader.start()

    def until(self, marker: str, timeout: float) -> None:
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                seen.append(self.lines.get(timeout=1))
            except queue.Empty:
                continue
            if marker in seen[-1]:
                return
        raise AssertionError(f"no {marker!r} within {timeout}s: {''.join(seen[-20:])}")

    def rest(self) -> str:
        self.reader.join(timeout=10)  # the child has exited: its output ends
        return "".join(self.lines.get() for _ in range(self.lines.qsize()))


@pytest.mark.slow  # ~15 s alone (the temporary server starts), more on a busy machine
def test_a_real_ctrl_c_on_the_terminal_s_process_group_says_how_to_resume(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the temporary server is in
    its own group and outlives it, so the flow records its crash and the command exits in seconds
    (it used to retry the dead server for a minute, then print a traceback)."""
    root = tmp_path / "data"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", str(TINY), "--run-id", "r1",
                                "--data-root", str(root)], cwd=REPO_ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output = _Output(process)
    try:
        output.until("Task run 'init_policy", timeout=120)
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
        rest = output.rest()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, rest
    assert "Traceback" not in rest, rest
    said = [line for line in rest.splitlines() if line.startswith("agentr1: interrupted")]
    assert len(said) == 1, rest
    assert f"`agentr1 resume --run-id r1 --data-root {root.resolve()}`" in said[0], rest


def test_ctrl_c_in_any_other_command_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "runs", _raise_keyboard_interrupt)
    assert cli_main(["runs", "--data-root", str(tmp_path)]) == 130
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == ["agentr1: interrupted: runs stopped"], captured.err
