"""Bad input fails early and names the culprit (issue 7, "Bad input").

Each case feeds one kind of bad input to the stage that reads it and checks two things: the error
names the file (or table), the column or key, and the row or record; and the stage wrote nothing:
the data root holds exactly the files it held before the call, byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import schemas
from agent_core.config import DataConfig, RewardConfig, RolloutConfig
from agent_core.data.loaders import DatasetFormatError
from agent_core.io.checkpoints import CheckpointError
from agent_core.io.layout import DataRoot
from agent_core.io.tables import TableReadError, write_table
from flows.cli import main as cli_main
from tasks._common import split_prompts
from tasks.label_rewards import label_rewards
from tasks.prepare_data import prepare_dataset
from tasks.rollout import rollout
from test_schemas import steps_rows

FIXTURES = Path(__file__).parent / "fixtures" / "qa"
HOTPOT = FIXTURES / "hotpot_dev_distractor_v1.json"
TWOWIKI = FIXTURES / "2wikimultihopqa_dev.json"
MUSIQUE = FIXTURES / "musique_full_v1.0_dev.jsonl"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones too: a leftover temporary is a write) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


def assert_names(message: str, *culprits: str) -> None:
    missing = [c for c in culprits if c not in message]
    assert not missing, f"message does not name {missing}: {message}"


# ---- 1. native dataset files: a record with a missing or mistyped field --------------------------


def _hotpot(change):
    records = json.loads(HOTPOT.read_text())
    change(records)
    return json.dumps(records)


def _twowiki(change):
    records = json.loads(TWOWIKI.read_text())
    change(records)
    return json.dumps(records)


def _musique(line_number, change):
    lines = MUSIQUE.read_text().splitlines()
    record = json.loads(lines[line_number - 1])
    change(record)
    lines[line_number - 1] = json.dumps(record)
    return "\n".join(lines) + "\n"


def _drop(key):
    return lambda record: record.pop(key)


def _set(key, value):
    return lambda record: record.__setitem__(key, value)


# (source, file name, content, record label, key, problem)
NATIVE_CASES = {
    "hotpot missing answer": ("hotpotqa", "hotpot_dev.json", lambda: _hotpot(lambda r: _drop("answer")(r[1])),
                              "record 1", "'answer'", "missing"),
    "hotpot answer a list": ("hotpotqa", "hotpot_dev.json", lambda: _hotpot(lambda r: _set("answer", ["a", "b"])(r[2])),
                             "record 2", "'answer'", "expected a string, got list"),
    "hotpot answer a number": ("hotpotqa", "hotpot_dev.json", lambda: _hotpot(lambda r: _set("answer", 1844)(r[0])),
                               "record 0", "'answer'", "expected a string, got int"),
    "hotpot empty question": ("hotpotqa", "hotpot_dev.json", lambda: _hotpot(lambda r: _set("question", "  ")(r[1])),
                              "record 1", "'question'", "empty"),
    "hotpot supporting_facts malformed": (
        "hotpotqa", "hotpot_dev.json", lambda: _hotpot(lambda r: _set("supporting_facts", [["Arthur's Magazine"]])(r[0])),
        "record 0", "'supporting_facts[0]'", "expected a [title, sentence index] pair"),
    "2wiki evidences malformed": ("2wikimultihopqa", "dev.json", lambda: _twowiki(lambda r: _set("evidences", [["a", "b"]])(r[1])),
                                  "record 1", "'evidences[0]'", "triple"),
    "2wiki missing _id": ("2wikimultihopqa", "dev.json", lambda: _twowiki(lambda r: _drop("_id")(r[2])),
                          "record 2", "'_id'", "missing"),
    "musique missing question": ("musique", "musique_dev.jsonl", lambda: _musique(4, _drop("question")),
                                 "line 4", "'question'", "missing"),
    "musique empty answer": ("musique", "musique_dev.jsonl", lambda: _musique(5, _set("answer", "")),
                             "line 5", "'answer'", "empty"),
    "musique paragraph idx a string": (
        "musique", "musique_dev.jsonl",
        lambda: _musique(1, lambda r: r["paragraphs"][0].__setitem__("idx", "0")),
        "line 1, paragraphs[0]", "'idx'", "expected an integer, got str"),
}


@pytest.mark.parametrize("case", NATIVE_CASES)
def test_bad_native_record_names_file_record_and_field_before_the_dataset_is_written(tmp_path, case):
    source, name, content, record, key, problem = NATIVE_CASES[case]
    native = tmp_path / "native" / name
    native.parent.mkdir()
    native.write_text(content())
    data_root = tmp_path / "data"
    with pytest.raises(DatasetFormatError) as caught:
        prepare_dataset.fn(str(data_root), DataConfig(source=source, files={"dev": str(native)}))
    assert_names(str(caught.value), str(native), record, key, problem)
    assert not data_root.exists()


# ---- 2. prompt table rows: unknown env / tool / kwarg, malformed JSON ----------------------------


def prompt_row(index: int, env: str | None = None, messages: str | None = None, ground_truth: str | None = None) -> dict:
    chat = [{"role": "system", "content": "Answer with <answer>...</answer>."}, {"role": "user", "content": f"Q{index}?"}]
    return {
        "prompt_id": f"q{index}", "data_source": "synthetic", "split": "train",
        "messages": messages or json.dumps(chat),
        "ground_truth": ground_truth or json.dumps({"answers": ["Paris"]}),
        "env": env or json.dumps({"name": "search_qa", "kwargs": {"top_k": 3}}),
        "metadata": "{}",
    }


def _env(name, **kwargs):
    return json.dumps({"name": name, "kwargs": kwargs})


# (column changed, its bad value, words the message must hold besides table, file, column and row)
ROW_CASES = {
    "unknown env": ("env", _env("serch_qa", top_k=3), ["unknown env 'serch_qa'", "search_qa, tool_env"]),
    "unknown env kwarg": ("env", _env("search_qa", topk=3), ["'topk'", "valid arguments: top_k"]),
    "unknown tool": ("env", _env("tool_env", tools=["calculator", "serch"]), ["tools[1]", "unknown tool 'serch'", "calculator"]),
    "unknown tool kwarg": ("env", _env("tool_env", tools=[{"name": "search", "kwargs": {"k": 2}}]), ["tools[0]", "'k'", "top_k"]),
    "unknown tool format": ("env", _env("tool_env", tool_format="hermez"), ["tool_format", "'hermez'", "hermes, tag"]),
    "env without a name": ("env", json.dumps({"kwargs": {}}), ['{"name": string, "kwargs": object}']),
    "messages not JSON": ("messages", '[{"role": "user", "content": "Q?"', ["role", "content"]),
    "messages without content": ("messages", json.dumps([{"role": "user"}]), ["role", "content"]),
    "answers a number": ("ground_truth", json.dumps({"answers": 3}), ["answers"]),
    "answers empty": ("ground_truth", json.dumps({"answers": []}), ["answers"]),
}


def _with_bad_row(case: str) -> list[dict]:
    column, value, _ = ROW_CASES[case]
    rows = [prompt_row(i) for i in range(3)]
    rows[1] = prompt_row(1, **{column: value})
    return rows


def write_unchecked(table_name: str, rows: list[dict], path: Path) -> Path:
    """A table written by other code (or edited by hand): the schema is not applied on the way in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(schemas.table_from_rows(table_name, rows), path)
    return path


def fake_checkpoint(directory: Path, skip: str | None = None) -> Path:
    """The files a saved checkpoint has (contents do not matter to the check), less `skip`."""
    directory.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name != skip:
            (directory / name).write_text("{}")
    return directory


@pytest.fixture
def run_inputs(tmp_path):
    """A run with iteration 0's inputs in place: the corpus and a complete-looking checkpoint."""
    root = DataRoot(tmp_path / "data")
    run = root.run("r1")
    corpus = write_table("corpus", [{"doc_id": "d0", "title": "Paris", "text": "Paris is in France."}],
                         root.path / "datasets" / "ds" / "corpus.parquet")
    return run, corpus, fake_checkpoint(run.run_dir / "initial_policy")


def call_rollout(run, corpus: str, policy_dir: Path, cfg: RolloutConfig | None = None):
    return rollout.fn(run=run, iteration=0, prompts_uri=run.table_uri(0, "prompts"), corpus_uri=corpus,
                      policy_dir=str(policy_dir), cfg=cfg or RolloutConfig(), seed=0)


@pytest.mark.parametrize("case", ROW_CASES)
def test_bad_prompts_row_names_table_file_column_and_row_before_rollout_writes(run_inputs, case):
    run, corpus, policy = run_inputs
    prompts = Path(run.table_uri(0, "prompts"))
    write_unchecked("prompts", [{"run_id": "r1", "iteration": 0, **row} for row in _with_bad_row(case)], prompts)
    before = snapshot(run.data_root)
    with pytest.raises(schemas.TableValidationError) as caught:
        call_rollout(run, corpus, policy)
    column, _, words = ROW_CASES[case]
    assert_names(str(caught.value), f"prompts ({prompts})", f"column '{column}'", "r1/0/q1", *words)
    assert caught.value.column == column and caught.value.row_ids == ["r1/0/q1"]
    assert snapshot(run.data_root) == before


def test_config_env_kwargs_that_do_not_fit_the_prompts_env_name_the_rows(run_inputs):
    """rollout.env_kwargs refine each prompt's own env: valid tools, but search_qa takes none."""
    run, corpus, policy = run_inputs
    write_unchecked("prompts", [{"run_id": "r1", "iteration": 0, **prompt_row(i)} for i in range(2)],
                    Path(run.table_uri(0, "prompts")))
    before = snapshot(run.data_root)
    with pytest.raises(schemas.TableValidationError) as caught:
        call_rollout(run, corpus, policy, RolloutConfig(env_kwargs={"tools": ["calculator"]}))
    assert_names(str(caught.value), "column 'env'", "r1/0/q0, r1/0/q1", "search_qa", "'tools'")
    assert snapshot(run.data_root) == before


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The MuSiQue fixture prepared as a dataset, and a pristine copy of its prompts table."""
    data_root = tmp_path_factory.mktemp("data")
    data = DataConfig(source="musique", files={"dev": str(MUSIQUE)})
    uris = prepare_dataset.fn(str(data_root), data)
    return data_root, data, uris, Path(uris.prompts_uri).read_bytes()


@pytest.mark.parametrize("case", ["unknown env", "unknown tool", "messages not JSON", "answers empty"])
def test_bad_dataset_row_fails_when_the_dataset_is_reused_or_read(prepared, case):
    data_root, data, uris, pristine = prepared
    path = Path(uris.prompts_uri)
    rows = pq.read_table(path).to_pylist()
    column, value, words = ROW_CASES[case]
    rows[2][column] = value
    try:
        write_unchecked("dataset_prompts", rows, path)
        before = snapshot(data_root)
        prompt_id = rows[2]["prompt_id"]
        for read in (lambda: prepare_dataset.fn(str(data_root), data), lambda: split_prompts(uris, "dev")):
            with pytest.raises(schemas.TableValidationError) as caught:
                read()
            assert_names(str(caught.value), f"dataset_prompts ({path})", f"column '{column}'", prompt_id, *words)
        assert snapshot(data_root) == before
    finally:
        path.write_bytes(pristine)


def test_bad_prompt_from_a_loader_writes_neither_dataset_table(tmp_path, monkeypatch):
    """Both tables are checked before either is written: no corpus without its prompts."""
    import dataclasses

    import tasks.prepare_data as prepare_data_module
    from agent_core.data.synthetic import SyntheticQA

    real = prepare_data_module.load_dataset

    def with_a_bad_env(data):
        dataset = real(data)
        bad = dataclasses.replace(dataset.prompts[0], env_name="tool_env", env_kwargs={"tools": ["serch"]})
        return SyntheticQA((bad, *dataset.prompts[1:]), dataset.documents, dataset.dataset_id)

    monkeypatch.setattr(prepare_data_module, "load_dataset", with_a_bad_env)
    data_root = tmp_path / "data"
    with pytest.raises(schemas.TableValidationError) as caught:
        prepare_dataset.fn(str(data_root), DataConfig(source="musique", files={"dev": str(MUSIQUE)}))
    assert_names(str(caught.value), "dataset_prompts", "column 'env'", "musique-2hop__460946_294723", "'serch'")
    assert not data_root.exists()


# ---- 3. config typos: unknown key or section, bad enum, unknown env / tool / env kwarg ------------

CONFIG_CASES = {
    "unknown key": (["rollout.grup_size=2"], ["rollout.grup_size", "group_size", "max_steps"]),
    "unknown section": (["rolout.group_size=2"], ["rolout", "valid keys here", "rollout"]),
    "bad enum": (["rollout.context_mode=apend"], ["rollout.context_mode", "'append' or 'last_k'"]),
    "unknown registered name": (["algorithm.estimator=grpoo"], ["algorithm.estimator", "grpoo", "grpo"]),
    "unknown env": (["rollout.env=serch_qa"], ["rollout.env", "serch_qa", "search_qa, tool_env"]),
    "unknown env kwarg": (["rollout.env=search_qa", "rollout.env_kwargs={topk: 3}"],
                          ["rollout.env_kwargs", "'topk'", "top_k"]),
    "unknown tool": (["rollout.env=tool_env", "rollout.env_kwargs={tools: [calculator, serch]}"],
                     ["rollout.env_kwargs", "tools[1]", "'serch'", "calculator, python, search"]),
    "unknown tool, prompts' env": (["rollout.env_kwargs={tools: [serch]}"],
                                   ["rollout.env_kwargs", "tools[0]", "'serch'", "calculator, python, search"]),
    "unknown tool format": (["rollout.env_kwargs={tool_format: hermez}"], ["hermez", "hermes, tag"]),
    # values the env would refuse when first built (a rollout, or the dev eval minutes in)
    "negative penalty, prompts' env": (["rollout.env_kwargs={invalid_action_penalty: -1.0}"],
                                       ["rollout.env_kwargs", "invalid_action_penalty must be >= 0", "-1.0"]),
    "zero timeout": (["rollout.env=search_qa", "rollout.env_kwargs={tool_timeout_s: 0}"],
                     ["rollout.env_kwargs", "env 'search_qa'", "tool_timeout_s", "must be positive"]),
    "budget not a number": (["rollout.env=tool_env", "rollout.env_kwargs={max_tool_calls_per_episode: many}"],
                            ["rollout.env_kwargs", "env 'tool_env'", "must be numbers", "many"]),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_typo_names_the_key_and_valid_choices_before_anything_is_written(tmp_path, capsys, case):
    overrides, words = CONFIG_CASES[case]
    data_root = tmp_path / "data"
    arguments = ["train", "--data-root", str(data_root)]
    for override in overrides:
        arguments += ["--set", override]
    assert cli_main(arguments) == 2
    assert_names(capsys.readouterr().err, *words)
    assert not data_root.exists()


# ---- 4. a corrupted or truncated Parquet table read by a stage -----------------------------------


def corrupt(path: Path, how: str) -> None:
    """truncated: cut in half (no footer); random bytes: all of it; scrambled: the middle third, so
    the footer still parses and the damage shows only when the pages are decoded."""
    data = path.read_bytes()
    third = len(data) // 3
    noise = random.Random(0).randbytes(len(data))
    damaged = {"truncated": data[: len(data) // 2], "random bytes": noise,
               "scrambled": data[:third] + noise[third: 2 * third] + data[2 * third:]}
    path.write_bytes(damaged[how])


CORRUPTIONS = ["truncated", "random bytes", "scrambled"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_unreadable_steps_table_names_table_and_file_and_no_rewards_are_written(tmp_path, how):
    run = DataRoot(tmp_path / "data").run("r1")
    prompts = write_table("prompts", [{"run_id": "r1", "iteration": 0, **prompt_row(0)}], run.table_uri(0, "prompts"))
    steps = Path(write_table("steps", steps_rows(), run.table_uri(0, "steps")))
    corrupt(steps, how)
    before = snapshot(run.data_root)
    with pytest.raises(TableReadError) as caught:
        label_rewards.fn(run=run, iteration=0, steps_uri=str(steps), prompts_uri=prompts, cfg=RewardConfig())
    assert_names(str(caught.value), "steps table", str(steps))
    assert not Path(run.table_uri(0, "rewards")).exists()
    assert snapshot(run.data_root) == before


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_unreadable_prompts_table_names_table_and_file_and_no_steps_are_written(run_inputs, how):
    run, corpus, policy = run_inputs
    prompts = Path(write_table("prompts", [{"run_id": "r1", "iteration": 0, **prompt_row(i)} for i in range(3)],
                               run.table_uri(0, "prompts")))
    corrupt(prompts, how)
    before = snapshot(run.data_root)
    with pytest.raises(TableReadError) as caught:
        call_rollout(run, corpus, policy)
    assert_names(str(caught.value), "prompts table", str(prompts))
    assert snapshot(run.data_root) == before


# ---- 5. a checkpoint directory without weights (or config, or tokenizer) -------------------------

CHECKPOINT_CASES = {
    "no weights": ("model.safetensors", "weights (one of *.safetensors"),
    "no config": ("config.json", "config.json"),
    "no tokenizer": ("tokenizer.json", "tokenizer (one of tokenizer.json"),
}


@pytest.mark.parametrize("case", [*CHECKPOINT_CASES, "no directory"])
def test_incomplete_checkpoint_names_directory_and_missing_part_before_rollout_starts(run_inputs, case):
    run, corpus, _ = run_inputs
    write_table("prompts", [{"run_id": "r1", "iteration": 0, **prompt_row(i)} for i in range(2)], run.table_uri(0, "prompts"))
    policy = run.data_root / "policies" / "broken"
    if case == "no directory":
        missing = "does not exist"
    else:
        skip, missing = CHECKPOINT_CASES[case]
        fake_checkpoint(policy, skip=skip)
    before = snapshot(run.data_root)
    with pytest.raises(CheckpointError) as caught:
        call_rollout(run, corpus, policy)
    assert_names(str(caught.value), str(policy), missing)
    assert not Path(run.table_uri(0, "steps")).exists()
    assert snapshot(run.data_root) == before
