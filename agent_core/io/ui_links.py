"""Links from the trace viewer to a run in MLflow's and Prefect's own UIs, when those are served.

Each UI is asked through its REST API (stdlib HTTP, short timeouts): is it up, and which of its
objects is the run: MLflow's run tagged `agentr1.run_id`, Prefect's latest flow run named after the
run (flows/train.py names it). Nothing is read from their stores directly.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from agent_core.io.model_registry import RUN_ID_TAG

HEALTH_TIMEOUT_S = 2.0  # the runs page waits at most this per UI (a closed port answers at once)
LOOKUP_TIMEOUT_S = 20.0  # a followed link: a UI's first query after its start can take seconds on busy cores
REACHABLE_TTL_S = 10.0  # the runs page asks once per this many seconds, not once per load


@dataclass
class ExternalUIs:
    """MLflow's and Prefect's UI base URLs (None: not linked). `reachable()` is cached briefly."""

    mlflow_url: str | None = None
    prefect_url: str | None = None
    _checked: tuple[float, dict[str, bool]] | None = field(default=None, repr=False)

    def reachable(self) -> dict[str, bool]:
        """{"mlflow": up?, "prefect": up?} for the UIs that have a URL."""
        now = time.monotonic()
        if self._checked is None or now - self._checked[0] > REACHABLE_TTL_S:
            up = {}
            if self.mlflow_url:
                up["mlflow"] = _answers(f"{self.mlflow_url}/health")
            if self.prefect_url:
                up["prefect"] = _answers(f"{self.prefect_url}/api/health")
            self._checked = (now, up)
        return self._checked[1]

    def mlflow_run_url(self, run_id: str) -> str | None:
        """The page of the MLflow run of pipeline run `run_id`, or None (no such run, or no answer)."""
        if not self.mlflow_url:
            return None
        experiments = _post(f"{self.mlflow_url}/api/2.0/mlflow/experiments/search", {"max_results": 1000})
        ids = [e["experiment_id"] for e in (experiments or {}).get("experiments", [])]
        if not ids:
            return None
        literal = run_id.replace("'", "")  # run ids have no quotes (agent_core/io/layout.py); never inject one
        found = _post(f"{self.mlflow_url}/api/2.0/mlflow/runs/search",
                      {"experiment_ids": ids, "filter": f"tags.`{RUN_ID_TAG}` = '{literal}'", "max_results": 1,
                       "order_by": ["attributes.start_time ASC"]})
        runs = (found or {}).get("runs", [])
        if not runs:
            return None
        info = runs[0]["info"]
        return f"{self.mlflow_url}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}"

    def prefect_flow_run_url(self, run_id: str) -> str | None:
        """The page of the latest Prefect flow run named `run_id`, or None (none, or no answer)."""
        if not self.prefect_url:
            return None
        found = _post(f"{self.prefect_url}/api/flow_runs/filter",
                      {"flow_runs": {"name": {"any_": [run_id]}}, "sort": "START_TIME_DESC", "limit": 1})
        if not found:
            return None
        return f"{self.prefect_url}/runs/flow-run/{found[0]['id']}"


def ui_url(value: str | None) -> str | None:
    """A UI base URL as given on the command line, checked (http or https, a host) and without a
    trailing slash; None or "" turns the link off."""
    if not value:
        return None
    parsed = urllib.parse.urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"a UI address must be http(s)://host:port, not {value!r}")
    return value.rstrip("/")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as response:
            return 200 <= response.status < 300
    except (OSError, ValueError):
        return False


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=LOOKUP_TIMEOUT_S) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None
