"""`train_metrics`: one row per optimizer step.

A skipped update (e.g. a batch with no gradient signal, or a non-finite loss) is recorded, not
dropped: `skipped` with a `skip_reason`, and its loss / pg_loss / grad_norm may then be NaN;
otherwise they must be finite. `started_at` / `finished_at`: unix times the iteration's training stage
started and ended (the same on all its rows; they show rollout/training overlap, docs/scale-out.md).
`oom_splits`: micro-batches of the update that ran out of device memory and were split and retried
(agent_core/training/oom.py); a table written before the column existed reads as 0 (COLUMN_DEFAULTS).
Row id in errors: `<run_id>/<iteration>/<update_idx>`.
"""

from pandera.pyarrow import Field

from schemas._base import (
    BOOL,
    FLOAT64,
    INT32,
    INT64,
    STRING,
    ArrowModel,
    arrow_schema_of,
    at_least,
    finite_unless,
    set_iff,
    row_check,
)


class TrainMetricsModel(ArrowModel):
    run_id: STRING = Field()
    iteration: INT32 = Field()
    update_idx: INT32 = Field()
    loss: FLOAT64 = Field()
    pg_loss: FLOAT64 = Field()
    vf_loss: FLOAT64 = Field(nullable=True)
    entropy: FLOAT64 = Field()
    kl: FLOAT64 = Field()
    clipfrac: FLOAT64 = Field()
    grad_norm: FLOAT64 = Field()
    lr: FLOAT64 = Field()
    tokens: INT64 = Field()
    tokens_per_s: FLOAT64 = Field()
    seconds: FLOAT64 = Field()
    skipped: BOOL = Field()
    skip_reason: STRING = Field(nullable=True)
    started_at: FLOAT64 = Field()
    finished_at: FLOAT64 = Field()
    oom_splits: INT32 = Field()

    _iteration_not_negative = row_check("iteration", ">= 0", at_least("iteration", 0))
    _update_idx_not_negative = row_check("update_idx", ">= 0", at_least("update_idx", 0))
    _loss_finite = row_check("loss", "finite unless skipped", finite_unless("loss", "skipped"))
    _pg_loss_finite = row_check("pg_loss", "finite unless skipped", finite_unless("pg_loss", "skipped"))
    _grad_norm_finite = row_check("grad_norm", "finite unless skipped", finite_unless("grad_norm", "skipped"))
    _tokens_not_negative = row_check("tokens", ">= 0", at_least("tokens", 0))
    _seconds_not_negative = row_check("seconds", ">= 0", at_least("seconds", 0))
    _oom_splits_not_negative = row_check("oom_splits", ">= 0", at_least("oom_splits", 0))
    _skip_reason_iff_skipped = row_check("skip_reason", "set iff skipped", set_iff("skip_reason", "skipped"))


ARROW_SCHEMA = arrow_schema_of(TrainMetricsModel)
ROW_ID_COLUMNS = ("run_id", "iteration", "update_idx")
# Columns added after tables were written: a table (or rows) without one gets this value in each row.
COLUMN_DEFAULTS = {"oom_splits": 0}
