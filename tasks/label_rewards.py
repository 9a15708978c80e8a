"""Stage 3: label each step with its process reward and each episode's end with its outcome."""

from __future__ import annotations

import json

from agent_core.config import RewardConfig
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import read_table
from tasks._common import completed_outputs, label_steps_table, stage_logger, stage_task


@stage_task(name="label_rewards")
def label_rewards(run: RunLayout, iteration: int, steps_uri: str, prompts_uri: str, cfg: RewardConfig,
                  resume: bool = True) -> str:
    record = StageRecord(run.manifest_path("label_rewards", iteration), "label_rewards",
                         inputs={"steps": steps_uri, "prompts": prompts_uri}, params={"reward": cfg})
    if (done := completed_outputs(record, resume, f"iteration {iteration} rewards")) is not None:
        return done["rewards"]
    prompts = read_table("prompts", prompts_uri).select(["prompt_id", "ground_truth"]).to_pylist()
    answers = {row["prompt_id"]: json.loads(row["ground_truth"])["answers"] for row in prompts}
    uri = run.table_uri(iteration, "rewards")
    records = label_steps_table(steps_uri, answers, cfg, run.run_id, iteration, uri)
    record.commit({"rewards": uri})
    finals = [r for r in records if r.em is not None]
    stage_logger("label_rewards").info(
        "iteration %d: %d episodes, mean EM %.3f", iteration, len(finals),
        sum(r.em for r in finals) / max(len(finals), 1),
    )
    return uri
