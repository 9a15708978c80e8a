"""Prompt / Document <-> table rows (the JSON columns of `dataset_prompts`, `prompts`, `corpus`)."""

from __future__ import annotations

import json
from typing import Any

from agent_core.types import ChatMessage, Document, Prompt


def prompt_to_row(prompt: Prompt) -> dict[str, Any]:
    return {
        "prompt_id": prompt.prompt_id,
        "data_source": prompt.data_source,
        "split": prompt.split,
        "messages": json.dumps([m.as_dict() for m in prompt.messages]),
        "ground_truth": json.dumps({"answers": list(prompt.answers)}),
        "env": json.dumps({"name": prompt.env_name, "kwargs": prompt.env_kwargs}),
        "metadata": json.dumps(prompt.metadata),
    }


def row_to_prompt(row: dict[str, Any]) -> Prompt:
    env = json.loads(row["env"])
    return Prompt(
        prompt_id=row["prompt_id"],
        data_source=row["data_source"],
        split=row["split"],
        messages=tuple(ChatMessage(m["role"], m["content"]) for m in json.loads(row["messages"])),
        answers=tuple(json.loads(row["ground_truth"])["answers"]),
        env_name=env["name"],
        env_kwargs=env.get("kwargs", {}),
        metadata=json.loads(row["metadata"]),
    )


def document_to_row(document: Document) -> dict[str, Any]:
    return {"doc_id": document.doc_id, "title": document.title, "text": document.text}


def row_to_document(row: dict[str, Any]) -> Document:
    return Document(doc_id=row["doc_id"], title=row["title"], text=row["text"])
