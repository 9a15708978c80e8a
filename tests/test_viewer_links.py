"""The viewer's links to a run in MLflow's and Prefect's own UIs (agent_core/io/ui_links.py), as a
user meets them: a run trained by `agentr1 train` in its own data root, then `mlflow ui` and
`prefect server start` over that root as the README says, each on a free 127.0.0.1 port. Each link
must lead to the object of that run, checked through the UI's own API."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import REPO_ROOT
from tests.viewer_served import Served

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
START_S = 180.0  # a server's start on 2 busy cores (the Prefect server migrates its database first)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _user_env(root: Path) -> dict[str, str]:
    """A user's shell: none of this test session's Prefect settings (they point at its own store)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return {**env, "PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false", "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}


def _get(url: str, body: dict | None = None):
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@contextmanager
def _server(command: list[str], env: dict, health: str, log: Path) -> Iterator[None]:
    """`command` in its own session until `health` answers (at most START_S), then until the block ends."""
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_S
            while True:
                assert process.poll() is None, f"{command[0]} exited:\n{log.read_text()[-3000:]}"
                try:
                    with urllib.request.urlopen(health, timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"{health} did not answer within {START_S}s"
                    time.sleep(0.5)
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    pass


@pytest.fixture(scope="module")
def served_uis(tmp_path_factory):
    """(data root, mlflow URL, prefect URL): one tiny run, and both UIs over its root."""
    root = tmp_path_factory.mktemp("links") / "data"
    env = _user_env(root)
    trained = subprocess.run([str(BIN / "agentr1"), "train", "--config", "tiny", "--data-root", str(root),
                              "--run-id", "linked-run", "--set", "iterations=1"],
                             env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    mlflow, prefect = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    with _server([str(BIN / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--host",
                  "127.0.0.1", "--port", mlflow.rsplit(":", 1)[1], "--workers", "1"], env, f"{mlflow}/health",
                 root / "mlflow-ui.log"), \
         _server([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", prefect.rsplit(":", 1)[1]],
                 env, f"{prefect}/api/health", root / "prefect-ui.log"):
        yield root, mlflow, prefect


def test_each_run_links_to_its_mlflow_run_and_its_prefect_flow_run(served_uis):
    from agent_core.io.ui_links import ExternalUIs

    root, mlflow, prefect = served_uis
    with Served(root, uis=ExternalUIs(mlflow, prefect)) as served:
        status, page = served.get("/")
        assert status == 200
        assert 'href="/to/mlflow/linked-run"' in page and 'href="/to/prefect/linked-run"' in page
        status, headers = served.head("/to/mlflow/linked-run")
        assert status == 302, headers
        experiment, run = re.fullmatch(re.escape(mlflow) + r"/#/experiments/(\w+)/runs/(\w+)", headers["Location"]).groups()
        found = _get(f"{mlflow}/api/2.0/mlflow/runs/get?run_id={run}")["run"]
        assert found["info"]["experiment_id"] == experiment
        assert {t["key"]: t["value"] for t in found["data"]["tags"]}["agentr1.run_id"] == "linked-run"
        status, headers = served.head("/to/prefect/linked-run")
        assert status == 302, headers
        flow_run = re.fullmatch(re.escape(prefect) + r"/runs/flow-run/([0-9a-f-]{36})", headers["Location"]).group(1)
        found = _get(f"{prefect}/api/flow_runs/{flow_run}")
        assert found["name"] == "linked-run" and found["state_type"] == "COMPLETED"
        assert _get(f"{prefect}/api/flows/{found['flow_id']}")["name"] == "agentr1-train"


def test_a_run_missing_from_a_ui_is_said_and_a_ui_that_is_down_gets_no_link(served_uis, tmp_path):
    import shutil

    from agent_core.io.ui_links import ExternalUIs

    root, mlflow, prefect = served_uis
    copy = tmp_path / "data"
    shutil.copytree(root / "runs", copy / "runs")
    shutil.move(copy / "runs/linked-run", copy / "runs/unknown-run")  # in neither UI's store
    with Served(copy, uis=ExternalUIs(mlflow, prefect)) as served:
        for ui in ("mlflow", "prefect"):
            status, page = served.get(f"/to/{ui}/unknown-run")
            assert status == 404 and f"run unknown-run was not found in {ui}" in page
    down = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with Served(root, uis=ExternalUIs(down, prefect)) as served:
        status, page = served.get("/")
    assert status == 200 and "/to/mlflow/" not in page and 'href="/to/prefect/linked-run"' in page
