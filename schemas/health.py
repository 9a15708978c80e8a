"""`health`: one row per behaviour check of the audit (agent_core/audit) and audited iteration.

status: ok, alert (a bound broken: `detail` says which), no_data (the check's SELECT returned no
row for the iteration, e.g. no tool call was made, so no tool-error rate exists) or error (the check
could not run: a missing or damaged table, a bad SQL; `detail` is the one-line error).
value: the check's value for the iteration (null unless ok or alert; NaN is kept, and alerts);
baseline: the mean of its values over the run's first `audit.baseline_iterations` iterations (null
while the audited iteration is one of them, or none had a value); ratio: value / baseline (null
when either is missing or the baseline is 0). rule: the check's bounds as text.
Row id in errors: `<iteration>/<check_name>`.
"""

from pandera.pyarrow import Field

from schemas._base import FLOAT64, INT32, STRING, ArrowModel, arrow_schema_of, at_least, one_of, row_check, unique_key

STATUSES = ("ok", "alert", "no_data", "error")
SOURCES = ("builtin", "user")


class HealthModel(ArrowModel):
    run_id: STRING = Field()
    iteration: INT32 = Field()
    check_name: STRING = Field()
    source: STRING = Field()
    status: STRING = Field()
    value: FLOAT64 = Field(nullable=True)
    baseline: FLOAT64 = Field(nullable=True)
    ratio: FLOAT64 = Field(nullable=True)
    rule: STRING = Field()
    detail: STRING = Field(nullable=True)

    _iteration_not_negative = row_check("iteration", ">= 0", at_least("iteration", 0))
    _check_unique = row_check("check_name", "unique per (run_id, iteration)",
                              unique_key(("run_id", "iteration", "check_name")))
    _status_known = row_check("status", f"one of {', '.join(STATUSES)}", one_of("status", STATUSES))
    _source_known = row_check("source", f"one of {', '.join(SOURCES)}", one_of("source", SOURCES))


ARROW_SCHEMA = arrow_schema_of(HealthModel)
ROW_ID_COLUMNS = ("iteration", "check_name")
