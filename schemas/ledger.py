"""`ledger`: what one iteration's stages took, one row per stage (agent_core/io/ledger.py).

`wall_seconds` is the stage's own recorded wall time (the `seconds` its manifest holds: for `train`
the span `train_metrics.finished_at - started_at`, for `rollout` the rollout's timing); a stage a
resumed run skipped keeps the seconds of the execution that made its outputs. `device` is where
the run's models lived ("cuda" or "cpu"), `device_count` how many of them the run held (1 GPU, or
the CPU cores this process may use), `device_seconds = wall_seconds * device_count`: what a bill
counts. `price_per_hour` / `currency` come from the run's `cost:` section; the price is null when
unset, and every cost computed from it stays null (agent_core/config/cost.py). Stages of the run
as a whole (init_policy, warm_start, the start policy's dev_eval as `dev_eval_start`, ...) are rows
of iteration 0. Per-step seconds and tokens are not copied here: the `step_costs` view reads them
from the steps table. Row id in errors: `<run_id>/<iteration>/<stage>`.
"""

from pandera.pyarrow import Field

from schemas._base import (
    FLOAT64,
    INT32,
    STRING,
    ArrowModel,
    arrow_schema_of,
    at_least,
    finite,
    one_of,
    row_check,
    unique_key,
)

DEVICES = ("cpu", "cuda")
ROW_ID_COLUMNS = ("run_id", "iteration", "stage")


class LedgerModel(ArrowModel):
    run_id: STRING = Field()
    iteration: INT32 = Field()
    stage: STRING = Field()
    algorithm: STRING = Field()
    device: STRING = Field()
    device_count: INT32 = Field()
    wall_seconds: FLOAT64 = Field()
    device_seconds: FLOAT64 = Field()
    price_per_hour: FLOAT64 = Field(nullable=True)
    currency: STRING = Field()

    _iteration_not_negative = row_check("iteration", ">= 0", at_least("iteration", 0))
    _stage_unique = row_check("stage", "unique per run_id, iteration", unique_key(ROW_ID_COLUMNS))
    _device_known = row_check("device", f"one of {', '.join(DEVICES)}", one_of("device", DEVICES))
    _device_count_positive = row_check("device_count", ">= 1", at_least("device_count", 1))
    _wall_finite = row_check("wall_seconds", "finite", finite("wall_seconds"))
    _wall_not_negative = row_check("wall_seconds", ">= 0", at_least("wall_seconds", 0))
    _device_seconds_finite = row_check("device_seconds", "finite", finite("device_seconds"))
    _device_seconds_not_negative = row_check("device_seconds", ">= 0", at_least("device_seconds", 0))
    _price_not_negative = row_check("price_per_hour", ">= 0", at_least("price_per_hour", 0))


ARROW_SCHEMA = arrow_schema_of(LedgerModel)
