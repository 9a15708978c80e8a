"""MLflow settings for this project, applied on import: every module here that imports mlflow
imports this one first, because MLflow reads some of them at import time. Values the user has
already set win."""

from __future__ import annotations

import os


def mlflow_env() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # Download progress bars (loading a registered model) are noise in flow logs and test output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


mlflow_env()
