"""Registered policies as MLflow models (docs/architecture.md §8): what a checkpoint becomes when it
is logged, the aliases and tags of its versions, and the way back from a `models:/` URI to a
checkpoint directory the pipeline's loaders read.

A logged checkpoint is an MLflow pyfunc model saved from code (`policy_pyfunc.py`, copied into
the model) whose one artifact is the checkpoint directory, so
`mlflow.pyfunc.load_model("models:/<name>@latest").predict(...)` generates text and
`mlflow models serve` serves it. The transformers flavor was the first choice, but MLflow 3.17's
support stops at transformers 5.17: saving from a checkpoint directory fails on 5.23, and saving a
pipeline re-serialises the model and looks for a model card on the Hub.

The model is saved with `save_model`, not `log_model`: that keeps to the explicit client (no active
run), and a rerun after a kill overwrites the same artifact path instead of creating a second logged
model. In a local artifact store it is built in a hidden folder beside its artifact path and renamed
in (`place_policy_model`), its checkpoint files hard links of the run's (no second copy on disk).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version as package_version
from pathlib import Path

from agent_core.io.mlflow_env import mlflow_env  # noqa: F401  (first: it sets MLflow's environment)
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from agent_core.failpoints import failpoint  # noqa: E402
from agent_core.io.checkpoints import check_checkpoint, save_merged_policy, swap_into_place  # noqa: E402
from agent_core.io.layout import DataRoot  # noqa: E402
from agent_core.io.lora_checkpoints import is_lora_checkpoint  # noqa: E402
from agent_core.io.mlflow_store import reroot_store, sqlite_store_path  # noqa: E402

RUN_ID_TAG = "agentr1.run_id"
ITERATION_TAG = "iteration"
DEV_EM_TAG = "dev_em"
ALGORITHM_TAG = "algorithm"
LATEST_ALIAS = "latest"
BEST_ALIAS = "best"
CHECKPOINT_ARTIFACT = "checkpoint"  # the name of the checkpoint directory in the model's artifacts
MODEL_CODE = Path(__file__).with_name("policy_pyfunc.py")
_REQUIREMENTS = ("mlflow", "torch", "transformers")
_MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>[^/@]+)|@(?P<alias>[^/@]+))/?$")
_CACHE_RECORD = "registered_model.json"


class ModelRegistryError(ValueError):
    """A registered model, version or alias that does not exist; the message names what does."""


def is_model_uri(location: str | None) -> bool:
    return bool(location) and str(location).startswith("models:/")


def _requirements() -> list[str]:
    """Pinned to what saved the model; a local build label (torch's `+cpu`) is no pip version."""
    pins = []
    for name in _REQUIREMENTS:
        try:
            pins.append(f"{name}=={package_version(name).split('+')[0]}")
        except PackageNotFoundError:
            pins.append(name)
    return pins


def _signature():
    """No input schema (prompts come as strings, conversations or records, see policy_pyfunc.py),
    one string out per prompt, and the generation params a caller may set per request."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=None,
        outputs=Schema([ColSpec(DataType.string)]),
        params=ParamSchema([
            ParamSpec("max_new_tokens", DataType.long, 128),
            ParamSpec("temperature", DataType.double, 0.0),
            ParamSpec("top_p", DataType.double, 1.0),
        ]),
    )


def save_policy_model(checkpoint_dir: Path, path: Path) -> Path:
    """Save the checkpoint at `checkpoint_dir` as an MLflow pyfunc model in `path` (which must not
    exist); the checkpoint lands in `path/artifacts/checkpoint`, its files hard links of
    `checkpoint_dir`'s where both are on one filesystem (copies otherwise). For a full checkpoint
    nothing is loaded (no weights read, no input example run). A LoRA checkpoint (adapter + base
    path) is loaded and merged into a full one written there, so the model loads with transformers
    alone, without peft or the run's base checkpoint."""
    checkpoint_dir = check_checkpoint(Path(checkpoint_dir))
    path = Path(path)
    # MLflow copies an artifact into a temporary folder of its own before moving it into the model:
    # it gets an empty placeholder, and the checkpoint is put in its place afterwards.
    with tempfile.TemporaryDirectory(prefix="agentr1-placeholder-") as scratch:
        placeholder = Path(scratch) / CHECKPOINT_ARTIFACT
        placeholder.mkdir()
        _save_pyfunc(placeholder, path)
    target = path / "artifacts" / CHECKPOINT_ARTIFACT
    target.rmdir()  # the placeholder, empty
    if is_lora_checkpoint(checkpoint_dir):
        save_merged_policy(checkpoint_dir, target)  # new weights: nothing to link
    else:
        link_tree(checkpoint_dir, target)
    _record_artifact(path, checkpoint_dir)
    return path


def place_policy_model(checkpoint_dir: Path, final: Path) -> Path:
    """`save_policy_model` into `final`, a local artifact path, replacing what is there: built in a
    hidden sibling and renamed in, so a kill leaves the previous content or the whole new model,
    never half a model. Temporaries of a killed earlier try of the same path are removed first (the
    run's lock makes this process the only writer of its artifacts)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.*"):
        if re.fullmatch(rf"\.{re.escape(final.name)}\.(tmp|old)-[0-9a-f]{{8}}", stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    staging = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_policy_model(checkpoint_dir, staging)
        failpoint("registry:model_staged")
        swap_into_place(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


# A hard link cannot cross filesystems (EXDEV), may be refused (EPERM: fs.protected_hardlinks, or a
# filesystem without links) or exceed the link limit (EMLINK): a copy then.
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})


def link_tree(source: Path, target: Path) -> Path:
    """`target` (which must not exist) as a copy of the tree `source` whose files are hard links of
    the source's. Safe because a checkpoint's files are never modified in place: `save_policy` (and
    every checkpoint writer) writes a new folder and renames it over the old one, and pruning
    deletes names, so a registered model keeps the inodes it links whatever the run does next."""
    shutil.copytree(source, target, copy_function=_link_or_copy)
    return target


def _link_or_copy(source: str, target: str) -> str:
    try:
        os.link(source, target)
    except OSError as error:
        if error.errno not in _NO_LINK:
            raise
        shutil.copy2(source, target)
    return target


def _record_artifact(path: Path, checkpoint_dir: Path) -> None:
    """The MLmodel names the checkpoint it was made from (not the placeholder) and the model's real size."""
    from mlflow.models import Model
    from mlflow.utils.file_utils import get_total_file_size

    model = Model.load(str(path))
    model.flavors["python_function"]["artifacts"][CHECKPOINT_ARTIFACT]["uri"] = str(checkpoint_dir)
    model.model_size_bytes = get_total_file_size(path)
    model.save(str(path / "MLmodel"))


def _save_pyfunc(checkpoint_dir: Path, path: Path) -> Path:
    import mlflow.pyfunc

    with warnings.catch_warnings():
        # Without an input example MLflow warns on every save; an example would load the model just
        # to save it. Its hint to add type hints to `predict` is raised under a "once" filter that
        # MLflow installs itself (mlflow.utils.annotations.filter_user_warnings_once), which beats
        # any filter set here, so it is dropped where it is shown; type hints cannot say "a string,
        # a conversation or records".
        warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow\.")
        warnings.showwarning = _without_type_hint_advice(warnings.showwarning)
        mlflow.pyfunc.save_model(
            path=str(path), python_model=str(MODEL_CODE), artifacts={CHECKPOINT_ARTIFACT: str(checkpoint_dir)},
            signature=_signature(), pip_requirements=_requirements(),
        )
    return Path(path)


def _without_type_hint_advice(show):
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "Add type hints to the `predict` method" not in str(message):
            show(message, category, filename, lineno, file, line)
    return showwarning


def model_checkpoint_dir(model_dir: Path) -> Path:
    """The checkpoint directory inside a downloaded model version: the pyfunc model's "checkpoint"
    artifact, or the directory itself for versions registered as plain checkpoint folders."""
    model_dir = Path(model_dir)
    if (model_dir / "MLmodel").is_file():
        from mlflow.models import Model

        artifacts = Model.load(str(model_dir)).flavors.get("python_function", {}).get("artifacts", {})
        if CHECKPOINT_ARTIFACT not in artifacts:
            raise ModelRegistryError(f"the MLflow model in {model_dir} has no {CHECKPOINT_ARTIFACT!r} artifact: "
                                     "it was not logged by this pipeline")
        model_dir = model_dir / artifacts[CHECKPOINT_ARTIFACT]["path"]
    return check_checkpoint(model_dir)


# ---- aliases ----------------------------------------------------------------------------------


def _dev_em(tags: dict[str, str]) -> float | None:
    try:
        value = float(tags[DEV_EM_TAG])
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) else None


def best_version(client: MlflowClient, model_name: str,
                 excluding: frozenset[int] = frozenset()) -> tuple[float, int] | None:
    """(dev EM, version) of the version with the highest dev EM among the model's versions that have
    one (ties: the later version), leaving out the version numbers `excluding`; None when none has one
    (or the model does not exist yet)."""
    versions = client.search_model_versions(f"name = '{model_name}'")
    scored = [(em, int(v.version)) for v in versions
              if (em := _dev_em(v.tags)) is not None and int(v.version) not in excluding]
    return max(scored) if scored else None


def refresh_aliases(client: MlflowClient, model_name: str, excluding: frozenset[int] = frozenset()) -> dict[str, int]:
    """Point `best` at `best_version` (of the versions not in `excluding`: about to be deleted); returns
    alias -> version. Derived from the versions each time, so a rerun after a kill repairs it. `latest`
    needs no setting: MLflow reserves that alias name and resolves models:/<name>@latest to the highest
    version, i.e. the newest registered iteration of the run that registered last."""
    best = best_version(client, model_name, excluding)
    if best is None:
        return {}
    client.set_registered_model_alias(model_name, BEST_ALIAS, str(best[1]))
    return {BEST_ALIAS: best[1]}


def version_tags(run_id: str, iteration: int, dev_em: float | None, algorithm: str | None) -> dict[str, str]:
    """The tags of a registered version: pipeline run id, iteration, dev EM (when it was evaluated:
    a finite number) and the advantage estimator."""
    tags = {RUN_ID_TAG: run_id, ITERATION_TAG: str(int(iteration))}
    if dev_em is not None and math.isfinite(float(dev_em)):
        tags[DEV_EM_TAG] = repr(float(dev_em))
    if algorithm:
        tags[ALGORITHM_TAG] = str(algorithm)
    return tags


# ---- from a models:/ URI back to a checkpoint --------------------------------------------------


def _listing(items: Iterable[str], limit: int = 20) -> str:
    items = list(items)
    shown = ", ".join(items[:limit]) or "(none)"
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")


def _lookup(client: MlflowClient, model_uri: str, tracking_uri: str):
    """The ModelVersion `model_uri` names; ModelRegistryError naming what exists if there is none."""
    match = _MODEL_URI.match(model_uri)
    if match is None:
        raise ModelRegistryError(f"cannot read model URI {model_uri!r}: use models:/<name>/<version> or models:/<name>@<alias>")
    name, number, alias = match["name"], match["version"], match["alias"]
    try:
        registered = client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        names = sorted(m.name for m in client.search_registered_models(max_results=1000))
        raise ModelRegistryError(f"no registered model {name!r} in {tracking_uri}; registered models: {_listing(names)}") from None
    numbers = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    if not numbers:
        raise ModelRegistryError(f"registered model {name!r} has no versions yet")
    if alias is not None and alias.lower() == LATEST_ALIAS:
        alias, number = None, numbers[-1]  # MLflow's reserved alias: the highest version
    if alias is not None:
        if alias not in registered.aliases:
            aliases = [f"{a} (version {v})" for a, v in sorted(registered.aliases.items())]
            raise ModelRegistryError(f"model {name!r} has no alias {alias!r}; its aliases: {_listing(aliases)}")
        number = registered.aliases[alias]
    if not str(number).isdigit() or int(number) not in numbers:
        raise ModelRegistryError(f"model {name!r} has no version {number}; its versions: {_listing(map(str, numbers))}")
    return client.get_model_version(name, str(int(number)))


def _store_exists(tracking_uri: str) -> None:
    """A missing SQLite store is a wrong data root, not a request to create an empty one (and
    MLflow would spend seconds migrating a fresh database only to find nothing in it)."""
    path = sqlite_store_path(tracking_uri)
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"no MLflow store at {path}: nothing was registered there (is the data root right?)")


def _cache_dir(data_root: Path, name: str, number: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)  # a model name may hold characters no folder should
    return Path(data_root) / "models" / safe / f"version={number}"


def registered_checkpoint(model_uri: str, tracking_uri: str, data_root: Path) -> Path:
    """The checkpoint directory of registered version `model_uri` (models:/<name>/<version> or
    models:/<name>@<alias>), downloaded once to <data_root>/models/<name>/version=<v>/.

    The data root's own store is re-rooted first if the data root was moved (mlflow_store.py); a
    store in place is only read. A version's files never change, so a complete download is reused
    (also after a move: it is recorded by the version's run, not its absolute source), and a folder
    that came from another store (same name and number) is replaced. The download lands in a
    hidden temporary folder and is renamed into place, so a killed download is never mistaken for
    a complete one."""
    _store_exists(tracking_uri)
    reroot_store(tracking_uri, DataRoot(Path(data_root)).mlflow_artifacts)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = _lookup(client, model_uri, tracking_uri)
    target = _cache_dir(data_root, found.name, found.version)
    record = {"name": found.name, "version": int(found.version), "source": found.source, "run_id": found.run_id}
    if _same_version(_cached(target), record):
        return model_checkpoint_dir(target)
    staging = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        _download(found, staging, tracking_uri)
        (staging / _CACHE_RECORD).write_text(json.dumps(record, indent=1))
        model_checkpoint_dir(staging)  # fail before the rename if the version holds no checkpoint
        swap_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_checkpoint_dir(target)


def _cached(target: Path) -> dict | None:
    try:
        return json.loads((target / _CACHE_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _same_version(cached: dict | None, record: dict) -> bool:
    """The same version of the same store: by its MLflow run (a random id, kept when the data root
    moves, while the source's absolute path changes), or by its source without a run."""
    if cached is None:
        return False
    keys = ("name", "version", "run_id") if record["run_id"] else ("name", "version", "source")
    return all(cached.get(key) == record[key] for key in keys)


def _download(found, staging: Path, tracking_uri: str) -> None:
    """Copy the version's files into `staging` itself (MLflow downloads into a subfolder named
    after the source's last path component). Missing files are one ModelRegistryError."""
    import mlflow.artifacts

    try:
        fetched = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=found.source, dst_path=str(staging / "download"), tracking_uri=tracking_uri))
    except MlflowException as error:
        detail = " ".join(str(error.message).split())[:300]
        raise ModelRegistryError(f"version {found.version} of model {found.name!r} cannot be downloaded from "
                                 f"{found.source} ({detail}): were its artifacts moved or deleted?") from None
    for item in fetched.iterdir():
        item.rename(staging / item.name)
    shutil.rmtree(staging / "download", ignore_errors=True)
