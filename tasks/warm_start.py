"""Warm start: episodes to imitate (a scripted oracle's, or an earlier steps table), selected by SQL,
then supervised fine-tuning of the initial policy; RL starts from the result
(`RunLayout.start_policy_dir`)."""

from __future__ import annotations

import random
from pathlib import Path

from agent_core.config import RewardConfig, RolloutConfig, WarmStartConfig
from agent_core.data.oracle import TASK_ENV, OracleEngine, check_oracle_solved, rag_demonstrations, unread_copies
from agent_core.devices import resolve_device
from agent_core.drivers import DataAccess, roll_out
from agent_core.envs.registry import env_tool_format
from agent_core.io.checkpoints import load_policy, load_tokenizer, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.query import select_episode_ids
from agent_core.io.tables import read_table, rows_of, write_table
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.sft import sft_train
from agent_core.training.trainer import make_optimizer
from tasks._common import (
    DatasetUris,
    completed_outputs,
    label_steps_table,
    read_corpus,
    split_prompts,
    stage_logger,
    stage_task,
)


@stage_task(name="oracle_episodes")
def oracle_episodes(run: RunLayout, dataset: DatasetUris, cfg: WarmStartConfig, rollout: RolloutConfig,
                    reward: RewardConfig, policy_dir: str, seed: int, top_k: int = 3, resume: bool = True) -> tuple[str, str]:
    """The scripted oracle solves `cfg.prompts` training prompts in the rollout's env and format, and
    answers `cfg.rag_prompts` others in the naive_rag format (with `top_k` passages), recorded token for token with the
    policy's tokenizer; returns (steps uri, rewards uri)."""
    log = stage_logger("oracle_episodes")
    record = StageRecord(run.manifest_path("oracle_episodes"), "oracle_episodes",
                         inputs={"dataset_prompts": dataset.prompts_uri, "corpus": dataset.corpus_uri,
                                 "policy": policy_dir},
                         params={"warm_start": cfg, "rollout": rollout, "reward": reward, "seed": seed, "top_k": top_k})
    if (done := completed_outputs(record, resume, "warm start episodes")) is not None:
        return done["steps"], done["rewards"]
    train = split_prompts(dataset, "train")
    chosen = random.Random(f"warm-start:{seed}").sample(train, min(cfg.prompts, len(train)))
    prompts = list(chosen)
    documents = read_corpus(dataset.corpus_uri)
    tokenizer = load_tokenizer(Path(policy_dir))
    tool_format = env_tool_format(rollout.env or TASK_ENV, rollout.env_kwargs)
    lazy = random.Random(f"warm-start-lazy:{seed}").sample(chosen, round(cfg.lazy_fraction * len(chosen)))
    tool_prefix = f"{run.run_id}-warm-"  # the oracle's tool episodes (the naive_rag ones are "-rag-")
    engine = OracleEngine(tokenizer, prompts, tool_format=tool_format,
                          lazy_prompt_ids=frozenset(p.prompt_id for p in lazy))
    # the corpus, as RL's rollouts get it: a program's search must see what the oracle's plan reads
    records = roll_out(engine, tokenizer, prompts, documents, rollout, seed=seed, policy_version=0,
                       episode_prefix=tool_prefix, group_size=1,
                       access=DataAccess(dataset.corpus_uri, str(run.data_root)))
    if unread := unread_copies(records, chosen):
        episode, entity = unread[0]
        log.warning("warm start: %d of the oracle's steps copy an entity no earlier result of their episode showed "
                    "(e.g. %r in %s): the policy learns them as guesses. Does the env's search read the run's corpus?",
                    len(unread), entity, episode)
    rag = random.Random(f"warm-start-rag:{seed}").sample(train, min(cfg.rag_prompts, len(train)))
    prompts += rag
    records += rag_demonstrations(tokenizer, rag, documents, top_k=top_k, episode_prefix=f"{run.run_id}-rag-")
    steps = rows_of(records, run_id=run.run_id, iteration=0)
    steps_uri = write_table("steps", steps, run.warm_start_dir / "steps.parquet")
    answers = {p.prompt_id: list(p.answers) for p in prompts}  # a prompt in both samples: same answers
    rewards_uri = str(run.warm_start_dir / "rewards.parquet")
    labelled = label_steps_table(steps_uri, answers, reward, run.run_id, 0, rewards_uri)
    finals = [r.em for r in labelled if r.em is not None]
    # before the commit, so a resumed run checks again instead of skipping a stage that failed; the
    # tool episodes only (the naive_rag answers are the gold, solved whatever the env does)
    check_oracle_solved(sum(r.em for r in labelled if r.em is not None and r.episode_id.startswith(tool_prefix)),
                        len(chosen) - len(lazy), rollout.env or TASK_ENV,
                        cut_actions=sum(r.finish_reason == "length" for r in records))
    record.commit({"steps": steps_uri, "rewards": rewards_uri})
    log.info("warm start: the oracle solved %d of %d episodes (%d tool episodes in the %s format, %d of them lazy; "
             "%d naive_rag answers; %d steps)", sum(finals), len(finals), len(chosen), tool_format, len(lazy), len(rag),
             len(records))
    return steps_uri, rewards_uri


def _selected_episodes(steps_uri: str, rewards_uri: str, sql: str) -> list[list[TrainStep]]:
    chosen = set(select_episode_ids(sql, {"steps": steps_uri, "rewards": rewards_uri}))
    steps = read_table("steps", steps_uri).select(
        ["episode_id", "step_idx", "prompt_ids", "response_ids", "response_logprobs"]).to_pylist()
    episodes: dict[str, list[dict]] = {}
    for s in steps:
        if s["episode_id"] in chosen and s["response_ids"]:  # a step with no action has nothing to imitate
            episodes.setdefault(s["episode_id"], []).append(s)
    return [[TrainStep(s["prompt_ids"], s["response_ids"], s["response_logprobs"], [0.0] * len(s["response_ids"]))
             for s in sorted(rows, key=lambda r: r["step_idx"])] for rows in episodes.values()]


@stage_task(name="warm_start")
def warm_start(run: RunLayout, steps_uri: str, rewards_uri: str, cfg: WarmStartConfig, micro_batch_tokens: int,
               policy_dir: str, seed: int, resume: bool = True, device: str = "auto") -> str:
    """Fine-tune the policy of `policy_dir` on the episodes `cfg.selection_sql` picks; return where it is.
    device: where it trains (the run's `device` setting; not compared by the manifest)."""
    log = stage_logger("warm_start")
    record = StageRecord(run.manifest_path("warm_start"), "warm_start",
                         inputs={"steps": steps_uri, "rewards": rewards_uri, "policy": policy_dir},
                         params={"warm_start": cfg, "micro_batch_tokens": micro_batch_tokens, "seed": seed})
    if (done := completed_outputs(record, resume, "warm start")) is not None:
        return done["policy"]
    episodes = _selected_episodes(steps_uri, rewards_uri, cfg.selection_sql)
    if not episodes:
        raise ValueError(f"warm start: {cfg.selection_sql!r} selected no episode of {steps_uri}")
    sequences = choose_layout(episodes, "auto")
    model, tokenizer = load_policy(Path(policy_dir), device=resolve_device(device))
    optimizer = make_optimizer(model, lr=cfg.lr)
    results = sft_train(model, optimizer, sequences, pad_id=tokenizer.pad_token_id, epochs=cfg.epochs,
                        batch_size=cfg.batch_size, micro_batch_tokens=micro_batch_tokens, seed=seed,
                        log_every=max(1, -(-len(sequences) // cfg.batch_size) // 10), log=log, all_tokens=cfg.loss_on == "all")
    target = save_policy(model, tokenizer, run.warm_start_policy_dir)
    record.commit({"policy": target})
    log.info("warm start: %d episodes, NLL per %s token %.3f -> %.3f over %d steps; policy at %s",
             len(episodes), "predicted" if cfg.loss_on == "all" else "action", results[0].nll, results[-1].nll,
             len(results), target)
    return str(target)
