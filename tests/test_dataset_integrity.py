"""Dataset tables have a manifest with their SHA-256 like run tables (issue 39 item 7): a corpus or
prompts table edited by hand into other valid Parquet is named in one line when the dataset is
reused and rebuilt from its source (the edited file kept aside), never used; a dataset prepared
before dataset manifests gets one on first reuse, after its content is checked. The manifest alone
is never trusted (issue 55 item 6): an edited table with its manifest edited to match is caught by
comparing the tables with a fresh build, which the dataset id pins."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from agent_core.config import DataConfig
from agent_core.io.layout import DataRoot
from flows.cli import main as cli_main
from tasks.prepare_data import prepare_dataset

DATA = DataConfig(num_films=24, num_people=20, num_cities=8, num_countries=4)
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def prepared(tmp_path):
    uris = prepare_dataset.fn(str(tmp_path), DATA)
    files = {"corpus": Path(uris.corpus_uri), "prompts": Path(uris.prompts_uri)}
    return tmp_path, uris, files, {name: path.read_bytes() for name, path in files.items()}


def _halve(path: Path) -> int:
    """Drop every other row and write the rest back as valid Parquet (what an edit by hand does)."""
    table = pq.read_table(path)
    kept = table.take(list(range(0, table.num_rows, 2)))
    pq.write_table(kept, path)
    return kept.num_rows


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("tasks.")]


def _manifest(root: Path, uris) -> Path:
    return DataRoot(root).dataset_dir(uris.dataset_id) / "_manifests" / "prepare_dataset.json"


def _forge_manifest(manifest: Path, table: Path) -> None:
    """What the attack did: the edited table's SHA-256 and size written into the dataset's manifest."""
    data = json.loads(manifest.read_text())
    name = "corpus" if table.name == "corpus.parquet" else "dataset_prompts"
    data["output_fingerprints"][name] = hashlib.sha256(table.read_bytes()).hexdigest()
    data["output_sizes"][name] = table.stat().st_size
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize("table", ["corpus", "prompts"])
def test_an_edited_table_is_named_in_one_line_and_rebuilt(prepared, table, caplog):
    root, uris, files, pristine = prepared
    rows = _halve(files[table])
    with caplog.at_level(logging.INFO):
        assert prepare_dataset.fn(str(root), DATA) == uris
    said = _warnings(caplog)
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"{table}.parquet" in said[0] and "changed since it was prepared" in said[0] and "rebuilt" in said[0], said
    assert {name: path.read_bytes() for name, path in files.items()} == pristine  # the dataset as it was
    kept = [p for p in files[table].parent.iterdir() if p.name.startswith(f"{table}.parquet.edited-")]
    assert len(kept) == 1 and pq.read_table(kept[0]).num_rows == rows and kept[0].name in said[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        prepare_dataset.fn(str(root), DATA)
    assert _warnings(caplog) == []  # rebuilt once, then reused


@pytest.mark.parametrize("table", ["corpus", "prompts"])
def test_an_edited_table_with_its_manifest_edited_to_match_is_still_rebuilt(prepared, table, caplog):
    root, uris, files, pristine = prepared
    _halve(files[table])
    _forge_manifest(_manifest(root, uris), files[table])
    assert prepare_dataset.fn(str(root), DATA) == uris  # the manifest vouched for the half
    said = _warnings(caplog)
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"{table}.parquet changed since it was prepared (its manifest edited to match)" in said[0], said
    assert {name: path.read_bytes() for name, path in files.items()} == pristine
    caplog.clear()
    prepare_dataset.fn(str(root), DATA)
    assert _warnings(caplog) == []  # the manifest rewritten by the rebuild: reused from here on


def test_an_intact_dataset_is_reused_without_a_word_or_a_write(prepared, caplog):
    root, uris, files, _ = prepared
    stamps = {p: p.stat().st_mtime_ns for p in [*files.values(), _manifest(root, uris)]}
    with caplog.at_level(logging.INFO):
        prepare_dataset.fn(str(root), DATA)
    assert _warnings(caplog) == [] and {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_a_dataset_prepared_before_manifests_gets_one_on_first_reuse(prepared, caplog):
    root, uris, files, pristine = prepared
    _manifest(root, uris).unlink()
    stamps = {p: p.stat().st_mtime_ns for p in files.values()}
    with caplog.at_level(logging.INFO):
        prepare_dataset.fn(str(root), DATA)
    said = _warnings(caplog)
    assert len(said) == 1 and "no manifest" in said[0] and "recorded" in said[0], said
    assert _manifest(root, uris).is_file() and {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_a_dataset_prepared_before_manifests_and_edited_is_rebuilt_not_blessed(prepared, caplog):
    root, uris, files, pristine = prepared
    _manifest(root, uris).unlink()
    _halve(files["corpus"])
    with caplog.at_level(logging.INFO):
        prepare_dataset.fn(str(root), DATA)
    said = _warnings(caplog)
    assert len(said) == 1 and "corpus.parquet" in said[0] and "rebuilt" in said[0], said
    assert {name: path.read_bytes() for name, path in files.items()} == pristine


@pytest.mark.slow
@pytest.mark.parametrize("forge", [False, True], ids=["manifest-kept", "manifest-forged"])
def test_a_resume_names_a_halved_corpus_and_trains_as_before(tmp_path, caplog, forge):
    """The attack as tried: a finished run, its dataset's corpus halved (issue 39), and its manifest
    given the halved file's SHA-256 and size (issue 55: resume redid the rollout on the half), `agentr1 resume`."""
    config = str(REPO_ROOT / "configs" / "tiny.yaml")
    overrides = ["--set", "dev_eval.every=0", "--set", "iterations=1"]
    assert cli_main(["train", "--config", config, "--run-id", "r1", "--data-root", str(tmp_path), *overrides]) == 0
    run = DataRoot(tmp_path).run("r1")
    manifests = {p: p.stat().st_mtime_ns for p in run.run_dir.glob("**/_manifests/*.json")}
    corpus = next((tmp_path / "datasets").glob("*/corpus.parquet"))
    _halve(corpus)
    if forge:
        _forge_manifest(corpus.parent / "_manifests" / "prepare_dataset.json", corpus)
    caplog.clear()
    with caplog.at_level(logging.INFO):  # Prefect's console handler writes the same lines to the terminal
        assert cli_main(["resume", "--run-id", "r1", "--data-root", str(tmp_path)]) == 0
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    named = [line for line in said if "corpus.parquet" in line and "changed since" in line]
    assert len(named) == 1, said
    # rebuilt to the same bytes: no stage of the run saw another corpus, none was redone
    assert {p: p.stat().st_mtime_ns for p in manifests} == manifests
