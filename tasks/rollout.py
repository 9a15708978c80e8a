"""Stage 2: roll out episodes with the current policy and record every step."""

from __future__ import annotations

import time
from pathlib import Path

from agent_core.cluster.placement import Placement
from agent_core.config import RolloutConfig
from agent_core.data.rows import prompts_from_table
from agent_core.drivers import DataAccess, roll_out
from agent_core.io.checkpoints import check_checkpoint, load_tokenizer
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import read_table, rows_of, write_table
from agent_core.rollout.records import episode_failures
from agent_core.rollout.spec import env_for
from tasks._common import completed_outputs, read_corpus, stage_logger, stage_progress, stage_task


class RolloutFailedError(RuntimeError):
    """Every episode of a rollout failed: the run stops (failed) before training on nothing."""


@stage_task(name="rollout")
def rollout(run: RunLayout, iteration: int, prompts_uri: str, corpus_uri: str, policy_dir: str,
            cfg: RolloutConfig, seed: int, resume: bool = True, policy_version: int | None = None,
            placement: Placement = Placement()) -> str:
    """Episodes of the iteration's prompts with the policy at `policy_dir`; the steps table's URI.

    policy_version: the version `policy_dir` holds (default: `iteration`, on-policy; one less when
    this rollout overlaps the previous iteration's training). placement: where the engine runs (the
    run's, `RunResources.placement`: this process on its device, or the cluster's replicas); it does
    not change what is sampled, so it is not a setting the stage's manifest compares.
    """
    log = stage_logger("rollout")
    version = iteration if policy_version is None else policy_version
    record = StageRecord(run.manifest_path("rollout", iteration), "rollout",
                         inputs={"prompts": prompts_uri, "corpus": corpus_uri, "policy": policy_dir},
                         params={"rollout": cfg, "seed": seed, "iteration": iteration,
                                 **({"policy_version": version} if version != iteration else {})})
    if (done := completed_outputs(record, resume, f"iteration {iteration} rollout")) is not None:
        return done["steps"]
    started = time.perf_counter()
    # Bad input (an unknown env or tool, a checkpoint without weights) fails here, naming the file,
    # before an engine starts or anything is written.
    prompts = prompts_from_table("prompts", read_table("prompts", prompts_uri), prompts_uri,
                                 env_of=lambda prompt: env_for(prompt, cfg))
    check_checkpoint(Path(policy_dir))
    documents = read_corpus(corpus_uri)
    tokenizer = load_tokenizer(Path(policy_dir))
    with (placement.rollout_engine(cfg, policy_dir, version) as engine,
          stage_progress("rollout", f"rollout iteration {iteration}", "episodes")):
        records = roll_out(engine, tokenizer, prompts, documents, cfg, seed=seed * 100_003 + iteration,
                           policy_version=version, episode_prefix=f"{run.run_id}-i{iteration}-",
                           access=DataAccess(corpus_uri, str(run.data_root)), preflight=iteration == 0)
    rows = rows_of(records, run_id=run.run_id, iteration=iteration)  # shallow: asdict deep-copies every token list
    uri = write_table("steps", rows, run.table_uri(iteration, "steps"))
    failures = episode_failures(records)
    if failures.all_failed:  # written for a look, not committed: nothing to train on
        raise RolloutFailedError(f"iteration {iteration} rollout: {failures.describe()}; every episode is in {uri}")
    record.commit({"steps": uri}, metrics={"seconds": time.perf_counter() - started})
    if failures.failed:
        log.warning("iteration %d: %s", iteration, failures.describe())
    episodes = len(prompts) * cfg.group_size
    log.info("iteration %d: %d episodes, %d steps, %d generated tokens", iteration, episodes, len(records),
             sum(len(r.response_ids) for r in records))
    if retried := sum(1 for r in records if r.retries):
        log.warning("iteration %d: %d steps were generated again after a replica failed (steps.retries, "
                    "steps.served_by)", iteration, retried)
    return uri
