"""Where things live under one data root (docs/architecture.md §5).

`runs/<run_id>/` holds the run's config.yaml, initial_policy/ and one `iteration=<k>/` folder per iteration
(its `<table>.parquet` tables, checkpoint/, optimizer.pt, _manifests/; `<name>.pruned.json` where retention
pruned one); `datasets/<dataset_id>/` the tables shared by every run of a dataset; `evals/<eval_id>/` evaluations; `prefect/`, `mlflow.db` and `mlartifacts/`
the orchestration and tracking stores. Hive-style `iteration=<k>` folders let DuckDB read across runs.
Design notes: docs/architecture.md §11 (agent_core/io/layout.py).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from agent_core.io.tombstones import tombstone_path

RUN_TABLES = ("prompts", "steps", "rewards", "advantages", "train_metrics")
DATASET_TABLES = ("dataset_prompts", "corpus")
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_id(kind: str, value: str) -> str:
    """Run and dataset ids become folder names: refuse anything that could escape the data root."""
    if not _SAFE_ID.match(value):
        raise ValueError(
            f"invalid {kind} {value!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def new_run_id(prefix: str = "run") -> str:
    """A sortable, collision-resistant id: <prefix>-<UTC date>-<time>-<4 hex>."""
    return check_id("run id", f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}")


@dataclass(frozen=True)
class DataRoot:
    path: Path

    @property
    def runs_dir(self) -> Path:
        return self.path / "runs"

    @property
    def prefect_home(self) -> Path:
        return self.path / "prefect"

    @property
    def mlflow_db(self) -> Path:
        return self.path / "mlflow.db"

    @property
    def mlflow_tracking_uri(self) -> str:
        return f"sqlite:///{self.mlflow_db.resolve()}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.path / "mlartifacts"

    def run(self, run_id: str) -> "RunLayout":
        return RunLayout(self.path, check_id("run id", run_id))

    def dataset_dir(self, dataset_id: str) -> Path:
        return self.path / "datasets" / check_id("dataset id", dataset_id)

    def dataset_table_uri(self, dataset_id: str, table: str) -> str:
        if table not in DATASET_TABLES:
            raise ValueError(f"unknown dataset table {table!r}; valid: {', '.join(DATASET_TABLES)}")
        name = "prompts" if table == "dataset_prompts" else table
        return str(self.dataset_dir(dataset_id) / f"{name}.parquet")

    @property
    def evals_dir(self) -> Path:
        return self.path / "evals"

    def eval_dir(self, eval_id: str) -> Path:
        """One evaluation (methods x seeds over one dataset split): its tables and report."""
        return self.evals_dir / check_id("eval id", eval_id)

    def eval_table_uri(self, eval_id: str, method: str, seed: int) -> str:
        """`evals/<eval_id>/<method>/seed=<s>/eval.parquet`: one method x seed per file."""
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        return str(self.eval_dir(eval_id) / check_id("eval method", method) / f"seed={seed}" / "eval.parquet")

    def eval_report_path(self, eval_id: str) -> Path:
        return self.eval_dir(eval_id) / "report.md"

    def run_ids(self) -> list[str]:
        if not self.runs_dir.is_dir():
            return []
        return sorted(p.name for p in self.runs_dir.iterdir() if p.is_dir())


@dataclass(frozen=True)
class RunLayout:
    data_root: Path
    run_id: str

    @property
    def run_dir(self) -> Path:
        return self.data_root / "runs" / self.run_id

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def initial_policy_dir(self) -> Path:
        return self.run_dir / "initial_policy"

    @property
    def has_initial_policy(self) -> bool:
        """Whether the run copied its initial policy (retention may have pruned it since a warm start)."""
        return self.initial_policy_dir.exists() or tombstone_path(self.initial_policy_dir).is_file()

    def iteration_dir(self, iteration: int) -> Path:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        return self.run_dir / f"iteration={iteration}"

    def table_uri(self, iteration: int, table: str) -> str:
        if table not in RUN_TABLES:
            raise ValueError(f"unknown run table {table!r}; valid: {', '.join(RUN_TABLES)}")
        return str(self.iteration_dir(iteration) / f"{table}.parquet")

    def checkpoint_dir(self, iteration: int) -> Path:
        return self.iteration_dir(iteration) / "checkpoint"

    def manifest_path(self, stage: str, iteration: int | None = None) -> Path:
        """The manifest of `stage` of `iteration` (None: a stage of the run as a whole, e.g. init_policy)."""
        folder = self.run_dir if iteration is None else self.iteration_dir(iteration)
        return folder / "_manifests" / f"{check_id('stage', stage)}.json"

    @property
    def lock_path(self) -> Path:
        return self.run_dir / ".lock"

    @property
    def report_dir(self) -> Path:
        """The end-of-run report: `report.md` (the iteration table) and `curves/*.png`."""
        return self.run_dir / "report"

    @property
    def status_path(self) -> Path:
        """How the run's last training process ended (agent_core/io/run_status.py)."""
        return self.run_dir / "status.json"

    def iterations(self) -> list[int]:
        """The iterations that have a folder, in order."""
        return sorted(int(p.name.removeprefix("iteration=")) for p in self.run_dir.glob("iteration=*")
                      if p.name.removeprefix("iteration=").isdigit())

    def last_checkpoint_dir(self) -> Path | None:
        """The checkpoint of the highest iteration that has one (None before the first is saved)."""
        iterations = [k for k in self.iterations() if self.checkpoint_dir(k).is_dir()]
        return self.checkpoint_dir(iterations[-1]) if iterations else None

    def dev_eval_uri(self, iteration: int | None) -> str:
        """The held-out evaluation of the policy after iteration `iteration` (an `eval` table), or of
        the policy RL starts from (None): runs/<id>/iteration=<k>/dev_eval.parquet, runs/<id>/dev_eval_start.parquet."""
        if iteration is None:
            return str(self.run_dir / "dev_eval_start.parquet")
        return str(self.iteration_dir(iteration) / "dev_eval.parquet")

    def optimizer_state_path(self, iteration: int) -> Path:
        return self.iteration_dir(iteration) / "optimizer.pt"

    @property
    def warm_start_dir(self) -> Path:
        """The warm start's oracle episodes (steps.parquet, rewards.parquet)."""
        return self.run_dir / "warm_start"

    @property
    def warm_start_policy_dir(self) -> Path:
        """The initial policy after supervised fine-tuning on selected episodes."""
        return self.run_dir / "warm_start_policy"

    @property
    def start_policy_dir(self) -> Path:
        """What RL starts from: the warm-started policy when there is one, else the initial one."""
        return self.warm_start_policy_dir if self.warm_start_policy_dir.exists() else self.initial_policy_dir

    def policy_dir_before(self, iteration: int) -> Path:
        """The policy that iteration `iteration` rolls out with."""
        return self.start_policy_dir if iteration == 0 else self.checkpoint_dir(iteration - 1)

    @property
    def reference_policy_dir(self) -> Path:
        """The frozen reference of the KL terms: the policy RL started from."""
        return self.start_policy_dir

    @property
    def initial_critic_dir(self) -> Path:
        return self.run_dir / "initial_critic"

    def critic_dir(self, iteration: int) -> Path:
        """The critic after iteration `iteration` (estimators with values: gae, step_gae)."""
        return self.iteration_dir(iteration) / "critic"

    def critic_dir_before(self, iteration: int) -> Path:
        return self.initial_critic_dir if iteration == 0 else self.critic_dir(iteration - 1)

    def critic_optimizer_state_path(self, iteration: int) -> Path:
        return self.iteration_dir(iteration) / "critic_optimizer.pt"
