"""`steps`: one row per agent step (one LLM call and the env's answer), docs/architecture.md §2, §5.

Cross-row rules, checked with Arrow group-bys rather than a loop over episodes:
- (episode_id, step_idx) is unique and step_idx runs 0..n-1 within each episode;
- `done` is True exactly on the last step of each episode (so each episode has one done row);
- `termination` is set iff `done`; `truncated` is True iff the termination is a budget cut-off
  (max_steps, max_context), so truncated and terminated episodes are told apart (e.g. for
  bootstrapping); `prefix_shared` is False on the done row (no next context).
`policy_version` is the version of the weights that served the step (a replica reports the one it
held), never newer than the step's iteration; how much older training accepts is the trainer's
`max_staleness`. `served_by` names the inference replica (null in-process), `retries` counts the
replicas that failed this call before it (docs/scale-out.md), `generated_at` is the unix time the
action came back. `anchor` keys the env state the step STARTED from (GiGPO's anchor state,
agent_core/algos/gigpo.py): the opening context's hash for step 0, else what the env returned with
the previous step (`EnvStep.anchor`); null when the env gives none, and in tables written before
the column (COLUMN_DEFAULTS). `history` says how the step's prompt relates to the previous step's:
"start" on step 0, "appended" when it starts with the previous prompt + response (such an episode
packs into one training sequence), "rewritten" when the context was rebuilt (context management, or
an agent behind the gateway that changed its history; the trainer's `auto` layout trains those as
step rows); null in tables written before the column. `agent` names which of a program's agents made
the call (behind the gateway, when the program names them); each named agent's calls are their own
episode (`<episode>@<agent>`, group `<group>@<agent>`), null otherwise. A step with no action (empty response_ids,
finish_reason "none") records an episode that failed before the policy acted (an agent program that
crashed before its first call): only on a done step with termination "error", never trained on. `response_logprobs` must be finite and <= 1e-4: log-probs are <= 0, the slack absorbs float32
rounding of values near zero. Row id in errors: `<episode_id>/<step_idx>`.
"""

import pyarrow as pa
import pyarrow.compute as pc
from pandera.pyarrow import Field

from schemas._base import (
    BOOL,
    FLOAT64,
    INT32,
    LIST_FLOAT32,
    LIST_INT32,
    STRING,
    ArrowModel,
    JsonShape,
    arrow_schema_of,
    at_least,
    finite,
    json_check,
    list_items_at_least,
    list_items_finite,
    non_empty_list,
    null_where_null,
    set_iff,
    one_of,
    per_group,
    row_check,
    same_list_length,
    unique_key,
)

HISTORIES = ("start", "appended", "rewritten")
TERMINATIONS = ("answered", "max_steps", "max_context", "error")
TRUNCATIONS = ("max_steps", "max_context")  # budget cut-offs: truncated, not terminated
FINISH_REASONS = ("stop", "length", "none")  # none: a step with no action (below)
LOGPROB_MAX = 1e-4
JSON_LIST = JsonShape("JSON list", "list", lambda value: isinstance(value, list))
JSON_OBJECT = JsonShape("JSON object", "object", lambda value: isinstance(value, dict))


def _steps_contiguous(t: pa.Table) -> pa.Array:
    """All rows of an episode fail when its step_idx values are not 0..n-1."""
    groups, group_of_row = per_group(t, "episode_id", [("step_idx", "count"), ("step_idx", "min"), ("step_idx", "max")])
    count_minus_one = pc.subtract(groups["step_idx_count"], 1)
    contiguous = pc.and_(pc.equal(groups["step_idx_min"], 0), pc.equal(groups["step_idx_max"], count_minus_one))
    return pc.take(contiguous, group_of_row)


def _done_on_last_step(t: pa.Table) -> pa.Array:
    """A row fails when done != (it is its episode's last step): flags a missing, an early or an
    extra done row precisely."""
    groups, group_of_row = per_group(t, "episode_id", [("step_idx", "max")])
    is_last = pc.equal(t["step_idx"], pc.take(groups["step_idx_max"], group_of_row))
    return pc.equal(t["done"], is_last)


def _truncated_iff_budget(t: pa.Table) -> pa.Array:
    by_budget = pc.fill_null(pc.is_in(t["termination"], value_set=pa.array(TRUNCATIONS, pa.string())), False)
    return pc.equal(t["truncated"], by_budget)


def _version_not_newer(t: pa.Table) -> pa.Array:
    return pc.less_equal(t["policy_version"], t["iteration"])


def _start_iff_first(t: pa.Table) -> pa.Array:
    """"start" exactly on step 0 (rows with a null history, tables from before the column, pass)."""
    return null_where_null(t["history"], pc.equal(pc.equal(t["history"], "start"), pc.equal(t["step_idx"], 0)))


def _no_action(t: pa.Table) -> pa.Array:
    return pc.equal(pc.list_value_length(t["response_ids"]), 0)


def _action_unless_failed(t: pa.Table) -> pa.Array:
    """A response, except on a failed episode's done step."""
    failed = pc.fill_null(pc.equal(t["termination"], "error"), False)
    return pc.or_(pc.invert(_no_action(t)), failed)


def _none_iff_no_action(t: pa.Table) -> pa.Array:
    return pc.equal(pc.equal(t["finish_reason"], "none"), _no_action(t))


def _not_shared_when_done(t: pa.Table) -> pa.Array:
    return pc.invert(pc.and_kleene(t["done"], t["prefix_shared"]))


class StepsModel(ArrowModel):
    run_id: STRING = Field()
    iteration: INT32 = Field()
    episode_id: STRING = Field()
    group_id: STRING = Field()
    prompt_id: STRING = Field()
    sample_idx: INT32 = Field()
    step_idx: INT32 = Field()
    policy_version: INT32 = Field()
    prompt_ids: LIST_INT32 = Field()
    response_ids: LIST_INT32 = Field()
    response_logprobs: LIST_FLOAT32 = Field()
    response_text: STRING = Field()
    tool_calls: STRING = Field()
    parse_error: STRING = Field(nullable=True)
    observation_text: STRING = Field()
    env_reward: FLOAT64 = Field()
    done: BOOL = Field()
    termination: STRING = Field(nullable=True)
    truncated: BOOL = Field()
    finish_reason: STRING = Field()
    prefix_shared: BOOL = Field()
    info: STRING = Field()
    served_by: STRING = Field(nullable=True)
    retries: INT32 = Field()
    generated_at: FLOAT64 = Field()
    anchor: STRING = Field(nullable=True)
    history: STRING = Field(nullable=True)
    agent: STRING = Field(nullable=True)

    _iteration_not_negative = row_check("iteration", ">= 0", at_least("iteration", 0))
    _sample_idx_not_negative = row_check("sample_idx", ">= 0", at_least("sample_idx", 0))
    _step_idx_not_negative = row_check("step_idx", ">= 0", at_least("step_idx", 0))
    _step_idx_unique = row_check("step_idx", "unique per episode_id", unique_key(("episode_id", "step_idx")))
    _step_idx_contiguous = row_check("step_idx", "contiguous from 0 within each episode", _steps_contiguous)
    _policy_version_not_negative = row_check("policy_version", ">= 0", at_least("policy_version", 0))
    _policy_version_not_newer = row_check("policy_version", "<= iteration (no step comes from a newer policy)",
                                          _version_not_newer)
    _retries_not_negative = row_check("retries", ">= 0", at_least("retries", 0))
    _generated_at_finite = row_check("generated_at", "finite", finite("generated_at"))
    _prompt_ids_non_empty = row_check("prompt_ids", "non-empty", non_empty_list("prompt_ids"))
    _prompt_ids_valid = row_check("prompt_ids", "token ids >= 0", list_items_at_least("prompt_ids", 0))
    _response_ids_non_empty = row_check("response_ids", "non-empty unless the step records a failure "
                                        "(termination error)", _action_unless_failed)
    _response_ids_valid = row_check("response_ids", "token ids >= 0", list_items_at_least("response_ids", 0))
    _logprobs_match_ids = row_check(
        "response_logprobs", "same length as response_ids", same_list_length("response_logprobs", "response_ids")
    )
    _logprobs_valid = row_check(
        "response_logprobs", f"finite and <= {LOGPROB_MAX:g}", list_items_finite("response_logprobs", LOGPROB_MAX)
    )
    _tool_calls_json = row_check("tool_calls", JSON_LIST.description, json_check("tool_calls", JSON_LIST))
    _env_reward_finite = row_check("env_reward", "finite", finite("env_reward"))
    _done_on_last_step = row_check("done", "exactly one done row per episode, on its last step", _done_on_last_step)
    _termination_known = row_check("termination", f"one of {', '.join(TERMINATIONS)}", one_of("termination", TERMINATIONS))
    _termination_iff_done = row_check("termination", "set iff done", set_iff("termination", "done"))
    _truncated_iff_budget = row_check(
        "truncated", f"True iff termination is one of {', '.join(TRUNCATIONS)}", _truncated_iff_budget
    )
    _finish_reason_known = row_check(
        "finish_reason", f"one of {', '.join(FINISH_REASONS)}", one_of("finish_reason", FINISH_REASONS)
    )
    _finish_none_iff_no_action = row_check("finish_reason", "'none' iff response_ids is empty", _none_iff_no_action)
    _prefix_not_shared_when_done = row_check("prefix_shared", "False on the done row", _not_shared_when_done)
    _history_known = row_check("history", f"one of {', '.join(HISTORIES)}", one_of("history", HISTORIES))
    _history_start_iff_first = row_check("history", "'start' iff step_idx = 0", _start_iff_first)
    _info_json = row_check("info", JSON_OBJECT.description, json_check("info", JSON_OBJECT))


ARROW_SCHEMA = arrow_schema_of(StepsModel)
ROW_ID_COLUMNS = ("episode_id", "step_idx")
COLUMN_DEFAULTS = {"anchor": None, "history": None, "agent": None}
