"""`advantages`: one row per agent step trained on, one advantage (and return) per response token
(failed episodes have none: `algorithm.failed_episodes`).

`values` are the critic's values (PPO-family estimators) and `ref_logprobs` the frozen reference
policy's log-probs, both per response token, null when not computed. `obs_advantages`,
`obs_returns`, `obs_values` cover the observation tokens that follow the response (the next
step's prompt suffix) and are set only when a mask is off (docs/architecture.md §3 ablations) and the step's
observation is part of the episode grid; null otherwise. Advantage mask off: the recursion's own
values there (with returns and values as critic targets). Loss mask off with the advantage mask
on: the advantage of the action the observation follows, so those tokens are trained with it;
no returns or values there then (the critic predicts only on actions).

Here only the table's own lengths can be checked (advantages, returns, values, ref_logprobs
agree); that they match the step's response_ids is a join of two tables, which the stage that
joins them checks. Every float list must be finite: a nan/inf here would reach the trainer's loss
(which would only skip the update) instead of failing at the stage that made it.
Row id in errors: `<episode_id>/<step_idx>`.
"""

import pyarrow as pa
import pyarrow.compute as pc
from pandera.pyarrow import Field

from schemas._base import (
    INT32,
    LIST_FLOAT32,
    STRING,
    ArrowModel,
    arrow_schema_of,
    at_least,
    list_items_finite,
    non_empty_list,
    row_check,
    same_list_length,
    unique_key,
)


class AdvantagesModel(ArrowModel):
    run_id: STRING = Field()
    iteration: INT32 = Field()
    episode_id: STRING = Field()
    step_idx: INT32 = Field()
    advantages: LIST_FLOAT32 = Field()
    returns: LIST_FLOAT32 = Field()
    values: LIST_FLOAT32 = Field(nullable=True)
    ref_logprobs: LIST_FLOAT32 = Field(nullable=True)
    obs_advantages: LIST_FLOAT32 = Field(nullable=True)
    obs_returns: LIST_FLOAT32 = Field(nullable=True)
    obs_values: LIST_FLOAT32 = Field(nullable=True)
    estimator: STRING = Field()

    _iteration_not_negative = row_check("iteration", ">= 0", at_least("iteration", 0))
    _step_idx_not_negative = row_check("step_idx", ">= 0", at_least("step_idx", 0))
    _step_idx_unique = row_check("step_idx", "unique per episode_id", unique_key(("episode_id", "step_idx")))
    _advantages_non_empty = row_check("advantages", "non-empty", non_empty_list("advantages"))
    _advantages_finite = row_check("advantages", "finite", list_items_finite("advantages"))
    _returns_match = row_check("returns", "same length as advantages", same_list_length("returns", "advantages"))
    _returns_finite = row_check("returns", "finite", list_items_finite("returns"))
    _values_match = row_check("values", "same length as advantages", same_list_length("values", "advantages"))
    _ref_logprobs_match = row_check(
        "ref_logprobs", "same length as advantages", same_list_length("ref_logprobs", "advantages")
    )
    _values_finite = row_check("values", "finite", list_items_finite("values"))
    _ref_logprobs_finite = row_check("ref_logprobs", "finite", list_items_finite("ref_logprobs"))
    _obs_advantages_finite = row_check("obs_advantages", "finite", list_items_finite("obs_advantages"))
    _obs_returns_match = row_check(
        "obs_returns", "same length as obs_advantages", same_list_length("obs_returns", "obs_advantages")
    )
    _obs_values_match = row_check(
        "obs_values", "same length as obs_advantages", same_list_length("obs_values", "obs_advantages")
    )
    _obs_returns_finite = row_check("obs_returns", "finite", list_items_finite("obs_returns"))
    _obs_values_finite = row_check("obs_values", "finite", list_items_finite("obs_values"))


ARROW_SCHEMA = arrow_schema_of(AdvantagesModel)
ROW_ID_COLUMNS = ("episode_id", "step_idx")
