"""Your own dataset: prompts from JSON-lines files, one file per split (`data.source: jsonl`).

One JSON object per line: `id`, `question` or `messages`, `answers` (gold first, then aliases), and optional
`env`, `metadata`, `documents`, `data_source`. A malformed line raises DatasetFormatError naming the file, the
line and the key; the dataset id hashes the files' bytes and the settings.
Design notes: docs/architecture.md §11 (agent_core/data/prompt_files.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from agent_core.data.loaders import (
    SPLITS, _add_document, _field, _jsonl_records, _read_bytes, _text, _unique_id, _Where,
)
from agent_core.data.synthetic import SyntheticQA
from agent_core.types import ChatMessage, Document, Prompt

PROMPT_FILES_VERSION = 1
DEFAULT_ENV = "search_qa"


def load_prompt_files(files: dict[str, str | Path], *, top_k: int = 3, limit: int | None = None) -> SyntheticQA:
    """The prompts of every file (split = its key in `files`: train, dev or test; the first `limit`
    lines of each) and the corpus of their documents."""
    if not files:
        raise ValueError(f"jsonl: no files given; map split names ({', '.join(SPLITS)}) to JSON-lines files")
    unknown = sorted(set(files) - set(SPLITS))
    if unknown:
        raise ValueError(f"jsonl: unknown split(s) {', '.join(unknown)}; valid: {', '.join(SPLITS)}")
    digest = hashlib.sha256(json.dumps({"top_k": top_k, "limit": limit, "version": PROMPT_FILES_VERSION}).encode())
    prompts: list[Prompt] = []
    corpus: dict[str, Document] = {}
    seen: set[str] = set()
    for split, name in sorted(files.items()):
        path, data = _read_bytes(name)
        digest.update(f"\n{split}\n".encode() + hashlib.sha256(data).digest())
        for count, (where, record) in enumerate(_jsonl_records(path, data)):
            if limit is not None and count >= limit:
                break
            prompt = _prompt(record, where, split, top_k, corpus)
            _unique_id(seen, prompt.prompt_id, where, "id")
            prompts.append(prompt)
    return SyntheticQA(tuple(prompts), tuple(corpus.values()), f"jsonl-{digest.hexdigest()[:10]}")


def _prompt(record: dict, where: _Where, split: str, top_k: int, corpus: dict[str, Document]) -> Prompt:
    answers = _field(record, "answers", list, where)
    if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise where.error("answers", "expected a non-empty list of non-blank strings (the gold answer first)")
    env = _field(record, "env", dict, where, {"name": DEFAULT_ENV, "kwargs": {"top_k": top_k}})
    if not isinstance(env.get("name"), str) or not isinstance(env.get("kwargs", {}), dict):
        raise where.error("env", 'expected {"name": string, "kwargs": object}')
    for document in _field(record, "documents", list, where, []):
        if not isinstance(document, dict) or not all(isinstance(document.get(k), str) for k in ("title", "text")):
            raise where.error("documents", 'expected a list of {"title": string, "text": string}')
        _add_document(corpus, document["title"], document["text"])
    return Prompt(
        prompt_id=_text(record, "id", where),
        data_source=_field(record, "data_source", str, where, "jsonl"),
        split=split,
        messages=_messages(record, where),
        answers=tuple(answers),
        env_name=env["name"],
        env_kwargs=dict(env.get("kwargs", {})),
        metadata=_field(record, "metadata", dict, where, {}),
    )


def _messages(record: dict, where: _Where) -> tuple[ChatMessage, ...]:
    if ("question" in record) == ("messages" in record):
        raise where.error("question", "give exactly one of 'question' (a string) and 'messages' (a chat)")
    if "question" in record:
        return (ChatMessage("user", _text(record, "question", where)),)
    messages = _field(record, "messages", list, where)
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise where.error("messages", 'expected a non-empty list of {"role": string, "content": string}')
    return tuple(ChatMessage(m["role"], m["content"]) for m in messages)
