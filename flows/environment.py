"""Process environment for embedded, server-less operation. Must run before `import prefect`.

Everything lives under one data root: Prefect's state (PREFECT_HOME), the MLflow SQLite store
and artifacts, and the run tables. Values the user already exported win.
"""

from __future__ import annotations

import os
from pathlib import Path


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
        # per-file "Loading weights" bars from transformers drown the stage progress lines
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
