"""`rewards`: one row per agent step, the reward a scorer gave it.

reward = outcome_reward + process_factor * process_reward (to 1e-6): the combined reward that
advantages are computed from, process_factor being the process weight times the batch normalizer; em / f1 / format_score are in [0, 1] when the
scorer computes them; `components` is a flat JSON object of name -> number (checked by one exact
regex, no JSON parse). Row id in errors: `<episode_id>/<step_idx>`.
"""

import pyarrow as pa
import pyarrow.compute as pc
from pandera.pyarrow import Field

from schemas._base import (
    FLOAT64,
    INT32,
    STRING,
    ArrowModel,
    arrow_schema_of,
    at_least,
    finite,
    in_unit_interval,
    json_number_map,
    row_check,
    unique_key,
)

SUM_TOLERANCE = 1e-6


def _reward_is_sum(t: pa.Table) -> pa.Array:
    total = pc.add(pc.multiply(t["process_factor"], t["process_reward"]), t["outcome_reward"])
    return pc.less_equal(pc.abs(pc.subtract(t["reward"], total)), SUM_TOLERANCE)


class RewardsModel(ArrowModel):
    run_id: STRING = Field()
    iteration: INT32 = Field()
    episode_id: STRING = Field()
    group_id: STRING = Field()
    prompt_id: STRING = Field()
    sample_idx: INT32 = Field()
    step_idx: INT32 = Field()
    process_reward: FLOAT64 = Field()
    outcome_reward: FLOAT64 = Field()
    process_factor: FLOAT64 = Field()
    reward: FLOAT64 = Field()
    em: FLOAT64 = Field(nullable=True)
    f1: FLOAT64 = Field(nullable=True)
    format_score: FLOAT64 = Field(nullable=True)
    components: STRING = Field()
    scorer: STRING = Field()

    _iteration_not_negative = row_check("iteration", ">= 0", at_least("iteration", 0))
    _sample_idx_not_negative = row_check("sample_idx", ">= 0", at_least("sample_idx", 0))
    _step_idx_not_negative = row_check("step_idx", ">= 0", at_least("step_idx", 0))
    _step_idx_unique = row_check("step_idx", "unique per episode_id", unique_key(("episode_id", "step_idx")))
    _process_reward_finite = row_check("process_reward", "finite", finite("process_reward"))
    _outcome_reward_finite = row_check("outcome_reward", "finite", finite("outcome_reward"))
    _process_factor_finite = row_check("process_factor", "finite", finite("process_factor"))
    _reward_finite = row_check("reward", "finite", finite("reward"))
    _reward_is_sum = row_check(
        "reward", f"equals outcome_reward + process_factor * process_reward (to {SUM_TOLERANCE:g})", _reward_is_sum
    )
    _em_in_range = row_check("em", "in [0, 1]", in_unit_interval("em"))
    _f1_in_range = row_check("f1", "in [0, 1]", in_unit_interval("f1"))
    _format_score_in_range = row_check("format_score", "in [0, 1]", in_unit_interval("format_score"))
    _components_json = row_check("components", "JSON object of name -> number", json_number_map("components"))


ARROW_SCHEMA = arrow_schema_of(RewardsModel)
ROW_ID_COLUMNS = ("episode_id", "step_idx")
