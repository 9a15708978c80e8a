"""`prompts`: the problems of one iteration of a run (a copy of `dataset_prompts` rows, with the
run and iteration in front). The JSON column checks are those of `schemas.dataset`.
Row id in errors: `<run_id>/<iteration>/<prompt_id>`.
"""

from pandera.pyarrow import Field

from schemas._base import INT32, STRING, ArrowModel, arrow_schema_of, at_least, row_check, unique_key
from schemas.dataset import json_column_checks, split_known


class PromptsModel(ArrowModel):
    run_id: STRING = Field()
    iteration: INT32 = Field()
    prompt_id: STRING = Field()
    data_source: STRING = Field()
    split: STRING = Field()
    messages: STRING = Field()
    ground_truth: STRING = Field()
    env: STRING = Field()
    metadata: STRING = Field()

    _iteration_not_negative = row_check("iteration", ">= 0", at_least("iteration", 0))
    _prompt_id_unique = row_check(
        "prompt_id", "unique within (run_id, iteration)", unique_key(("run_id", "iteration", "prompt_id"))
    )
    _split_known = split_known()
    json_column_checks(locals())


ARROW_SCHEMA = arrow_schema_of(PromptsModel)
ROW_ID_COLUMNS = ("run_id", "iteration", "prompt_id")
