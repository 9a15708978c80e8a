"""Loaders for the real multi-hop QA datasets (HotpotQA, 2WikiMultihopQA, MuSiQue) from their native
files, into the same container as the synthetic generator (`SyntheticQA`), so prepare_data, the
`search_qa` env and the tool-call formats work on them unchanged.

The corpus is the union of every question's context paragraphs (one Document per distinct title + text);
retrieval runs over all of it, in every setting. Malformed files raise DatasetFormatError (file, record, key).
Design notes: docs/architecture.md §11 (agent_core/data/loaders.py).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from agent_core.data.synthetic import SYSTEM_PROMPT, SyntheticQA
from agent_core.registry import Registry
from agent_core.types import ChatMessage, Document, Prompt

# Bump when the produced prompts or documents change, so a new loader never reuses an old dataset folder.
LOADER_VERSION = 1
SPLITS = ("train", "dev", "test")
SETTINGS = ("distractor", "fullwiki")

QA_DATASETS: Registry[Callable[..., SyntheticQA]] = Registry("QA dataset")


class DatasetFormatError(ValueError):
    """A dataset file that is not in its native format; names the file, the record and the key."""

    def __init__(self, path: Path, where: str, key: str | None, problem: str):
        self.path, self.where, self.key = str(path), where, key
        at = f"{where}, key {key!r}" if key else where
        super().__init__(f"{path}: {at}: {problem}")


@dataclass(frozen=True)
class _Where:
    """A record's position in its file, for error messages."""

    path: Path
    label: str  # "record 3" or "line 4"

    def error(self, key: str | None, problem: str) -> DatasetFormatError:
        return DatasetFormatError(self.path, self.label, key, problem)


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "a list", dict: "an object"}


def _typed(value: Any, kind: type, where: _Where, key: str) -> Any:
    # bool is an int in Python, but `true` is not a valid sentence index.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise where.error(key, f"expected {_TYPE_NAMES[kind]}, got {type(value).__name__}")
    return value


def _field(record: dict, key: str, kind: type, where: _Where, default: Any = ...) -> Any:
    if key not in record:
        if default is ...:
            raise where.error(key, "missing")
        return default
    return _typed(record[key], kind, where, key)


def _text(record: dict, key: str, where: _Where) -> str:
    """A required string that is not blank: an empty question or gold answer makes a prompt that
    cannot be asked or rewarded, and would otherwise surface as a silent zero reward."""
    value = _field(record, key, str, where)
    if not value.strip():
        raise where.error(key, "empty")
    return value


def _read_bytes(path: str | Path) -> tuple[Path, bytes]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset file at {path}")
    return path, path.read_bytes()


def _json_records(path: Path, data: bytes, limit: int | None) -> list[tuple[_Where, dict]]:
    """The records of a file holding one JSON list of objects (HotpotQA, 2Wiki)."""
    try:
        records = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DatasetFormatError(path, "file", None, f"not valid JSON ({error})") from None
    if not isinstance(records, list):
        raise DatasetFormatError(path, "file", None, f"expected a JSON list of records, got {type(records).__name__}")
    if limit is not None:
        records = records[:limit]
    located = [(_Where(path, f"record {index}"), record) for index, record in enumerate(records)]
    for where, record in located:
        _typed(record, dict, where, "(record)")
    return located


def _jsonl_records(path: Path, data: bytes):
    """Yield (where, record) for each non-blank line of a JSON-lines file (MuSiQue), lazily so a
    `limit` stops reading early."""
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        where = _Where(path, f"line {number}")
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise where.error(None, f"not valid JSON ({error})") from None
        yield where, _typed(record, dict, where, "(record)")


def _doc_id(title: str, text: str) -> str:
    return "doc-" + hashlib.sha256(f"{title}\n{text}".encode()).hexdigest()[:16]


def _add_document(corpus: dict[str, Document], title: str, text: str) -> str:
    doc_id = _doc_id(title, text)
    corpus.setdefault(doc_id, Document(doc_id, title, text))
    return doc_id


def _dataset_id(name: str, data: bytes, settings: dict[str, Any]) -> str:
    digest = hashlib.sha256(data)
    digest.update(json.dumps({**settings, "name": name, "version": LOADER_VERSION}, sort_keys=True).encode())
    label = "-".join(str(settings[key]) for key in ("split_name", "setting") if key in settings)
    return f"{name}-{label}-{digest.hexdigest()[:10]}"


def _prompt(name: str, prompt_id: str, question: str, answers: tuple[str, ...], split: str, top_k: int,
            metadata: dict[str, Any]) -> Prompt:
    """The same messages and env as the synthetic generator, so one env and tool format serve both."""
    return Prompt(
        prompt_id=f"{name}-{prompt_id}",
        data_source=name,
        split=split,
        messages=(ChatMessage("system", SYSTEM_PROMPT), ChatMessage("user", f"Question: {question}")),
        answers=answers,
        env_name="search_qa",
        env_kwargs={"top_k": top_k},
        metadata=metadata,
    )


def _check_settings(split_name: str, top_k: int, limit: int | None, setting: str | None = None) -> None:
    if split_name not in SPLITS:
        raise ValueError(f"split_name must be one of {', '.join(SPLITS)}, got {split_name!r}")
    if setting is not None and setting not in SETTINGS:
        raise ValueError(f"setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be None or an integer >= 0, got {limit!r}")


def _unique_id(seen: set[str], source_id: str, where: _Where, key: str) -> None:
    if source_id in seen:
        raise where.error(key, f"duplicate id {source_id!r}")
    seen.add(source_id)


# ---- HotpotQA and 2WikiMultihopQA (same layout) ------------------------------------------------


def _wiki_context(record: dict, where: _Where, corpus: dict[str, Document]) -> dict[str, str]:
    """Add the record's [title, [sentences]] paragraphs to the corpus; title -> doc id."""
    doc_of_title: dict[str, str] = {}
    for index, item in enumerate(_field(record, "context", list, where)):
        key = f"context[{index}]"
        if not (isinstance(item, list) and len(item) == 2):
            raise where.error(key, "expected a [title, [sentences]] pair")
        title = _typed(item[0], str, where, f"{key}[0]")
        sentences = [_typed(s, str, where, f"{key}[1]") for s in _typed(item[1], list, where, f"{key}[1]")]
        # HotpotQA sentences carry their own leading spaces, 2Wiki's do not: normalise both.
        text = " ".join(s.strip() for s in sentences if s.strip())
        doc_of_title.setdefault(title, _add_document(corpus, title, text))
    return doc_of_title


def _supporting_facts(record: dict, where: _Where) -> list[list]:
    facts = _field(record, "supporting_facts", list, where)
    for index, fact in enumerate(facts):
        key = f"supporting_facts[{index}]"
        if not (isinstance(fact, list) and len(fact) == 2):
            raise where.error(key, "expected a [title, sentence index] pair")
        _typed(fact[0], str, where, f"{key}[0]")
        _typed(fact[1], int, where, f"{key}[1]")
    return facts


def _wiki_prompt(name: str, record: dict, where: _Where, corpus: dict[str, Document], settings: dict,
                 optional_keys: tuple[str, ...]) -> tuple[str, Prompt]:
    source_id = _text(record, "_id", where)
    question = _text(record, "question", where)
    answer = _text(record, "answer", where)
    facts = _supporting_facts(record, where)
    doc_of_title = _wiki_context(record, where, corpus)
    titles = list(dict.fromkeys(title for title, _ in facts))
    metadata: dict[str, Any] = {"source_id": source_id}
    for key in optional_keys:
        if key in record:
            metadata[key] = _typed(record[key], str, where, key)
    metadata.update(
        hops=len(titles),
        supporting_titles=titles,
        supporting_facts=facts,
        supporting_doc_ids=[doc_of_title[t] for t in titles if t in doc_of_title],
    )
    if settings["setting"] == "distractor":
        metadata["candidate_doc_ids"] = list(dict.fromkeys(doc_of_title.values()))
    return source_id, _prompt(name, source_id, question, (answer,), settings["split_name"], settings["top_k"], metadata)


def _evidences(record: dict, where: _Where) -> list[list[str]]:
    evidences = _field(record, "evidences", list, where)
    for index, triple in enumerate(evidences):
        if not (isinstance(triple, list) and len(triple) == 3 and all(isinstance(part, str) for part in triple)):
            raise where.error(f"evidences[{index}]", "expected a [subject, relation, object] triple of strings")
    return evidences


def _load_wiki_style(name: str, path: str | Path, settings: dict, optional_keys: tuple[str, ...],
                     extra: Callable[[dict, _Where], dict[str, Any]] | None = None) -> SyntheticQA:
    _check_settings(**settings)
    path, data = _read_bytes(path)
    corpus: dict[str, Document] = {}
    prompts, seen = [], set()
    for where, record in _json_records(path, data, settings["limit"]):
        source_id, prompt = _wiki_prompt(name, record, where, corpus, settings, optional_keys)
        _unique_id(seen, source_id, where, "_id")
        if extra is not None:
            prompt.metadata.update(extra(record, where))
        prompts.append(prompt)
    return SyntheticQA(tuple(prompts), tuple(corpus.values()), _dataset_id(name, data, settings))


@QA_DATASETS.register("hotpotqa")
def load_hotpotqa(path: str | Path, *, split_name: str = "dev", setting: str = "distractor", top_k: int = 3,
                  limit: int | None = None) -> SyntheticQA:
    """HotpotQA from a `hotpot_*_v1.json` file (a JSON list of {_id, question, answer,
    supporting_facts, context, type, level}); `limit` keeps the first that many questions.

    Metadata: source_id, type, level, hops, supporting_titles, supporting_facts, supporting_doc_ids,
    and candidate_doc_ids in the distractor setting (see the module docstring).
    """
    settings = dict(split_name=split_name, setting=setting, top_k=top_k, limit=limit)
    return _load_wiki_style("hotpotqa", path, settings, ("type", "level"))


@QA_DATASETS.register("2wikimultihopqa")
def load_2wikimultihopqa(path: str | Path, *, split_name: str = "dev", setting: str = "distractor",
                         top_k: int = 3, limit: int | None = None) -> SyntheticQA:
    """2WikiMultihopQA from its `train.json` / `dev.json` (HotpotQA's layout plus `evidences`,
    [subject, relation, object] triples, kept in metadata["evidences"]). Types: compositional,
    comparison, inference, bridge_comparison."""
    settings = dict(split_name=split_name, setting=setting, top_k=top_k, limit=limit)
    return _load_wiki_style("2wikimultihopqa", path, settings, ("type",),
                            lambda record, where: {"evidences": _evidences(record, where)})


# ---- MuSiQue -----------------------------------------------------------------------------------


def _musique_paragraphs(record: dict, where: _Where, corpus: dict[str, Document]) -> tuple[dict[int, str], list[int]]:
    """Add the record's paragraphs to the corpus; return paragraph idx -> doc id and the supporting idxs."""
    doc_of_idx: dict[int, str] = {}
    supporting = []
    for index, paragraph in enumerate(_field(record, "paragraphs", list, where)):
        key = f"paragraphs[{index}]"
        paragraph = _typed(paragraph, dict, where, key)
        inner = _Where(where.path, f"{where.label}, {key}")
        idx = _field(paragraph, "idx", int, inner)
        doc_of_idx[idx] = _add_document(corpus, _field(paragraph, "title", str, inner),
                                        _field(paragraph, "paragraph_text", str, inner))
        if _field(paragraph, "is_supporting", bool, inner, False):
            supporting.append(idx)
    return doc_of_idx, supporting


def _decomposition(record: dict, where: _Where) -> list[dict]:
    steps = _field(record, "question_decomposition", list, where, [])
    for index, step in enumerate(steps):
        _typed(step, dict, where, f"question_decomposition[{index}]")
        support = step.get("paragraph_support_idx")
        if support is not None:
            _typed(support, int, where, f"question_decomposition[{index}].paragraph_support_idx")
    return steps


def _musique_prompt(record: dict, where: _Where, corpus: dict[str, Document], settings: dict) -> tuple[str, Prompt]:
    source_id = _text(record, "id", where)
    question = _text(record, "question", where)
    answer = _text(record, "answer", where)
    aliases = [_typed(a, str, where, "answer_aliases") for a in _field(record, "answer_aliases", list, where, [])]
    answerable = _field(record, "answerable", bool, where, True)
    steps = _decomposition(record, where)
    doc_of_idx, supporting = _musique_paragraphs(record, where, corpus)
    # Hop order where the decomposition gives it, then any other supporting paragraph.
    hop_order = [s["paragraph_support_idx"] for s in steps if s.get("paragraph_support_idx") in supporting]
    ordered = list(dict.fromkeys([*hop_order, *supporting]))
    metadata = {
        "source_id": source_id,
        "type": source_id.split("__")[0] if "__" in source_id else None,  # e.g. "2hop", "3hop1"
        "hops": len(steps),
        "answerable": answerable,
        "supporting_doc_ids": [doc_of_idx[i] for i in ordered],
        "candidate_doc_ids": list(dict.fromkeys(doc_of_idx.values())),
        "question_decomposition": steps,
    }
    # MuSiQue-Full files give a question's unanswerable twin the same id.
    prompt_id = source_id if answerable else f"{source_id}-unanswerable"
    answers = tuple(dict.fromkeys([answer, *aliases]))
    return prompt_id, _prompt("musique", prompt_id, question, answers, settings["split_name"], settings["top_k"], metadata)


@QA_DATASETS.register("musique")
def load_musique(path: str | Path, *, split_name: str = "dev", top_k: int = 3, limit: int | None = None,
                 include_unanswerable: bool = False) -> SyntheticQA:
    """MuSiQue from a `musique_*_v1.0_*.jsonl` file (one {id, paragraphs, question,
    question_decomposition, answer, answer_aliases, answerable} per line). Answers = (answer,
    *answer_aliases). Unanswerable questions (MuSiQue-Full) are skipped unless include_unanswerable;
    kept ones get prompt id "musique-<id>-unanswerable". `limit` counts loaded questions.

    Metadata: source_id, type (the id's reasoning-graph prefix), hops, answerable, supporting_doc_ids
    (in hop order), candidate_doc_ids (the question's 20 paragraphs), question_decomposition.
    """
    settings = dict(split_name=split_name, top_k=top_k, limit=limit)
    _check_settings(**settings)
    path, data = _read_bytes(path)
    corpus: dict[str, Document] = {}
    prompts, seen = [], set()
    for where, record in _jsonl_records(path, data):
        if limit is not None and len(prompts) >= limit:
            break
        if not include_unanswerable and not _field(record, "answerable", bool, where, True):
            continue
        prompt_id, prompt = _musique_prompt(record, where, corpus, settings)
        _unique_id(seen, prompt_id, where, "id")
        prompts.append(prompt)
    settings["include_unanswerable"] = include_unanswerable
    return SyntheticQA(tuple(prompts), tuple(corpus.values()), _dataset_id("musique", data, settings))


def load_qa_dataset(name: str, path: str | Path, **kwargs: Any) -> SyntheticQA:
    """Load dataset `name` (one of QA_DATASETS.names()) from its native file at `path`.

    An unknown name raises UnknownNameError listing the valid ones; an argument the loader does not
    take raises TypeError listing the ones it does.
    """
    loader = QA_DATASETS.get(name)
    QA_DATASETS.check_kwargs(name, kwargs)
    return loader(path, **kwargs)


def load_qa_splits(name: str, files: dict[str, str | Path], **kwargs: Any) -> SyntheticQA:
    """One dataset from one native file per split ({"train": ..., "dev": ..., "test": ...}): the
    prompts of every file (split = its key), the union of their corpora (a paragraph shared by two
    files appears once), and an id over the files' own dataset ids."""
    if not files:
        raise ValueError(f"{name}: no files given; map split names ({', '.join(SPLITS)}) to native files")
    loaded = [load_qa_dataset(name, path, split_name=split, **kwargs) for split, path in sorted(files.items())]
    prompts = [p for part in loaded for p in part.prompts]
    clashing = sorted(pid for pid, n in Counter(p.prompt_id for p in prompts).items() if n > 1)[:3]
    if clashing:
        raise ValueError(f"{name}: the same question id is in two split files: {', '.join(clashing)}")
    corpus = {doc.doc_id: doc for part in loaded for doc in part.documents}
    digest = hashlib.sha256("\n".join(part.dataset_id for part in loaded).encode()).hexdigest()[:10]
    return SyntheticQA(tuple(prompts), tuple(corpus.values()), f"{name}-{digest}")
