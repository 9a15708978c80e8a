"""Pruning registered versions (docs/architecture.md §8): the versions of a model that one pipeline run
registered for iterations retention no longer keeps, with their artifact folders when the artifact
store is local; `best` is moved first, so `models:/<name>@best` and `@latest` load throughout.

Safe to kill at any moment and to rerun: a version is deleted before its files (a version MLflow lists
always has its files; a kill between leaves files no version names), and a folder is renamed to a
hidden `.pruned-` name before it is removed. A rerun is a reconciliation: it deletes the versions
still listed, then every `checkpoints/iteration=<k>` folder of the run's MLflow runs that is not kept
and that no version uses, and the hidden leftovers of earlier tries.
"""

from __future__ import annotations

import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent_core.io.mlflow_env import mlflow_env  # noqa: F401  (first: it sets MLflow's environment)
from mlflow.entities import ViewType  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository  # noqa: E402
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from mlflow.utils.file_utils import local_file_uri_to_path  # noqa: E402

from agent_core.failpoints import failpoint  # noqa: E402
from agent_core.io.disk_use import freed_by_deleting  # noqa: E402
from agent_core.io.model_registry import ITERATION_TAG, RUN_ID_TAG, refresh_aliases  # noqa: E402
from agent_core.io.tracking import CHECKPOINT_ARTIFACT_DIR  # noqa: E402  (where register_checkpoint logs)
# A version's folder, or a hidden leftover: place_policy_model's staging (.tmp-) or swap (.old-), or ours.
_FOLDER = re.compile(r"^(?P<hidden>\.)?iteration=(?P<k>\d+)(?(hidden)\.(tmp|old|pruned)-[0-9a-f]{8})$")


@dataclass(frozen=True)
class PrunedVersion:
    """One version deleted (or, dry run, to delete), or an artifact folder no version used any more."""

    version: int | None  # None: a folder without a version (a kill between the two steps, a killed staging)
    iteration: int
    path: Path | None  # the artifact folder removed; None when it stays (remote store, still used)
    bytes_freed: int  # file bytes no other name keeps (disk_use.freed_by_deleting)


def prune_registered_versions(tracking_uri: str, model_name: str, agentr1_run_id: str,
                              keep_iterations: Iterable[int], *, dry_run: bool = False) -> list[PrunedVersion]:
    """Delete the versions of `model_name` tagged `agentr1.run_id` = `agentr1_run_id` whose iteration tag is
    not in `keep_iterations` (another run's versions, and versions without an iteration tag, are never
    touched), then their local artifact folders, then recompute `best`; the run's newest registered
    iteration always stays. Returns what was pruned (with `dry_run`, what would be; nothing changes).
    An iteration being registered must be kept."""
    for name, value in (("model name", model_name), ("run id", agentr1_run_id)):
        if "'" in value:
            raise ValueError(f"{name} {value!r} must not contain a single quote")
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    keep = frozenset(int(k) for k in keep_iterations)
    ours = [v for v in _versions(client, f"name = '{model_name}'") if v.tags.get(RUN_ID_TAG) == agentr1_run_id]
    # the run's newest registered iteration stays whatever retention says (tracking.register_every may
    # have left the kept iterations unregistered), so the run always has a version that loads
    keep |= {max(registered)} if (registered := [k for v in ours if (k := _iteration(v)) is not None]) else set()
    doomed = sorted((v for v in ours if _iteration(v) is not None and _iteration(v) not in keep),
                    key=lambda v: int(v.version))
    folders = _artifact_dirs(client, tracking_uri, agentr1_run_id, {v.run_id for v in ours if v.run_id})
    doomed_keys = {(v.name, v.version) for v in doomed}
    in_use = {_local(v.source) for run_id in folders
              for v in _versions(client, f"run_id = '{run_id}'") if (v.name, v.version) not in doomed_keys}
    pruned = []
    for v in doomed:
        folder = _version_folder(v, folders)
        folder = None if folder is None or folder in in_use or not folder.exists() else folder
        pruned.append(PrunedVersion(int(v.version), _iteration(v), folder, freed_by_deleting(folder) if folder else 0))
    named = {p.path for p in pruned}
    for leftover in _leftovers(folders.values(), keep):
        if leftover not in in_use and leftover not in named:
            pruned.append(PrunedVersion(None, int(_FOLDER.match(leftover.name)["k"]), leftover,
                                        freed_by_deleting(leftover)))
    if not dry_run:
        _apply(client, model_name, pruned)
    return pruned


def _apply(client: MlflowClient, model_name: str, pruned: list[PrunedVersion]) -> None:
    """`best` first (to the best version that stays), then the versions, then their folders: at every
    moment `best` names a listed version and each version MLflow lists has its files."""
    refresh_aliases(client, model_name, excluding=frozenset(p.version for p in pruned if p.version is not None))
    for item in pruned:
        if item.version is not None:
            try:
                client.delete_model_version(model_name, str(item.version))  # MLflow drops its aliases too
            except MlflowException as error:
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":  # a concurrent prune got there first
                    raise
    failpoint("registry:versions_deleted")
    for item in pruned:
        if item.path is not None:
            _remove(item.path)
    refresh_aliases(client, model_name)


def _remove(folder: Path) -> None:
    """Hide, then delete: a folder at its visible name is always whole."""
    if folder.name.startswith("."):
        shutil.rmtree(folder, ignore_errors=True)
        return
    hidden = folder.with_name(f".{folder.name}.pruned-{uuid.uuid4().hex[:8]}")
    try:
        folder.rename(hidden)
    except FileNotFoundError:
        return
    failpoint("registry:folder_hidden")
    shutil.rmtree(hidden, ignore_errors=True)


def _versions(client: MlflowClient, filter_string: str) -> list:
    found, token = [], None
    while True:
        page = client.search_model_versions(filter_string, page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            return found


def _iteration(version) -> int | None:
    text = version.tags.get(ITERATION_TAG, "")
    return int(text) if text.isdigit() else None


def _artifact_dirs(client: MlflowClient, tracking_uri: str, agentr1_run_id: str, run_ids: set[str]) -> dict[str, Path]:
    """MLflow run id -> its local artifact folder, for the runs tagged with the pipeline run and those
    its versions name; runs whose artifacts are not local are left out (their files are left alone)."""
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    if experiments:
        tagged = client.search_runs(experiments, filter_string=f"tags.`{RUN_ID_TAG}` = '{agentr1_run_id}'",
                                    run_view_type=ViewType.ALL, max_results=1000)
        run_ids = run_ids | {run.info.run_id for run in tagged}
    folders = {}
    for run_id in sorted(run_ids):
        repo = get_artifact_repository(client.get_run(run_id).info.artifact_uri, tracking_uri=tracking_uri)
        if isinstance(repo, LocalArtifactRepository):
            folders[run_id] = Path(repo.artifact_dir).resolve()
    return folders


def _local(source: str) -> Path | None:
    """The folder a version's source names when it is a local path or file: URI; None otherwise."""
    if "://" in source and not source.startswith("file:"):
        return None
    try:
        return Path(local_file_uri_to_path(source)).resolve()
    except (OSError, ValueError):
        return None


def _version_folder(version, folders: dict[str, Path]) -> Path | None:
    """The version's artifact folder when it is exactly where `register_checkpoint` puts it in a local
    store (checkpoints/iteration=<k> of its MLflow run); None otherwise: nothing else is deleted."""
    root = folders.get(version.run_id)
    if root is None:
        return None
    expected = root / CHECKPOINT_ARTIFACT_DIR / f"iteration={_iteration(version)}"
    return expected if _local(version.source) == expected else None


def _leftovers(roots: Iterable[Path], keep: frozenset[int]) -> list[Path]:
    """Folders under the runs' checkpoints/ that belong to iterations not kept: a version's folder (kept
    only if a version uses it: the caller checks) or a hidden leftover of a killed write or prune."""
    found = []
    for root in roots:
        parent = root / CHECKPOINT_ARTIFACT_DIR
        if parent.is_dir():
            found += sorted(p for p in parent.iterdir()
                            if (m := _FOLDER.match(p.name)) and int(m["k"]) not in keep and p.is_dir())
    return found
