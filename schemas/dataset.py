"""Dataset tables, shared by every run that uses the dataset: `dataset_prompts` and `corpus`.

`dataset_prompts` holds one RL problem per row; its JSON columns (messages, ground_truth, env,
metadata) are the ones the per-iteration `prompts` table copies, so their checks live here and
`schemas.prompts` reuses them. Row ids in errors: the prompt_id / doc_id.
"""

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pandera.pyarrow import Field

from schemas._base import STRING, ArrowModel, JsonShape, all_items, arrow_schema_of, json_check, one_of, row_check, unique_key

SPLITS = ("train", "dev", "test")


def _messages_ok(messages: pa.Array) -> pa.Array:
    def item_ok(items: pa.Array) -> pa.Array:
        role, content = pc.struct_field(items, "role"), pc.struct_field(items, "content")
        return pc.and_kleene(pc.is_valid(items), pc.and_kleene(pc.is_valid(role), pc.is_valid(content)))

    return pc.and_kleene(pc.greater(pc.list_value_length(messages), 0), all_items(messages, item_ok))


def _answers_ok(ground_truth: pa.Array) -> pa.Array:
    answers = pc.struct_field(ground_truth, "answers")
    return pc.and_kleene(pc.greater(pc.list_value_length(answers), 0), all_items(answers, pc.is_valid))


def _env_ok(env: pa.Array) -> pa.Array:
    return pc.and_kleene(pc.is_valid(pc.struct_field(env, "name")), pc.is_valid(pc.struct_field(env, "kwargs")))


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    )


def _is_ground_truth(value: Any) -> bool:
    answers = value.get("answers") if isinstance(value, dict) else None
    return isinstance(answers, list) and len(answers) > 0 and all(isinstance(a, str) for a in answers)


def _is_env(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("kwargs"), dict)


MESSAGES = JsonShape(
    'JSON list of {"role", "content"} strings, non-empty',
    "list",
    _is_chat,
    pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    _messages_ok,
)
GROUND_TRUTH = JsonShape(
    'JSON {"answers": non-empty list of strings}',
    "object",
    _is_ground_truth,
    pa.struct([("answers", pa.list_(pa.string()))]),
    _answers_ok,
)
ENV = JsonShape(
    'JSON {"name": string, "kwargs": object}',
    "object",
    _is_env,
    pa.struct([("name", pa.string()), ("kwargs", pa.struct([]))]),
    _env_ok,
)
JSON_OBJECT = JsonShape("JSON object", "object", lambda value: isinstance(value, dict))

# Shared by DatasetPromptsModel and schemas.prompts.PromptsModel. Factories, not constants: pandera
# takes a check's name off the decorated method when it builds a schema, so one method object
# declared in two models loses its name in the second.
def split_known():
    return row_check("split", f"one of {', '.join(SPLITS)}", one_of("split", SPLITS))


def json_column_checks(cls_namespace: dict) -> None:
    """Declare the four JSON column checks in a model's class body: `json_column_checks(locals())`."""
    for column, shape in (("messages", MESSAGES), ("ground_truth", GROUND_TRUTH), ("env", ENV), ("metadata", JSON_OBJECT)):
        cls_namespace[f"_{column}_well_formed"] = row_check(column, shape.description, json_check(column, shape))

class DatasetPromptsModel(ArrowModel):
    prompt_id: STRING = Field()
    data_source: STRING = Field()
    split: STRING = Field()
    messages: STRING = Field()
    ground_truth: STRING = Field()
    env: STRING = Field()
    metadata: STRING = Field()

    _prompt_id_unique = row_check("prompt_id", "unique", unique_key(("prompt_id",)))
    _split_known = split_known()
    json_column_checks(locals())


class CorpusModel(ArrowModel):
    doc_id: STRING = Field()
    title: STRING = Field()
    text: STRING = Field()

    _doc_id_unique = row_check("doc_id", "unique", unique_key(("doc_id",)))


DATASET_PROMPTS_ARROW_SCHEMA = arrow_schema_of(DatasetPromptsModel)
DATASET_PROMPTS_ROW_ID_COLUMNS = ("prompt_id",)
CORPUS_ARROW_SCHEMA = arrow_schema_of(CorpusModel)
CORPUS_ROW_ID_COLUMNS = ("doc_id",)
