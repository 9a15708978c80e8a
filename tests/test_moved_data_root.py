"""A data root that moves (issue 29): after a data root is copied or moved (and the old one removed),
its runs, registered versions and artifacts resolve where it is now, a resumed run writes nothing to
the old place, and loading a registered model writes nothing into the store.

The fast tests register a tiny policy in a small store, move it and open it again; the slow one
trains the tiny config, moves the data root and runs `agentr1 resume`, `agentr1 eval --checkpoint
models:/...@best` and `mlflow.pyfunc.load_model` there.
"""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path
from urllib.parse import unquote

import mlflow.pyfunc
import pytest

from agent_core.io.checkpoints import save_policy
from agent_core.io.layout import DataRoot
from agent_core.io.mlflow_store import LOCATION_COLUMNS, reroot_store
from agent_core.io.model_registry import BEST_ALIAS, ModelRegistryError, registered_checkpoint
from agent_core.io.tracking import Tracker
from agent_core.training.model import build_tiny_policy, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "moved-policy"

# MLflow 3.17's SQLAlchemy store triggers this deprecation itself; nothing for us to fix.
pytestmark = [pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
              pytest.mark.filterwarnings("ignore:.*Add type hints to the `predict` method")]


def _tracker(root: Path) -> Tracker:
    data = DataRoot(root)
    return Tracker(data.mlflow_tracking_uri, data.mlflow_artifacts.resolve().as_uri(), "moved")


def _locations(root: Path) -> list[str]:
    """Every artifact location in the store (the Default experiment's, which MLflow puts in the
    current folder of whoever created the store, left out: nothing of ours uses it)."""
    with sqlite3.connect(root / "mlflow.db") as db:
        found = []
        for table, column in LOCATION_COLUMNS:
            if db.execute(f"select 1 from pragma_table_info('{table}') where name = '{column}'").fetchone():
                found += [v for (v,) in db.execute(f"select {column} from {table}") if v]
        default = db.execute("select artifact_location from experiments where experiment_id = 0").fetchone()
    return [v for v in found if not default or v != default[0]]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) if p.is_file() else "dir" for p in folder.rglob("*")}


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


def _mlflow_meta_only(changed: set[str]) -> bool:
    """MLflow loads a version of a local artifact store in place and writes its own two-line
    `registered_model_meta` (name, version) beside the model: the one file it may write."""
    return all(Path(path).name == "registered_model_meta" and "/checkpoints/iteration=" in path for path in changed)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer(["who directed the film? <search>film</search> <answer>Ann Lee</answer>"] * 20,
                                vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("policy") / "checkpoint")


@pytest.fixture(scope="module")
def moved(tmp_path_factory, checkpoint: Path) -> tuple[Path, Path, str]:
    """A store with run "mv-a" and versions 1-2 of MODEL (best: 2, already downloaded once), copied
    to a new place; the old one removed. Folder names with `%`, `_` and `=` (the re-rooting compares
    prefixes with substr, not LIKE). Returns (old root, new root, MLflow run id)."""
    parent = tmp_path_factory.mktemp("moving")
    old, new = parent / "old_root%1", parent / "new=root"
    tracker = _tracker(old)
    mlflow_run_id = tracker.start_run("mv-a", {"lr": 0.1})
    for iteration, dev_em in enumerate((0.25, 0.5)):
        tracker.register_checkpoint(mlflow_run_id, checkpoint, MODEL, iteration, dev_em=dev_em)
    tracker.log_text(mlflow_run_id, "before the move", "notes/before.txt")
    registered_checkpoint(f"models:/{MODEL}@{BEST_ALIAS}", tracker.tracking_uri, old)
    shutil.copytree(old, new)
    shutil.rmtree(old)
    return old, new, mlflow_run_id


def test_a_moved_store_is_rerooted_on_open_once_and_its_download_reused(moved, monkeypatch):
    old, new, _ = moved
    assert all(str(old) in unquote(v) for v in _locations(new))  # what MLflow wrote: absolute, the old place
    cached = new / "models" / MODEL / "version=2" / "artifacts" / "checkpoint"
    before = cached.stat().st_mtime_ns

    monkeypatch.chdir(new.parent)  # a relative data root, as `--data-root data` gives
    found = registered_checkpoint(f"models:/{MODEL}@{BEST_ALIAS}", DataRoot(new).mlflow_tracking_uri, Path(new.name))

    assert found.resolve() == cached and found.stat().st_mtime_ns == before  # the copied download is the same version
    artifacts = (new / "mlartifacts").as_uri()
    assert _locations(new) and all(v == artifacts or v.startswith(artifacts + "/") for v in _locations(new))
    digest = _digest(new / "mlflow.db")
    assert reroot_store(DataRoot(new).mlflow_tracking_uri, new / "mlartifacts") == 0  # done once
    assert _digest(new / "mlflow.db") == digest
    assert not old.exists()


def test_mlflow_loads_a_models_uri_in_the_moved_root_and_writes_nothing(moved, monkeypatch):
    old, new, _ = moved
    uri = DataRoot(new).mlflow_tracking_uri
    registered_checkpoint(f"models:/{MODEL}/1", uri, new)  # opened (re-rooted) by us first
    digest, files = _digest(new / "mlflow.db"), _snapshot(new)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)

    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@{BEST_ALIAS}")

    assert len(model.predict("who directed", params={"max_new_tokens": 3})) == 1
    assert _digest(new / "mlflow.db") == digest  # the store is only read
    assert _mlflow_meta_only(_changed(files, _snapshot(new)))  # no download cache or anything else in the data root
    assert not old.exists()


def test_a_resumed_run_in_the_moved_root_writes_its_artifacts_there(moved, checkpoint):
    old, new, mlflow_run_id = moved
    tracker = _tracker(new)
    assert tracker.start_run("mv-a", {"lr": 0.1}) == mlflow_run_id  # the same MLflow run

    tracker.log_text(mlflow_run_id, "after the move", "notes/after.txt")
    version = tracker.register_checkpoint(mlflow_run_id, checkpoint, MODEL, 2, dev_em=0.75)

    notes = new / "mlartifacts" / mlflow_run_id / "artifacts" / "notes"
    assert sorted(p.name for p in notes.iterdir()) == ["after.txt", "before.txt"]
    assert version.source == (new / "mlartifacts").as_uri() + f"/{mlflow_run_id}/artifacts/checkpoints/iteration=2"
    found = registered_checkpoint(f"models:/{MODEL}@{BEST_ALIAS}", tracker.tracking_uri, new)
    assert found == new / "models" / MODEL / f"version={version.version}" / "artifacts" / "checkpoint"
    assert not old.exists()


def test_missing_artifacts_of_a_version_are_one_line_error(moved, tmp_path):
    _, new, mlflow_run_id = moved
    broken = tmp_path / "broken"
    shutil.copytree(new, broken, ignore=shutil.ignore_patterns("models"))
    shutil.rmtree(broken / "mlartifacts" / mlflow_run_id / "artifacts" / "checkpoints" / "iteration=0")
    one_line = r"^version 1 of model 'moved-policy' cannot be downloaded from file://.*iteration=0 \(.*\): were its"
    with pytest.raises(ModelRegistryError, match=one_line + r" artifacts moved or deleted\?$"):
        registered_checkpoint(f"models:/{MODEL}/1", DataRoot(broken).mlflow_tracking_uri, broken)
    with pytest.raises(ModelRegistryError, match=f"model '{MODEL}' has no alias 'champion'"):
        registered_checkpoint(f"models:/{MODEL}@champion", DataRoot(broken).mlflow_tracking_uri, broken)


def test_a_store_whose_artifacts_live_elsewhere_is_left_alone(moved, tmp_path):
    """A store named by tracking.tracking_uri may serve several data roots: only a store with its
    artifact folder beside it is a data root's own."""
    _, new, _ = moved
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy(new / "mlflow.db", shared / "mlflow.db")
    locations = _locations(shared)
    uri = f"sqlite:///{shared / 'mlflow.db'}"
    assert reroot_store(uri, tmp_path / "elsewhere" / "mlartifacts") == 0
    assert reroot_store(uri, (shared / "artifacts").as_uri()) == 0  # beside it, but another folder name
    assert _locations(shared) == locations
    assert reroot_store(uri, shared / "mlartifacts") > 0 and _locations(shared) != locations  # the rule's other side


# ---- a real run, end to end ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_finished_run_moved_elsewhere_resumes_evaluates_and_loads_without_touching_the_old_place(
        tmp_path, monkeypatch, capsys):
    from flows.cli import main as cli_main

    parent = tmp_path / "roots"
    old, new = parent / "first", parent / "second"
    cwd = tmp_path / "cwd"  # MLflow's default store is ./mlflow.db: nothing of ours may fall back to it
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert cli_main(["train", "--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--data-root", str(old),
                     "--run-id", "mv-run", "--set", "iterations=1", "--set", "tracking.experiment=mvexp"]) == 0
    shutil.copytree(old, new)
    shutil.rmtree(old)
    capsys.readouterr()

    assert cli_main(["resume", "--data-root", str(new), "--run-id", "mv-run"]) == 0, capsys.readouterr().err
    assert cli_main(["eval", "--data-root", str(new), "--run-id", "mv-run", "--checkpoint",
                     f"models:/mvexp-policy@{BEST_ALIAS}", "--methods", "agent", "--seeds", "1", "--limit", "2",
                     "--eval-id", "mv-eval"]) == 0, capsys.readouterr().err
    uri = DataRoot(new).mlflow_tracking_uri
    digest = _digest(new / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    texts = mlflow.pyfunc.load_model(f"models:/mvexp-policy@{BEST_ALIAS}").predict("Who directed",
                                                                                 {"max_new_tokens": 4})

    assert len(texts) == 1 and _digest(new / "mlflow.db") == digest
    assert sorted(p.name for p in parent.iterdir()) == ["second"]  # the old root did not come back
    assert list(cwd.iterdir()) == []
    artifacts = (new / "mlartifacts").as_uri()
    assert all(v.startswith(artifacts + "/") or v == artifacts for v in _locations(new))
    assert (new / "evals" / "mv-eval" / "report.md").is_file()
    assert (new / "models" / "mvexp-policy" / "version=1" / "artifacts" / "checkpoint").is_dir()


def test_agentr1_runs_points_a_moved_store_at_its_new_place(moved, tmp_path, capsys):
    """`agentr1 runs` is the cheap command the README names before `mlflow models serve` on a moved root."""
    from flows.cli import main as cli_main

    _, new, _ = moved
    registered_checkpoint(f"models:/{MODEL}/1", DataRoot(new).mlflow_tracking_uri, new)  # rooted at `new` now
    copy = tmp_path / "copied root"
    shutil.copytree(new, copy)
    assert all(str(new) in unquote(v) for v in _locations(copy))

    assert cli_main(["runs", "--data-root", str(copy)]) == 0

    assert "the MLflow store moved with the data root" in capsys.readouterr().out
    artifacts = (copy / "mlartifacts").as_uri()
    assert all(v == artifacts or v.startswith(artifacts + "/") for v in _locations(copy))
    assert cli_main(["runs", "--data-root", str(copy)]) == 0
    assert "moved" not in capsys.readouterr().out  # once
