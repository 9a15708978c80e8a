"""Prefect's temporary API server dies with `agentr1`, even a SIGKILLed one (flows/environment.py:
start_temporary_server sets the server's parent-death signal). Linux only: that signal is Linux's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_APP = "prefect.server.api.server:create_app"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _wait_for_server(parent: subprocess.Popen, timeout: float) -> int:
    """The pid of `parent`'s temporary API server once it answers, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert parent.poll() is None, f"agentr1 exited ({parent.returncode}) before its server started"
        for child in _children(parent.pid):
            command = " ".join(_cmdline(child))
            port = re.search(r"--port (\d+)", command)
            if SERVER_APP in command and port and _healthy(int(port.group(1))):
                return child
        time.sleep(0.5)
    raise AssertionError(f"no temporary Prefect server answered within {timeout:.0f}s")


@pytest.mark.slow  # an `agentr1 train` and its server's start: ~20 s on 2 cores
def test_the_temporary_server_dies_with_a_sigkilled_agentr1(tmp_path):
    # no PREFECT_API_URL (so a temporary server) and nothing of this session's Prefect settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    log = (tmp_path / "agentr1.log").open("w")
    parent = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--config", "tiny", "--data-root", str(tmp_path / "data")],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = None
    try:
        server = _wait_for_server(parent, timeout=240)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server), f"the temporary server (pid {server}) outlived its SIGKILLed parent by 15s"
    finally:
        # whatever is left of the process group started above (the server, if the test failed)
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if parent.poll() is None:
            parent.wait(timeout=30)
        log.close()
