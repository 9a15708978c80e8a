"""Your own dataset (`data.source: jsonl`, agent_core/data/prompt_files.py): prompts from JSON-lines
files, one per split, with their env, answers, metadata and documents; prepared into valid dataset
tables (an empty corpus included); every malformed line named by file, line and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import schemas
from agent_core.config import ConfigError, DataConfig
from agent_core.data.loaders import DatasetFormatError
from agent_core.data.prompt_files import load_prompt_files
from agent_core.envs.search import Bm25Index
from agent_core.io.tables import read_table
from agent_core.types import ChatMessage
from agent_core.validation import load_config
from tasks.prepare_data import prepare_dataset

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = REPO_ROOT / "examples" / "guess_number"


def _write(path: Path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_prompts_keep_their_messages_answers_env_metadata_and_documents(tmp_path):
    doc = {"title": "Ann", "text": "Ann was born in Rome."}
    train = _write(tmp_path / "train.jsonl",
                   {"id": "q1", "question": "Where was Ann born?", "answers": ["Rome", "Roma"], "documents": [doc],
                    "metadata": {"hops": 1}},
                   "",  # blank lines are skipped
                   {"id": "q2", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                    "answers": ["4"], "env": {"name": "tool_env", "kwargs": {"tools": ["calculator"]}},
                    "data_source": "arith", "documents": [doc]})
    dev = _write(tmp_path / "dev.jsonl", {"id": "d1", "question": "Who?", "answers": ["Ann"]})
    dataset = load_prompt_files({"train": train, "dev": dev}, top_k=2)
    by_id = {p.prompt_id: p for p in dataset.prompts}
    assert [p.prompt_id for p in dataset.prompts] == ["d1", "q1", "q2"]  # splits in name order, lines in file order
    q1, q2 = by_id["q1"], by_id["q2"]
    assert q1.messages == (ChatMessage("user", "Where was Ann born?"),) and q1.answers == ("Rome", "Roma")
    assert (q1.split, q1.data_source, q1.env_name, q1.env_kwargs, q1.metadata) == (
        "train", "jsonl", "search_qa", {"top_k": 2}, {"hops": 1})
    assert q2.messages[0] == ChatMessage("system", "Be brief.") and q2.data_source == "arith"
    assert (q2.env_name, q2.env_kwargs) == ("tool_env", {"tools": ["calculator"]})
    assert by_id["d1"].split == "dev"
    assert [(d.title, d.text) for d in dataset.documents] == [("Ann", "Ann was born in Rome.")]  # once
    assert Bm25Index(dataset.documents).search("Ann", 1)[0].title == "Ann"
    assert load_prompt_files({"train": train}, limit=1).prompts[0].prompt_id == "q1"


def test_the_dataset_id_changes_with_the_files_bytes_and_settings(tmp_path):
    path = tmp_path / "train.jsonl"
    _write(path, {"id": "a", "question": "q?", "answers": ["x"]})
    first = load_prompt_files({"train": str(path)}).dataset_id
    assert first == load_prompt_files({"train": str(path)}).dataset_id and first.startswith("jsonl-")
    assert load_prompt_files({"train": str(path)}, top_k=5).dataset_id != first
    _write(path, {"id": "a", "question": "q?", "answers": ["y"]})
    assert load_prompt_files({"train": str(path)}).dataset_id != first


BAD_LINES = {
    "not JSON": ("{oops", None, "not valid JSON"),
    "no answers": ({"id": "a", "question": "q?"}, "answers", "missing"),
    "empty answers": ({"id": "a", "question": "q?", "answers": []}, "answers", "non-empty list"),
    "blank answer": ({"id": "a", "question": "q?", "answers": [" "]}, "answers", "non-blank"),
    "question and messages": ({"id": "a", "question": "q?", "messages": [], "answers": ["x"]}, "question", "exactly one"),
    "neither": ({"id": "a", "answers": ["x"]}, "question", "exactly one"),
    "bad messages": ({"id": "a", "messages": [{"role": "user"}], "answers": ["x"]}, "messages", "role"),
    "bad env": ({"id": "a", "question": "q?", "answers": ["x"], "env": {"kwargs": {}}}, "env", "name"),
    "bad documents": ({"id": "a", "question": "q?", "answers": ["x"], "documents": ["text"]}, "documents", "title"),
    "no id": ({"question": "q?", "answers": ["x"]}, "id", "missing"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_bad_line_is_named_by_file_line_and_key(tmp_path, case):
    record, key, words = BAD_LINES[case]
    path = _write(tmp_path / "train.jsonl", {"id": "ok", "question": "q?", "answers": ["x"]}, record)
    with pytest.raises(DatasetFormatError) as caught:
        load_prompt_files({"train": path})
    message = str(caught.value)
    assert path in message and "line 2" in message and words in message
    assert key is None or f"key {key!r}" in message


def test_duplicate_ids_across_files_missing_files_and_unknown_splits_are_refused(tmp_path):
    line = {"id": "same", "question": "q?", "answers": ["x"]}
    train, dev = _write(tmp_path / "train.jsonl", line), _write(tmp_path / "dev.jsonl", line)
    with pytest.raises(DatasetFormatError, match="duplicate id 'same'"):
        load_prompt_files({"train": train, "dev": dev})
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_files({"train": str(tmp_path / "nope.jsonl")})
    with pytest.raises(ValueError, match="unknown split"):
        load_prompt_files({"validation": train})


def test_prepared_into_valid_dataset_tables_with_an_empty_corpus(tmp_path):
    """The env guide's dataset (examples/guess_number/): prompts that name a plugin's env, no documents."""
    from agent_core.plugins import load_plugins

    load_plugins(["examples.guess_number_env"])
    files = {"train": str(EXAMPLE / "train.jsonl"), "dev": str(EXAMPLE / "dev.jsonl")}
    uris = prepare_dataset.fn(str(tmp_path / "data"), DataConfig(source="jsonl", files=files))
    prompts = read_table("dataset_prompts", uris.prompts_uri).to_pylist()
    assert len(prompts) == 20 and {p["split"] for p in prompts} == {"train", "dev"}
    assert {json.loads(p["env"])["name"] for p in prompts} == {"guess_number"}
    assert read_table("corpus", uris.corpus_uri).num_rows == 0
    assert prepare_dataset.fn(str(tmp_path / "data"), DataConfig(source="jsonl", files=files)) == uris  # reused


def test_a_row_naming_an_unregistered_env_fails_before_the_dataset_is_written(tmp_path):
    path = _write(tmp_path / "train.jsonl", {"id": "a", "question": "q?", "answers": ["x"], "env": {"name": "nope"}})
    with pytest.raises(schemas.TableValidationError, match="nope"):
        prepare_dataset.fn(str(tmp_path / "data"), DataConfig(source="jsonl", files={"train": path}))
    assert not (tmp_path / "data").exists()


def test_the_config_takes_jsonl_with_files_only():
    config = load_config(None, ["data.source=jsonl", "data.files={train: t.jsonl}", "warm_start.enabled=false"])
    assert config.data.source == "jsonl" and config.data.files == {"train": "t.jsonl"}
    with pytest.raises(ConfigError, match="needs data.files"):
        load_config(None, ["data.source=jsonl", "warm_start.enabled=false"])
