"""`eval`: one row per evaluated episode (one prompt answered by one method with one seed).

em / f1 are in [0, 1]; steps and tool_calls are >= 0; termination is how the episode ended
(answered, max_steps, max_context, error), NULL for a single generation without an <answer>
(naive_rag). `checkpoint` is the policy directory the method ran with. Unique key and row id in
errors: `<eval_id>/<method>/<seed>/<prompt_id>`.
"""

from pandera.pyarrow import Field

from schemas._base import (
    BOOL,
    FLOAT64,
    INT32,
    STRING,
    ArrowModel,
    arrow_schema_of,
    at_least,
    in_unit_interval,
    row_check,
    unique_key,
)

ROW_ID_COLUMNS = ("eval_id", "method", "seed", "prompt_id")


class EvalModel(ArrowModel):
    eval_id: STRING = Field()
    method: STRING = Field()
    checkpoint: STRING = Field()
    data_source: STRING = Field()
    split: STRING = Field()
    seed: INT32 = Field()
    prompt_id: STRING = Field()
    prediction: STRING = Field()
    em: FLOAT64 = Field()
    f1: FLOAT64 = Field()
    format_ok: BOOL = Field()
    steps: INT32 = Field()
    tool_calls: INT32 = Field()
    termination: STRING = Field(nullable=True)

    _em_in_range = row_check("em", "in [0, 1]", in_unit_interval("em"))
    _f1_in_range = row_check("f1", "in [0, 1]", in_unit_interval("f1"))
    _steps_not_negative = row_check("steps", ">= 0", at_least("steps", 0))
    _tool_calls_not_negative = row_check("tool_calls", ">= 0", at_least("tool_calls", 0))
    _key_unique = row_check("prompt_id", "unique per eval_id, method, seed", unique_key(ROW_ID_COLUMNS))


ARROW_SCHEMA = arrow_schema_of(EvalModel)
