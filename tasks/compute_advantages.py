"""Stage 4: per-token advantages of every step, by the configured estimator."""

from __future__ import annotations

import pyarrow.compute as pc

from agent_core.algos.step_advantages import StepReward, advantages_for_steps
from agent_core.config import AlgorithmConfig
from agent_core.io.layout import RunLayout
from agent_core.io.tables import read_table, write_table
from tasks._common import stage_logger, stage_task


@stage_task(name="compute_advantages")
def compute_advantages(run: RunLayout, iteration: int, steps_uri: str, rewards_uri: str, cfg: AlgorithmConfig) -> str:
    steps = read_table("steps", steps_uri)
    lengths = steps.select(["episode_id", "group_id", "step_idx"]).append_column(
        "response_length", pc.list_value_length(steps["response_ids"])
    )
    rewards = read_table("rewards", rewards_uri).select(["episode_id", "step_idx", "reward"])
    joined = lengths.join(rewards, keys=["episode_id", "step_idx"], join_type="left outer")
    rows = joined.to_pylist()
    missing = [f"{r['episode_id']}/{r['step_idx']}" for r in rows if r["reward"] is None]
    if missing:
        raise ValueError(f"{rewards_uri}: no reward for steps {missing[:10]} ({len(missing)} steps)")
    results = advantages_for_steps(
        [StepReward(**row) for row in rows],
        estimator=cfg.estimator, gamma=cfg.gamma, lam=cfg.lam, eps=cfg.eps, norm_by_std=cfg.norm_by_std,
    )
    out = [
        {"run_id": run.run_id, "iteration": iteration, "episode_id": r.episode_id, "step_idx": r.step_idx,
         "advantages": r.advantages, "returns": r.returns, "values": None, "ref_logprobs": None,
         "estimator": cfg.estimator}
        for r in results
    ]
    uri = write_table("advantages", out, run.table_uri(iteration, "advantages"))
    nonzero = sum(1 for r in results if any(a != 0.0 for a in r.advantages))
    stage_logger("compute_advantages").info(
        "iteration %d: %s advantages for %d steps (%d with a non-zero signal)", iteration, cfg.estimator,
        len(results), nonzero,
    )
    return uri
