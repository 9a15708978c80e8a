"""MLflow tracking for training runs (docs/architecture.md §8): one MLflow run per pipeline run.

Every call goes through an `MlflowClient` bound to an explicit tracking URI and takes the MLflow run id as an
argument; nothing here uses mlflow's module-level active-run state. Resuming is the normal case:
`start_run` with the same pipeline run id returns the same MLflow run, and re-registering an iteration returns
its version. Unlike the plain MLflow recipes, a checkpoint is registered with `create_model_version`.
Design notes: docs/architecture.md §11 (agent_core/io/tracking.py).
"""

from __future__ import annotations

import math
import posixpath
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from agent_core.io.mlflow_env import mlflow_env  # noqa: F401  (first: it sets MLflow's environment)
from mlflow.entities import Metric, Param, RunTag, ViewType  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository  # noqa: E402
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from mlflow.utils.validation import (  # noqa: E402
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from agent_core.failpoints import failpoint  # noqa: E402
from agent_core.io.mlflow_store import create_sqlite_store, reroot_store, sqlite_store_path  # noqa: E402
from agent_core.io.model_registry import (  # noqa: E402
    ITERATION_TAG,
    RUN_ID_TAG,
    best_version,
    place_policy_model,
    refresh_aliases,
    save_policy_model,
    version_tags,
)

Scalar = Union[str, int, float, bool, None]

CHECKPOINT_ARTIFACT_DIR = "checkpoints"
TRUNCATION_MARKER = "...[truncated]"
END_STATUSES = ("FINISHED", "FAILED", "KILLED")


class TrackingError(ValueError):
    """A tracking request that cannot be honoured; the message names what is wrong."""


@dataclass(frozen=True)
class RegisteredModel:
    """One registered version of a checkpoint: `source` is the artifact URI of the logged MLflow
    model it was created from (the checkpoint is its `artifacts/checkpoint`)."""

    name: str
    version: int
    source: str

    @property
    def uri(self) -> str:
        """What `mlflow.pyfunc.load_model` and `agentr1 eval --checkpoint` take."""
        return f"models:/{self.name}/{self.version}"


def flatten_params(config: Mapping[str, object], prefix: str = "") -> dict[str, Scalar]:
    """Flatten a nested mapping into dotted keys: {"algorithm": {"estimator": "grpo"}} ->
    {"algorithm.estimator": "grpo"}. Lists and other non-scalars become their `str()`."""
    flat: dict[str, Scalar] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{dotted}."))
        elif value is None or isinstance(value, (str, int, float, bool)):
            flat[dotted] = value
        else:
            flat[dotted] = str(value)
    return flat


def param_value(value: Scalar) -> str:
    """The string MLflow stores for a parameter, cut to MLflow's length limit with a marker.

    Deterministic, so a resumed run compares the same cut string and does not re-log it.
    """
    text = str(value)
    if len(text) <= MAX_PARAM_VAL_LENGTH:
        return text
    return text[: MAX_PARAM_VAL_LENGTH - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _is_uri(location: str) -> bool:
    return "://" in location or location.startswith("file:")


class Tracker:
    """Logs one pipeline run to MLflow through an explicit tracking URI.

    The first use of a fresh SQLite store creates its schema (~2.5 s measured here); later opens
    of the same store cost milliseconds within a process.
    """

    def __init__(self, tracking_uri: str, artifact_location: str, experiment_name: str = "agentr1"):
        store = sqlite_store_path(tracking_uri)
        if store is not None:
            create_sqlite_store(store, lambda uri: MlflowClient(tracking_uri=uri).search_experiments())
        if not _is_uri(artifact_location):
            artifact_location = str(Path(artifact_location).resolve())
        reroot_store(tracking_uri, artifact_location)  # a moved data root: before anything reads a location
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.experiment_id = self._get_or_create_experiment(experiment_name, artifact_location)

    def _get_or_create_experiment(self, name: str, artifact_location: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self.client.create_experiment(name, artifact_location=artifact_location)
            except MlflowException as error:
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                # Another process created it between our lookup and our create.
                experiment = self.client.get_experiment_by_name(name)
        if experiment.lifecycle_stage != "active":
            raise TrackingError(
                f"MLflow experiment {name!r} (id {experiment.experiment_id}) is deleted; restore it "
                f"(`mlflow experiments restore --experiment-id {experiment.experiment_id}`) or choose another "
                "experiment name"
            )
        return experiment.experiment_id

    # ---- runs -------------------------------------------------------------------------------

    def find_run(self, run_id: str) -> str | None:
        """The MLflow run id of pipeline run `run_id`, or None if it was never started."""
        runs = self._runs_tagged(run_id)
        return runs[0].info.run_id if runs else None

    def _runs_tagged(self, run_id: str) -> list:
        if "'" in run_id:
            raise TrackingError(f"run id {run_id!r} must not contain a single quote")
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
            run_view_type=ViewType.ACTIVE_ONLY,
        )
        # Oldest first, so concurrent starters agree on the same run.
        return sorted(runs, key=lambda run: (run.info.start_time, run.info.run_id))

    def start_run(self, run_id: str, params: Mapping[str, object], tags: Mapping[str, str] | None = None,
                  on_change: str = "raise") -> str:
        """Start (or resume) the MLflow run of pipeline run `run_id`; returns the MLflow run id.

        `params` may be nested; it is flattened to dotted keys. A parameter already logged with
        the same value is skipped. A different value (a run resumed with a changed config) raises
        TrackingError naming the key (on_change="raise"), or (on_change="tag") keeps the first value,
        which MLflow cannot change, and records the change as a tag `changed.<key>` = "old -> new".
        """
        if on_change not in ("raise", "tag"):
            raise TrackingError(f"unknown on_change {on_change!r}; valid: raise, tag")
        mlflow_run_id = self.find_run(run_id)
        if mlflow_run_id is None:
            mlflow_run_id = self._create_run(run_id, tags or {})
        else:
            run = self.client.get_run(mlflow_run_id)
            if run.info.status != "RUNNING":
                self.client.update_run(mlflow_run_id, status="RUNNING")
            for key, value in (tags or {}).items():
                self.client.set_tag(mlflow_run_id, key, value)
        self._log_new_params(mlflow_run_id, flatten_params(params), on_change)
        return mlflow_run_id

    def _create_run(self, run_id: str, tags: Mapping[str, str]) -> str:
        created = self.client.create_run(
            self.experiment_id, run_name=run_id, tags={**tags, RUN_ID_TAG: run_id}
        ).info.run_id
        winner = self.find_run(run_id)
        if winner is not None and winner != created:
            # Another process started the same pipeline run concurrently; keep the older run.
            self.client.delete_run(created)
            return winner
        return created

    def _log_new_params(self, mlflow_run_id: str, params: Mapping[str, Scalar], on_change: str = "raise") -> None:
        logged = self.client.get_run(mlflow_run_id).data.params
        new: list[Param] = []
        changed: list[RunTag] = []
        for key, value in params.items():
            if len(key) > MAX_ENTITY_KEY_LENGTH:
                raise TrackingError(f"param key {key[:60]!r}... is longer than MLflow's {MAX_ENTITY_KEY_LENGTH} characters")
            text = param_value(value)
            if key not in logged:
                new.append(Param(key, text))
            elif logged[key] != text and on_change == "tag":
                changed.append(RunTag(f"changed.{key}"[:MAX_ENTITY_KEY_LENGTH], param_value(f"{logged[key]} -> {text}")))
            elif logged[key] != text:
                raise TrackingError(
                    f"param {key!r} was logged as {logged[key][:200]!r} in MLflow run {mlflow_run_id}; "
                    f"cannot change it to {text[:200]!r} (MLflow params are immutable: start a new run id "
                    "to change the config)"
                )
        for batch in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(mlflow_run_id, params=batch, synchronous=True)
        for batch in _chunks(changed, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(mlflow_run_id, tags=batch, synchronous=True)

    def log_metrics(self, mlflow_run_id: str, metrics: Mapping[str, float], step: int) -> dict[str, float]:
        """Log `metrics` at `step` in batch calls, each (name, step) once; return what was logged.

        A metric that does not apply has no value (NaN or inf: value_loss without a critic, dev EM
        of an iteration that was not evaluated) and is not logged, so a chart shows no fake points.
        A (name, step) the run already has is not logged again: a resumed run, or one killed
        between this call and its stage's manifest, keeps one point per iteration.
        """
        timestamp_ms = int(time.time() * 1000)
        fresh = {key: float(value) for key, value in metrics.items()
                 if math.isfinite(float(value)) and not self._has_metric(mlflow_run_id, key, int(step))}
        entries = [Metric(key, value, timestamp_ms, int(step)) for key, value in fresh.items()]
        for batch in _chunks(entries, MAX_METRICS_PER_BATCH):
            self.client.log_batch(mlflow_run_id, metrics=batch, synchronous=True)
        failpoint("tracking:metrics_logged")
        return fresh

    def _has_metric(self, mlflow_run_id: str, key: str, step: int) -> bool:
        return any(m.step == step for m in self.client.get_metric_history(mlflow_run_id, key))

    def log_artifacts(self, mlflow_run_id: str, local_dir: Path | str, artifact_path: str | None = None) -> None:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise TrackingError(f"cannot log artifacts: {local_dir} is not a directory")
        self._artifact_repo(mlflow_run_id).log_artifacts(str(local_dir), artifact_path)

    def log_text(self, mlflow_run_id: str, text: str, artifact_file: str) -> None:
        folder, name = posixpath.split(artifact_file)
        with tempfile.TemporaryDirectory(prefix="agentr1-text-") as staging:
            (Path(staging) / name).write_text(text, encoding="utf-8")
            self._artifact_repo(mlflow_run_id).log_artifact(str(Path(staging) / name), folder or None)

    def _artifact_repo(self, mlflow_run_id: str):
        """The run's artifact repository, from the run's artifact URI as the store has it now. Not
        `client.log_artifacts`: MLflow caches a run's repository per process by run id alone, so a
        process that logged to a data root before it was copied (or re-rooted) would keep writing
        to the old place."""
        artifact_uri = self.client.get_run(mlflow_run_id).info.artifact_uri
        return get_artifact_repository(artifact_uri, tracking_uri=self.tracking_uri)

    def end_run(self, mlflow_run_id: str, status: str = "FINISHED") -> None:
        if status not in END_STATUSES:
            raise TrackingError(f"unknown run end status {status!r}; valid: {', '.join(END_STATUSES)}")
        self.client.set_terminated(mlflow_run_id, status=status)

    # ---- checkpoints ------------------------------------------------------------------------

    def register_checkpoint(
        self, mlflow_run_id: str, checkpoint_dir: Path, model_name: str, iteration: int,
        dev_em: float | None = None, algorithm: str | None = None,
    ) -> RegisteredModel:
        """Log `checkpoint_dir` as an MLflow model under "checkpoints/iteration=<k>" and register it
        as a version of `model_name`, tagged with the pipeline run id, iteration=<k>, `dev_em` (if
        finite) and `algorithm`; then point the alias `best` (model_registry.py; `latest` is MLflow's).
        Returns the existing version if this run already registered this iteration (a resumed
        flow), so versions are never duplicated."""
        if "'" in model_name:
            raise TrackingError(f"model name {model_name!r} must not contain a single quote")
        registered = self.find_checkpoint(mlflow_run_id, model_name, iteration)
        if registered is None:
            registered = self._log_and_register(mlflow_run_id, Path(checkpoint_dir), model_name, iteration,
                                                dev_em, algorithm)
        refresh_aliases(self.client, model_name)
        return registered

    def _log_and_register(self, mlflow_run_id: str, checkpoint_dir: Path, model_name: str, iteration: int,
                          dev_em: float | None, algorithm: str | None) -> RegisteredModel:
        if not checkpoint_dir.is_dir():
            raise TrackingError(f"checkpoint of iteration {iteration} not found: {checkpoint_dir} is not a directory")
        artifact_path = f"{CHECKPOINT_ARTIFACT_DIR}/iteration={int(iteration)}"
        # The same artifact path every time: a rerun after a kill overwrites what the killed run logged.
        repo = self._artifact_repo(mlflow_run_id)
        if isinstance(repo, LocalArtifactRepository):  # built in place, its checkpoint files hard links
            place_policy_model(checkpoint_dir, Path(repo.artifact_dir) / artifact_path)
        else:  # a remote store gets a copy through a temporary folder
            with tempfile.TemporaryDirectory(prefix="agentr1-model-") as staging:
                repo.log_artifacts(str(save_policy_model(checkpoint_dir, Path(staging) / "model")), artifact_path)
        self._ensure_registered_model(model_name)
        failpoint("tracking:checkpoint_artifacts_logged")
        run = self.client.get_run(mlflow_run_id)
        source = posixpath.join(run.info.artifact_uri, artifact_path)
        tags = version_tags(run.data.tags.get(RUN_ID_TAG, ""), iteration, dev_em, algorithm)
        version = self.client.create_model_version(model_name, source=source, run_id=mlflow_run_id, tags=tags)
        return RegisteredModel(name=model_name, version=int(version.version), source=version.source)

    def find_checkpoint(self, mlflow_run_id: str, model_name: str, iteration: int) -> RegisteredModel | None:
        """The version of `model_name` registered by this run for `iteration`, if any."""
        versions = self.client.search_model_versions(f"name = '{model_name}' and run_id = '{mlflow_run_id}'")
        matching = [v for v in versions if v.tags.get(ITERATION_TAG) == str(int(iteration))]
        if not matching:
            return None
        first = min(matching, key=lambda v: int(v.version))
        return RegisteredModel(name=model_name, version=int(first.version), source=first.source)

    def best_dev_em(self, model_name: str) -> float | None:
        """The dev EM of the version `best` points to (model_registry.best_version); None without one."""
        best = best_version(self.client, model_name)
        return None if best is None else best[0]

    def _ensure_registered_model(self, model_name: str) -> None:
        description = (f"Policy checkpoints of MLflow experiment {self.experiment_name!r}, one version per registered "
                       "training iteration (tracking.register_every). Load one with "
                       f"mlflow.pyfunc.load_model('models:/{model_name}@latest') (aliases: latest = the newest "
                       "registered iteration of the run that registered last, best = the "
                       "highest dev EM); evaluate one with agentr1 eval --checkpoint models:/NAME/VERSION.")
        try:
            self.client.create_registered_model(model_name, description=description)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
