"""A registered model is a model you can load (issue 18): every iteration's checkpoint is an MLflow
pyfunc model, `mlflow.pyfunc.load_model("models:/<name>@latest")` generates text, the `best` alias
and the version tags say which version is which, and `agentr1 eval --checkpoint models:/...` runs it.

The fast tests register a tiny policy built in memory against a real SQLite store; the last one
trains the tiny config for one iteration and evaluates its registered version through the command.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlflow.pyfunc
import pytest

import agent_core.io.tracking as tracking
from agent_core.io.checkpoints import save_policy
from agent_core.io.layout import DataRoot, RunLayout
from agent_core.io.model_registry import (
    ALGORITHM_TAG,
    BEST_ALIAS,
    DEV_EM_TAG,
    ITERATION_TAG,
    RUN_ID_TAG,
    ModelRegistryError,
    registered_checkpoint,
)
from agent_core.io.query import run_query
from agent_core.io.tracking import Tracker
from agent_core.training.model import build_tiny_policy, build_tokenizer
from flows.cli import main as cli_main
from flows.eval import run_checkpoints

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "registry-test-policy"

# MLflow 3.17's SQLAlchemy store triggers this deprecation itself; nothing for us to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("registry")


@pytest.fixture(scope="module")
def tracker(data_root: Path) -> Tracker:
    root = DataRoot(data_root)
    return Tracker(root.mlflow_tracking_uri, root.mlflow_artifacts.resolve().as_uri(), "registry-test")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer(["who directed the film? <search>film</search> <answer>Ann Lee</answer>"] * 20,
                                vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("policy") / "checkpoint")


@pytest.fixture(scope="module")
def registered(tracker: Tracker, checkpoint: Path) -> tuple[str, list]:
    """Run "reg-a" registers iterations 0-2 (dev EM 0.25, 0.5, not evaluated)."""
    mlflow_run_id = tracker.start_run("reg-a", {})
    versions = [tracker.register_checkpoint(mlflow_run_id, checkpoint, MODEL, k, dev_em=em, algorithm="grpo")
                for k, em in enumerate((0.25, 0.5, math.nan))]
    return mlflow_run_id, versions


@pytest.fixture
def registry_env(monkeypatch, tracker: Tracker):
    """mlflow.pyfunc.load_model resolves models:/ URIs in the process-wide registry URI."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.tracking_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracker.tracking_uri)


def test_latest_loads_as_a_pyfunc_model_that_generates_text(registered, registry_env):
    _, versions = registered
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@latest")
    assert model.metadata.flavors["python_function"]["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    conversation = [{"role": "user", "content": "who directed the film?"}]
    outputs = model.predict(["who directed", conversation], params={"max_new_tokens": 6})
    assert len(outputs) == 2 and all(isinstance(text, str) and text for text in outputs)
    # the same conversation as a record (what `mlflow models serve` gets as dataframe_records) is the same prompt
    assert model.predict([{"messages": conversation}], params={"max_new_tokens": 6}) == outputs[1:]
    assert versions[-1].uri == f"models:/{MODEL}/3"


def test_versions_are_tagged_and_best_is_the_highest_dev_em_later_on_ties(registered, tracker, checkpoint):
    mlflow_run_id, versions = registered
    found = {int(v.version): v for v in tracker.client.search_model_versions(f"name = '{MODEL}'")}
    assert [found[v.version].tags for v in versions] == [
        {RUN_ID_TAG: "reg-a", ITERATION_TAG: "0", DEV_EM_TAG: "0.25", ALGORITHM_TAG: "grpo"},
        {RUN_ID_TAG: "reg-a", ITERATION_TAG: "1", DEV_EM_TAG: "0.5", ALGORITHM_TAG: "grpo"},
        {RUN_ID_TAG: "reg-a", ITERATION_TAG: "2", ALGORITHM_TAG: "grpo"},  # not evaluated: no dev EM
    ]
    assert all(found[v.version].run_id == mlflow_run_id for v in versions)
    assert tracker.client.get_registered_model(MODEL).aliases == {BEST_ALIAS: 2}
    assert tracker.client.get_model_version_by_alias(MODEL, "latest").version == 3

    other = tracker.start_run("reg-b", {})
    tie = tracker.register_checkpoint(other, checkpoint, MODEL, 0, dev_em=0.5, algorithm="ppo")
    assert tracker.client.get_registered_model(MODEL).aliases == {BEST_ALIAS: tie.version}
    assert tracker.client.get_model_version_by_alias(MODEL, "latest").version == tie.version


def test_registering_again_and_after_a_kill_between_logging_and_registering_adds_no_version(
        tracker, checkpoint, monkeypatch):
    mlflow_run_id = tracker.start_run("reg-kill", {})
    name = "registry-kill-policy"

    def killed(point: str) -> None:
        if point == "tracking:checkpoint_artifacts_logged":
            raise SystemExit("killed")

    monkeypatch.setattr(tracking, "failpoint", killed)
    with pytest.raises(SystemExit):
        tracker.register_checkpoint(mlflow_run_id, checkpoint, name, 0)
    monkeypatch.undo()
    first = tracker.register_checkpoint(mlflow_run_id, checkpoint, name, 0)
    assert tracker.register_checkpoint(mlflow_run_id, checkpoint, name, 0) == first
    assert [v.version for v in tracker.client.search_model_versions(f"name = '{name}'")] == [1]
    assert first.source.endswith("/checkpoints/iteration=0")
    assert (Path(first.source.removeprefix("file://")) / "MLmodel").is_file()


def test_a_models_uri_resolves_to_a_downloaded_checkpoint_under_the_data_root(registered, tracker, data_root):
    best = tracker.client.get_registered_model(MODEL).aliases[BEST_ALIAS]
    by_alias = registered_checkpoint(f"models:/{MODEL}@{BEST_ALIAS}", tracker.tracking_uri, data_root)
    assert by_alias == data_root / "models" / MODEL / f"version={best}" / "artifacts" / "checkpoint"
    assert {p.name for p in by_alias.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    by_version = registered_checkpoint(f"models:/{MODEL}/{best}", tracker.tracking_uri, data_root)
    assert by_version == by_alias and by_alias.stat().st_mtime_ns == by_version.stat().st_mtime_ns  # reused
    run = RunLayout(data_root, "any")
    chosen = run_checkpoints(run, ["agent"], f"models:/{MODEL}@latest", tracker.tracking_uri)
    newest = max(int(v.version) for v in tracker.client.search_model_versions(f"name = '{MODEL}'"))
    assert Path(chosen["agent"]) == data_root / "models" / MODEL / f"version={newest}" / "artifacts" / "checkpoint"


@pytest.mark.parametrize("uri, message", [
    ("models:/no-such-model/1", f"no registered model 'no-such-model' in .*; registered models: .*{MODEL}"),
    (f"models:/{MODEL}/99", f"model '{MODEL}' has no version 99; its versions: 1, 2, 3(, 4)?$"),
    (f"models:/{MODEL}@champion", f"model '{MODEL}' has no alias 'champion'; its aliases: best \\(version \\d\\)"),
    (f"models:/{MODEL}", "use models:/<name>/<version> or models:/<name>@<alias>"),
])
def test_an_unknown_model_version_or_alias_is_one_clear_error(registered, tracker, data_root, uri, message):
    with pytest.raises(ModelRegistryError, match=message):
        registered_checkpoint(uri, tracker.tracking_uri, data_root)


def test_a_data_root_without_a_store_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MLflow store at"):
        registered_checkpoint("models:/x/1", DataRoot(tmp_path).mlflow_tracking_uri, tmp_path)


# ---- a real run, end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from agent_core.validation import load_config
    from flows.train import train

    data_root = tmp_path_factory.mktemp("registry-run")
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml",
                         [f"data_root={data_root}", "run_id=reg-run", "iterations=1", "tracking.experiment=regexp"])
    return data_root, train(config)


def test_a_trained_run_registers_a_loadable_model_that_agentr1_eval_scores(trained, monkeypatch, capsys):
    data_root, result = trained
    uri = DataRoot(data_root).mlflow_tracking_uri
    assert (result.model_name, result.model_version) == ("regexp-policy", 1)  # named after the experiment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    (version,) = mlflow.tracking.MlflowClient(uri).search_model_versions("name = 'regexp-policy'")
    assert version.tags == {RUN_ID_TAG: "reg-run", ITERATION_TAG: "0", ALGORITHM_TAG: "grpo",
                            DEV_EM_TAG: repr(result.iterations[0].dev_em)}
    texts = mlflow.pyfunc.load_model("models:/regexp-policy@latest").predict("Who directed", {"max_new_tokens": 8})
    assert len(texts) == 1 and isinstance(texts[0], str) and texts[0]

    code = cli_main(["eval", "--data-root", str(data_root), "--run-id", "reg-run", "--checkpoint",
                     "models:/regexp-policy@latest", "--methods", "agent", "--seeds", "1", "--limit", "2",
                     "--eval-id", "reg-eval"])
    assert code == 0, capsys.readouterr().err
    rows = run_query(data_root, "select method, checkpoint, count(*) as n from eval group by all").to_pylist()
    checkpoint = str(data_root / "models" / "regexp-policy" / "version=1" / "artifacts" / "checkpoint")
    assert rows == [{"method": "agent", "checkpoint": checkpoint, "n": 2}]

    code = cli_main(["eval", "--data-root", str(data_root), "--run-id", "reg-run", "--checkpoint",
                     "models:/regexp-policy/7", "--methods", "agent", "--seeds", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == ["agentr1: error: model 'regexp-policy' has no version 7; its versions: 1"]
