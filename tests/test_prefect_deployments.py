"""prefect.yaml against a real Prefect server: `prefect deploy --all`, then the train deployment
with a config file of the test's layered on `tiny` and an override, run by a process worker, then
the eval deployment of that run. Also: flows keep transformers' progress bars quiet by themselves.

The server, the worker and the flow runs use only 127.0.0.1 and a temporary PREFECT_HOME; every
process started here is stopped in a finally, and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from agent_core.io.layout import DataRoot
from agent_core.io.tables import read_table

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))
PACKAGES = ("flows", "tasks", "agent_core", "schemas", "configs")
LOADING_WEIGHTS = "Loading weights"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(url: str, body: dict | None = None) -> dict | list:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # reap the leader: a zombie would keep its group alive
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(process: subprocess.Popen) -> None:
    """Stop a process started in its own session, and whatever it started (flow runs, uvicorn)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(process):
            break
        os.killpg(process.pid, sig)
        deadline = time.monotonic() + 15
        while _group_alive(process) and time.monotonic() < deadline:
            time.sleep(0.2)
    process.wait(timeout=15)


def _run(command: list[str], env: dict, cwd: Path, timeout: float, log: Path) -> str:
    """Run `command` in its own session to the end (at most `timeout` s); its output."""
    with log.open("w") as out:
        # PWD as a shell sets it: prefect.yaml's pull step reads `{{ $PWD }}` when deploying
        process = subprocess.Popen(command, cwd=cwd, env={**env, "PWD": str(cwd)}, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            process.wait(timeout=timeout)
        finally:
            _stop(process)
    output = log.read_text()
    assert process.returncode == 0, f"{' '.join(command)} exited {process.returncode}:\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Prefect server on a free port, and the environment of a user's shell pointed at it: none
    of this session's Prefect settings, and none of configure_environment's progress-bar switch."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PREFECT_UI_ENABLED="false",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", MLFLOW_DISABLE_TELEMETRY="true")
    log = (home / "server.log").open("w")
    process = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"prefect server exited:\n{(home / 'server.log').read_text()[-3000:]}"
            try:
                if _api(env["PREFECT_API_URL"] + "/health") is True:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the Prefect server did not answer within 180s"
            time.sleep(0.5)
        yield env
    finally:
        _stop(process)
        log.close()


@pytest.fixture(scope="module")
def project(server, tmp_path_factory):
    """A folder holding the real prefect.yaml and links to the packages; `prefect deploy --all` from
    it (its pull step makes it the flow runs' working directory), the work pool it names, created."""
    folder = tmp_path_factory.mktemp("project")
    shutil.copy2(REPO_ROOT / "prefect.yaml", folder / "prefect.yaml")
    for name in PACKAGES:
        (folder / name).symlink_to(REPO_ROOT / name, target_is_directory=True)
    pool = yaml.safe_load((folder / "prefect.yaml").read_text())["deployments"][0]["work_pool"]["name"]
    _run([PREFECT, "work-pool", "create", pool, "--type", "process"], server, folder, 120, folder / "pool.log")
    _run([PREFECT, "--no-prompt", "deploy", "--all"], server, folder, 300, folder / "deploy.log")
    return folder, pool


def _run_deployment(server: dict, project: Path, pool: str, name: str, params: dict, log: str) -> tuple[dict, str]:
    """`prefect deployment run NAME --param k=v ...`, then one worker pass (`--run-once`): the flow
    run as the API has it, and the worker's output (the flow run's own output included)."""
    command = [PREFECT, "deployment", "run", name]
    for key, value in params.items():
        command += ["--param", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    created = _run(command, server, project, 120, project / f"{log}-run.log")
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", created).group(1)
    worker = _run([PREFECT, "worker", "start", "--pool", pool, "--run-once", "--limit", "1"], server, project.parent,
                  480, project / f"{log}-worker.log")
    return _api(f"{server['PREFECT_API_URL']}/flow_runs/{flow_run_id}"), worker


@pytest.mark.slow
def test_train_then_eval_deployments_run_by_a_worker(server, project):
    folder, pool = project
    deployments = _api(f"{server['PREFECT_API_URL']}/deployments/filter", {})
    by_name = {d["name"]: d for d in deployments}
    assert {"train", "eval", "rerun-stage"} <= set(by_name)
    assert by_name["train"]["parameters"] == {"config": "tiny", "overrides": [], "data_root": "data"}

    # layered on the shipped tiny config, as `agentr1 train --config tiny --config small.yaml --set seed=3`
    (folder / "small.yaml").write_text(textwrap.dedent("""\
        iterations: 1
        dev_eval:
          every: 0
        data:
          prompts_per_iteration: 2
        rollout:
          max_steps: 2
          max_new_tokens: 8
        """))
    flow_run, output = _run_deployment(server, folder, pool, "agentr1-train-from-config/train",
                                       {"config": ["tiny", "small.yaml"], "overrides": ["seed=3"],
                                        "run_id": "deployed"}, "train")
    assert flow_run["state_type"] == "COMPLETED", output[-4000:]
    root = DataRoot(folder / "data")  # the default data_root, relative to the pull step's folder
    recorded = yaml.safe_load(root.run("deployed").config_path.read_text())
    assert recorded["seed"] == 3 and recorded["iterations"] == 1 and recorded["policy"]["hidden_size"] == 32
    assert (root.run("deployed").checkpoint_dir(0) / "model.safetensors").is_file()
    assert LOADING_WEIGHTS not in output  # the flow quieted transformers by itself

    flow_run, output = _run_deployment(server, folder, pool, "agentr1-evaluate-run/eval",
                                       {"run_id": "deployed", "limit": 1, "seeds": 1, "eval_id": "deployed-eval"}, "eval")
    assert flow_run["state_type"] == "COMPLETED", output[-4000:]
    for method in ("naive_rag", "base_tool_call", "agent"):
        table = read_table("eval", root.eval_table_uri("deployed-eval", method, 0))
        assert table.num_rows == 1 and set(table.column("method").to_pylist()) == {method}
    assert root.eval_report_path("deployed-eval").is_file()
    assert LOADING_WEIGHTS not in output


QUIET_PROBE = """
import sys
from transformers import LlamaForCausalLM
if sys.argv[2] == "quiet":
    from flows.environment import quiet_progress_bars
    quiet_progress_bars()
LlamaForCausalLM.from_pretrained(sys.argv[1])
"""


def test_flows_turn_off_the_loading_weights_bar_themselves(tmp_path):
    """What a worker's flow run does (no configure_environment): the bar shows without
    quiet_progress_bars, and not with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    printed = {}
    for mode in ("plain", "quiet"):
        done = subprocess.run([sys.executable, "-c", QUIET_PROBE, str(tmp_path / "model"), mode], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        printed[mode] = done.stdout + done.stderr
    assert LOADING_WEIGHTS in printed["plain"]
    assert LOADING_WEIGHTS not in printed["quiet"]
