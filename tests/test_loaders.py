"""Real QA dataset loaders on hand-written files in each dataset's native format
(tests/fixtures/qa/): prompts, answers, corpus and metadata checked by hand, paragraph dedup across
questions, dataset ids, the table schemas, and errors that name the file, record and key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agent_core.data.loaders import (
    QA_DATASETS, DatasetFormatError, load_2wikimultihopqa, load_hotpotqa, load_musique, load_qa_dataset,
)
from agent_core.data.rows import document_to_row, prompt_to_row
from agent_core.data.synthetic import SYSTEM_PROMPT, SyntheticQA, generate_synthetic_qa
from agent_core.io.tables import read_table, write_table
from agent_core.registry import UnknownNameError
from agent_core.types import ChatMessage

FIXTURES = Path(__file__).parent / "fixtures" / "qa"
HOTPOT = FIXTURES / "hotpot_dev_distractor_v1.json"
TWOWIKI = FIXTURES / "2wikimultihopqa_dev.json"
MUSIQUE = FIXTURES / "musique_full_v1.0_dev.jsonl"


def ids_by_title(dataset: SyntheticQA) -> dict[str, str]:
    ids = {d.title: d.doc_id for d in dataset.documents}
    assert len(ids) == len(dataset.documents), "titles are not unique here; look documents up by text"
    return ids


def test_hotpotqa_prompts_match_the_synthetic_format():
    dataset = load_hotpotqa(HOTPOT, top_k=5)
    synthetic = generate_synthetic_qa(seed=0, num_films=4, num_people=6, num_cities=2, num_countries=1).prompts[0]
    first = dataset.prompts[0]
    assert [p.prompt_id for p in dataset.prompts] == [
        "hotpotqa-5a7a06935542990198eaf050", "hotpotqa-5a879ab05542996e4f30887e", "hotpotqa-5a8c7595554299585d9e36b6"]
    assert first.messages == (
        ChatMessage("system", SYSTEM_PROMPT),
        ChatMessage("user", "Question: Which magazine was started first, Arthur's Magazine or First for Women?"),
    )
    assert first.messages[0] == synthetic.messages[0]
    assert (first.env_name, synthetic.env_name) == ("search_qa", "search_qa")
    assert first.env_kwargs == {"top_k": 5}
    assert [p.answers for p in dataset.prompts] == [("Arthur's Magazine",), ("Delhi",), ("Chief of Protocol",)]
    assert {(p.split, p.data_source) for p in dataset.prompts} == {("dev", "hotpotqa")}
    assert load_hotpotqa(HOTPOT, split_name="train").prompts[0].split == "train"


def test_hotpotqa_corpus_is_the_deduplicated_union_of_the_contexts():
    dataset = load_hotpotqa(HOTPOT)
    # 9 context paragraphs, "Radio City" and "First for Women" each appear twice.
    assert [d.title for d in dataset.documents] == [
        "Radio City (Indian radio station)", "Arthur's Magazine", "First for Women", "Oberoi family",
        "The Oberoi Group", "Kiss and Tell (1945 film)", "Shirley Temple"]
    arthur = dataset.documents[1]
    assert arthur.text == (
        "Arthur's Magazine (1844\u20131846) was an American literary periodical published in Philadelphia in the "
        "19th century. Edited by T.S. Arthur, it featured work by Edgar A. Poe and others.")
    assert len({d.doc_id for d in dataset.documents}) == 7
    # Ids depend on the paragraph only: stable across loads and settings.
    assert ids_by_title(dataset) == ids_by_title(load_hotpotqa(HOTPOT, setting="fullwiki", limit=3))


def test_hotpotqa_metadata():
    dataset = load_hotpotqa(HOTPOT)
    ids = ids_by_title(dataset)
    assert dataset.prompts[2].metadata == {
        "source_id": "5a8c7595554299585d9e36b6",
        "type": "bridge",
        "level": "easy",
        "hops": 2,
        "supporting_titles": ["Kiss and Tell (1945 film)", "Shirley Temple"],
        "supporting_facts": [["Kiss and Tell (1945 film)", 0], ["Shirley Temple", 0], ["Shirley Temple", 1]],
        "supporting_doc_ids": [ids["Kiss and Tell (1945 film)"], ids["Shirley Temple"]],
        "candidate_doc_ids": [ids["Kiss and Tell (1945 film)"], ids["Shirley Temple"], ids["First for Women"]],
    }
    assert dataset.prompts[0].metadata["type"] == "comparison"
    fullwiki = load_hotpotqa(HOTPOT, setting="fullwiki")
    assert all("candidate_doc_ids" not in p.metadata for p in fullwiki.prompts)
    assert fullwiki.documents == dataset.documents  # retrieval runs over the union in both settings


def test_2wikimultihopqa_keeps_evidences_and_types():
    dataset = load_2wikimultihopqa(TWOWIKI)
    ids = ids_by_title(dataset)
    assert len(dataset.documents) == 9  # 10 paragraphs, "Xawery Żuławski" twice
    assert ids_by_title(dataset)["Xawery \u017bu\u0142awski"] == dataset.documents[1].doc_id
    assert dataset.documents[1].text == (
        "Xawery \u017bu\u0142awski (born 22 December 1971 in Warsaw) is a Polish film director. "
        "He is the son of actress Ma\u0142gorzata Braunek and director Andrzej \u017bu\u0142awski.")
    assert [p.metadata["type"] for p in dataset.prompts] == ["compositional", "comparison", "bridge_comparison"]
    assert [p.metadata["hops"] for p in dataset.prompts] == [2, 2, 4]
    assert [p.prompt_id for p in dataset.prompts][0] == "2wikimultihopqa-8813f87c0bdd11eba7f7acde48001122"
    assert dataset.prompts[1].answers == ("The Mask Of Fu Manchu",)
    first = dataset.prompts[0].metadata
    assert "level" not in first
    assert first["evidences"] == [["Polish-Russian War", "director", "Xawery \u017bu\u0142awski"],
                                  ["Xawery \u017bu\u0142awski", "mother", "Ma\u0142gorzata Braunek"]]
    assert first["supporting_doc_ids"] == [ids["Polish-Russian War (film)"], ids["Xawery \u017bu\u0142awski"]]
    assert first["candidate_doc_ids"] == [d.doc_id for d in dataset.documents[:3]]
    assert {p.data_source for p in dataset.prompts} == {"2wikimultihopqa"}


def test_musique_answers_aliases_and_unanswerable_skipped():
    dataset = load_musique(MUSIQUE, split_name="test")
    assert [p.prompt_id for p in dataset.prompts] == [
        "musique-2hop__460946_294723", "musique-3hop1__9285_5188_23307", "musique-2hop__13548_13529"]
    assert [p.answers for p in dataset.prompts] == [
        ("Miquette Giraudy", "Miquette Giraudy-Hillage", "Giraudy"), ("London",),
        ("Richard Branson", "Sir Richard Branson")]
    assert {(p.split, p.data_source, p.env_name) for p in dataset.prompts} == {("test", "musique", "search_qa")}
    assert dataset.prompts[2].messages[1] == ChatMessage("user", "Question: Who founded the label that released Green?")


def test_musique_corpus_and_metadata():
    dataset = load_musique(MUSIQUE)
    by_text = {d.text.split()[0] + "|" + d.title: d.doc_id for d in dataset.documents}
    # 10 paragraphs of answerable questions; "Green" twice more, "Steve Hillage ..." once more. The two
    # different "Steve Hillage" paragraphs stay two documents.
    assert [d.title for d in dataset.documents] == [
        "Grant's First Stand", "Miquette Giraudy", "Green (Steve Hillage album)", "Steve Hillage", "Steve Hillage",
        "England", "Virgin Records"]
    green, hillage = by_text["Green|Green (Steve Hillage album)"], by_text["Steve|Steve Hillage"]
    london_hillage = by_text["In|Steve Hillage"]
    first, second = dataset.prompts[0].metadata, dataset.prompts[1].metadata
    assert first["supporting_doc_ids"] == [green, by_text["Miquette|Miquette Giraudy"]]  # hop order, not list order
    assert first["candidate_doc_ids"] == [d.doc_id for d in dataset.documents[:4]]
    assert (first["type"], first["hops"], first["answerable"], first["source_id"]) == ("2hop", 2, True, "2hop__460946_294723")
    assert first["question_decomposition"][0] == {
        "id": 460946, "question": "Green >> performer", "answer": "Steve Hillage", "paragraph_support_idx": 2}
    assert second["candidate_doc_ids"] == [london_hillage, green, hillage, by_text["England|England"]]
    assert (second["type"], second["hops"]) == ("3hop1", 3)


def test_musique_unanswerable_included_on_request_and_limit():
    dataset = load_musique(MUSIQUE, include_unanswerable=True)
    assert [p.prompt_id for p in dataset.prompts][:2] == [
        "musique-2hop__460946_294723", "musique-2hop__460946_294723-unanswerable"]
    twin = dataset.prompts[1]
    assert twin.metadata["answerable"] is False and twin.answers[0] == "Miquette Giraudy"
    assert twin.metadata["supporting_doc_ids"] == [dataset.documents[2].doc_id]
    assert dataset.dataset_id != load_musique(MUSIQUE).dataset_id
    limited = load_musique(MUSIQUE, limit=2)
    assert [p.prompt_id for p in limited.prompts] == ["musique-2hop__460946_294723", "musique-3hop1__9285_5188_23307"]
    assert len(load_hotpotqa(HOTPOT, limit=1).documents) == 3


def test_dataset_id_is_deterministic_and_tracks_file_and_settings(tmp_path):
    first = load_hotpotqa(HOTPOT)
    assert first.dataset_id == load_hotpotqa(HOTPOT).dataset_id
    assert first.dataset_id.startswith("hotpotqa-dev-distractor-")
    copy = tmp_path / "copy.json"
    shutil.copy(HOTPOT, copy)
    assert load_hotpotqa(copy).dataset_id == first.dataset_id  # the bytes count, not the path
    copy.write_text(HOTPOT.read_text().replace("Delhi", "New Delhi"))
    others = [load_hotpotqa(copy), load_hotpotqa(HOTPOT, top_k=4), load_hotpotqa(HOTPOT, setting="fullwiki"),
              load_hotpotqa(HOTPOT, split_name="test"), load_hotpotqa(HOTPOT, limit=2)]
    assert len({first.dataset_id, *(o.dataset_id for o in others)}) == 6
    assert load_musique(MUSIQUE).dataset_id == load_musique(MUSIQUE).dataset_id


def test_load_qa_dataset_dispatches_by_name():
    assert QA_DATASETS.names() == ["2wikimultihopqa", "hotpotqa", "musique"]
    assert load_qa_dataset("hotpotqa", HOTPOT, top_k=2) == load_hotpotqa(HOTPOT, top_k=2)
    assert load_qa_dataset("musique", MUSIQUE).prompts == load_musique(MUSIQUE).prompts
    with pytest.raises(UnknownNameError, match="2wikimultihopqa, hotpotqa, musique"):
        load_qa_dataset("hotpot", HOTPOT)
    with pytest.raises(TypeError, match="'setting'.*valid arguments: split_name, top_k, limit, include_unanswerable"):
        load_qa_dataset("musique", MUSIQUE, setting="distractor")


@pytest.mark.parametrize("kwargs, message", [
    ({"split_name": "validation"}, "split_name must be one of train, dev, test"),
    ({"setting": "open"}, "setting must be one of distractor, fullwiki"),
    ({"top_k": 0}, "top_k must be an integer >= 1"),
    ({"limit": -1}, "limit must be None"),
])
def test_bad_settings_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_hotpotqa(HOTPOT, **kwargs)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_hotpotqa(missing)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_musique(missing)


def hotpot_records() -> list[dict]:
    return json.loads(HOTPOT.read_text())


def without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}


JSON_CASES = {
    "not json": ("[{", r"file: not valid JSON"),
    "top level object": ('{"data": []}', r"file: expected a JSON list of records, got dict"),
    "record not an object": ("[[1, 2]]", r"record 0, key '\(record\)': expected an object, got list"),
    "missing answer": (lambda r: [r[0], without(r[1], "answer")], r"record 1, key 'answer': missing"),
    "answer a number": (lambda r: [r[0], r[1], {**r[2], "answer": 3}], r"record 2, key 'answer': expected a string, got int"),
    "context not pairs": (lambda r: [{**r[0], "context": [["Title only"]]}], r"record 0, key 'context\[0\]': expected a \[title"),
    "sentence not a string": (lambda r: [{**r[0], "context": [["T", ["ok", 5]]]}], r"record 0, key 'context\[0\]\[1\]'"),
    "sentence index a bool": (lambda r: [{**r[0], "supporting_facts": [["T", True]]}],
                              r"record 0, key 'supporting_facts\[0\]\[1\]': expected an integer, got bool"),
    "duplicate id": (lambda r: [r[0], r[0]], r"record 1, key '_id': duplicate id '5a7a06935542990198eaf050'"),
}


@pytest.mark.parametrize("case", JSON_CASES)
def test_malformed_json_files_name_file_record_and_key(tmp_path, case):
    content, message = JSON_CASES[case]
    bad = tmp_path / "bad_hotpot.json"
    bad.write_text(content if isinstance(content, str) else json.dumps(content(hotpot_records())))
    with pytest.raises(DatasetFormatError, match=rf"bad_hotpot\.json: {message}") as caught:
        load_hotpotqa(bad)
    assert caught.value.path == str(bad)


def test_2wiki_needs_evidences(tmp_path):
    bad = tmp_path / "dev.json"
    records = json.loads(TWOWIKI.read_text())
    bad.write_text(json.dumps([records[0], {**records[1], "evidences": [["a", "b"]]}]))
    with pytest.raises(DatasetFormatError, match=r"dev\.json: record 1, key 'evidences\[0\]': expected a \[subject"):
        load_2wikimultihopqa(bad)
    bad.write_text(json.dumps([without(records[0], "evidences")]))
    with pytest.raises(DatasetFormatError, match=r"record 0, key 'evidences': missing"):
        load_2wikimultihopqa(bad)


def musique_lines() -> list[str]:
    return MUSIQUE.read_text().splitlines()


JSONL_CASES = {
    "not json": (lambda lines: [lines[0], "{oops"], r"line 2: not valid JSON"),
    "not an object": (lambda lines: [lines[0], "", "[1]"], r"line 3, key '\(record\)': expected an object, got list"),
    "missing question": (lambda lines: [lines[0], json.dumps(without(json.loads(lines[3]), "question"))],
                         r"line 2, key 'question': missing"),
    "aliases not strings": (lambda lines: [json.dumps({**json.loads(lines[0]), "answer_aliases": [1]})],
                            r"line 1, key 'answer_aliases': expected a string, got int"),
    "paragraph without text": (
        lambda lines: [json.dumps({**json.loads(lines[0]), "paragraphs": [{"idx": 0, "title": "T"}]})],
        r"line 1, paragraphs\[0\], key 'paragraph_text': missing"),
    "answerable not a bool": (lambda lines: [json.dumps({**json.loads(lines[0]), "answerable": "yes"})],
                              r"line 1, key 'answerable': expected a boolean, got str"),
}


@pytest.mark.parametrize("case", JSONL_CASES)
def test_malformed_jsonl_files_name_file_line_and_key(tmp_path, case):
    build, message = JSONL_CASES[case]
    bad = tmp_path / "bad_musique.jsonl"
    bad.write_text("\n".join(build(musique_lines())) + "\n")
    with pytest.raises(DatasetFormatError, match=rf"bad_musique\.jsonl: {message}"):
        load_musique(bad)


@pytest.mark.parametrize("loader, path", [(load_hotpotqa, HOTPOT), (load_2wikimultihopqa, TWOWIKI),
                                          (load_musique, MUSIQUE)])
def test_loaded_datasets_pass_the_table_schemas(tmp_path, loader, path):
    dataset = loader(path)
    prompts_uri = write_table("dataset_prompts", [prompt_to_row(p) for p in dataset.prompts], tmp_path / "prompts.parquet")
    corpus_uri = write_table("corpus", [document_to_row(d) for d in dataset.documents], tmp_path / "corpus.parquet")
    assert read_table("dataset_prompts", prompts_uri).num_rows == len(dataset.prompts)
    assert read_table("corpus", corpus_uri).num_rows == len(dataset.documents)


# ---- a real dataset through the pipeline's config and prepare_dataset stage ----------------------

def test_split_files_become_one_dataset_with_each_files_split(tmp_path):
    from agent_core.data.loaders import load_qa_splits

    dev = FIXTURES / "hotpot_dev_distractor_v1.json"
    train = tmp_path / "hotpot_train_v1.1.json"
    records = json.loads(dev.read_text())
    for record in records:
        record["_id"] = "train-" + record["_id"]
    train.write_text(json.dumps(records))
    both = load_qa_splits("hotpotqa", {"train": train, "dev": dev})
    assert sorted({p.split for p in both.prompts}) == ["dev", "train"]
    assert len(both.prompts) == 2 * len(records)
    # the two files share every paragraph: the corpus holds each once
    assert len(both.documents) == len(load_qa_dataset("hotpotqa", dev).documents)
    assert both.dataset_id != load_qa_splits("hotpotqa", {"dev": dev}).dataset_id
    with pytest.raises(ValueError, match="same question id"):
        load_qa_splits("hotpotqa", {"train": dev, "dev": dev})


def test_config_with_a_real_source_prepares_its_tables(tmp_path):
    from agent_core.config import DataConfig
    from agent_core.validation import load_config
    from tasks.prepare_data import prepare_dataset

    data = DataConfig(source="musique", files={"dev": str(FIXTURES / "musique_full_v1.0_dev.jsonl")})
    uris = prepare_dataset.fn(str(tmp_path), data)
    prompts = read_table("dataset_prompts", uris.prompts_uri).to_pylist()
    assert prompts and all(p["split"] == "dev" and p["data_source"] == "musique" for p in prompts)
    assert read_table("corpus", uris.corpus_uri).num_rows > 0
    with pytest.raises(ValueError, match="needs data.files"):
        load_config(None, ["data.source=hotpotqa"])
