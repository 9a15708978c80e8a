"""Prompt / Document <-> table rows (the JSON columns of `dataset_prompts`, `prompts`, `corpus`).

The table schemas check the JSON columns' shape but cannot know the env and tool registries
(schemas/ imports nothing of ours), so `prompts_from_table` / `check_table_envs` check each row's
env against them here, raising the schemas' own TableValidationError: a bad row reads like any
other schema failure, naming the table, its file, the `env` column and the offending rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

import schemas
from agent_core.envs.registry import check_env_spec
from agent_core.types import ChatMessage, Document, Prompt

ENV_CHECK = "a registered env, with arguments and tools it takes"
# (name, kwargs) of the env a prompt is rolled out in; the default is the prompt's own.
EnvOf = Callable[[Prompt], tuple[str, dict[str, Any]]]


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


def prompts_from_table(table_name: str, table: pa.Table, source: str | None = None,
                       env_of: EnvOf | None = None) -> list[Prompt]:
    """The rows of a validated `prompts` / `dataset_prompts` table as Prompts, after checking the
    env each one is rolled out in (`env_of`; a config may replace or refine the prompt's own), so
    a bad row fails when the table is read, not mid-rollout after an engine has started."""
    prompts = [row_to_prompt(row) for row in table.to_pylist()]
    envs = [env_of(p) if env_of else (p.env_name, p.env_kwargs) for p in prompts]
    _check_envs(table_name, table, envs, source)
    return prompts


def check_table_envs(table_name: str, table: pa.Table, source: str | None = None) -> None:
    """Check each row's own env without building Prompts: a dataset of 100k rows has a handful of
    distinct env cells, each parsed once."""
    cells = table.column("env").to_pylist()
    parsed = {}
    for cell in set(cells):
        env = json.loads(cell)  # the schema checked the shape: {"name": str, "kwargs": object}
        parsed[cell] = (env["name"], env["kwargs"])
    _check_envs(table_name, table, [parsed[cell] for cell in cells], source)


def _check_envs(table_name: str, table: pa.Table, envs: Sequence[tuple[str, dict[str, Any]]],
                source: str | None) -> None:
    """One check per distinct env; a failure lists every row with that env."""
    rows_of: dict[str, list[int]] = {}
    spec_of: dict[str, tuple[str, dict[str, Any]]] = {}
    for index, (name, kwargs) in enumerate(envs):
        key = json.dumps([name, kwargs], sort_keys=True, default=repr)
        rows_of.setdefault(key, []).append(index)
        spec_of.setdefault(key, (name, kwargs))
    failures = []
    for key, rows in rows_of.items():
        try:
            check_env_spec(*spec_of[key])
        except ValueError as error:
            ids = _row_ids(table_name, table, rows)
            failures.append(schemas.CheckFailure("env", ENV_CHECK, tuple(ids), len(ids), str(error)))
    if failures:
        raise schemas.TableValidationError(table_name, failures, source)


def _row_ids(table_name: str, table: pa.Table, rows: list[int]) -> list[str]:
    columns = [table.column(c).take(rows).to_pylist() for c in schemas.table_spec(table_name).row_id_columns]
    return ["/".join(str(value) for value in values) for values in zip(*columns)]


def document_to_row(document: Document) -> dict[str, Any]:
    return {"doc_id": document.doc_id, "title": document.title, "text": document.text}


def row_to_document(row: dict[str, Any]) -> Document:
    return Document(doc_id=row["doc_id"], title=row["title"], text=row["text"])
