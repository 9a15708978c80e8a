"""Process environment for embedded, server-less operation. Must run before `import prefect`.

Everything lives under one data root: Prefect's state (PREFECT_HOME), the MLflow SQLite store
and artifacts, and the run tables. Values the user already exported win.

Also here: `quiet_progress_bars`, which the flows call themselves (a flow run started by a Prefect
worker never goes through `configure_environment`), and `start_temporary_server`, which ties
Prefect's temporary API server to the `agentr1` process (docs/architecture.md §8).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from pathlib import Path

# per-file "Loading weights" bars from transformers drown the stage progress lines
PROGRESS_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"


def configure_environment(data_root: str | Path) -> None:
    root = Path(data_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    defaults = {
        "PREFECT_HOME": str(root / "prefect"),
        # the analytics client prints "database is locked" tracebacks on every ephemeral run
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "agent_core",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        PROGRESS_BARS_ENV: "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def quiet_progress_bars() -> None:
    """Turn off transformers' (and huggingface_hub's) tqdm bars in this process, unless the user
    exported HF_HUB_DISABLE_PROGRESS_BARS=0. transformers reads the variable once, at import (the
    "Loading weights" bar of `from_pretrained`, transformers/core_model_loading.py), so a process
    that imported it already is switched off through its API as well."""
    if os.environ.setdefault(PROGRESS_BARS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


# ---- the temporary API server dies with this process ---------------------------------------------

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _SpawnTiedToParent:
    """What prefect.server.api.server sees as its `subprocess` module while `start_temporary_server`
    starts the server: the same module, but Popen's child asks for SIGTERM when its parent dies."""

    def __init__(self, parent_pid: int):
        self._parent_pid = parent_pid
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child

    def __getattr__(self, name: str):
        import subprocess

        return getattr(subprocess, name)

    def Popen(self, *args, **kwargs):  # noqa: N802 - stands in for subprocess.Popen
        import subprocess

        return subprocess.Popen(*args, preexec_fn=self._die_with_parent, **kwargs)

    def _die_with_parent(self) -> None:
        """Runs in the child between fork and exec; both settings survive exec. Its own process group
        keeps a terminal's Ctrl-C (SIGINT to the whole foreground group) away from the server: the
        interrupted flow still records its Crashed state there, and `agentr1` stops it on the way out
        (killed by the Ctrl-C first, the flow engine retried a dead API for a minute, then a traceback)."""
        os.setpgid(0, 0)
        self._prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != self._parent_pid:  # the parent died before the line above: no signal will come
            os._exit(1)


def start_temporary_server() -> None:
    """Start Prefect's temporary API server now, as a child that dies with this process.

    Without PREFECT_API_URL, Prefect starts a temporary server (`SubprocessASGIServer`, a uvicorn
    child process) on first use and stops it at exit; a SIGKILLed parent never gets there, and the
    server lived on. Started here, the child sets Linux's parent-death signal (prctl
    PR_SET_PDEATHSIG, SIGTERM: the server's normal stop) before it runs the server. The kernel ties
    that signal to the thread that forked the child, so this runs on the main thread only, before
    the first flow; Prefect's later calls find the same instance (one per port) running and use it.
    Elsewhere (a real server, another OS, another thread) it does nothing and Prefect starts the
    server as usual.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return
    from prefect.server.api import server as server_module
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # Prefect's own test (prefect.client.orchestration.get_client)
        return
    server = server_module.SubprocessASGIServer()
    if server.running:
        return
    spawn = server_module.subprocess
    server_module.subprocess = _SpawnTiedToParent(os.getpid())
    try:
        server.start()
    finally:
        server_module.subprocess = spawn


def name_flow_run(name: str) -> None:
    """Rename the current Prefect flow run (the run id, so the viewer can link a run to its flow
    runs in Prefect's UI); outside a flow run, or when the API refuses, nothing happens."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id or flow_run.name == name:
        return
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    except Exception as error:  # noqa: BLE001 - a name is a convenience; the run goes on
        print(f"agentr1: could not name the flow run {name!r} in Prefect: {error}", file=sys.stderr)
