"""Stage 2: roll out episodes with the current policy and record every step."""

from __future__ import annotations

import time
from pathlib import Path

from agent_core.config import RolloutConfig
from agent_core.data.rows import prompts_from_table
from agent_core.envs.registry import ENVS, EnvResources, env_kwarg_names, make_env
from agent_core.envs.search import Bm25Index
from agent_core.envs.tool_env import ChatCapabilities
from agent_core.io.checkpoints import check_checkpoint, load_tokenizer
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import read_table, rows_of, write_table
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids, template_supports_tool_role, template_supports_tools
from agent_core.rollout.context import ContextPolicy
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine
from tasks._common import completed_outputs, stage_logger, stage_task
from tasks.prepare_data import read_corpus


def engine_options(cfg: RolloutConfig) -> EngineOptions:
    return EngineOptions(max_batch_size=cfg.max_batch_size, max_model_len=cfg.max_context_tokens,
                         vllm=cfg.vllm.options())


def _env_of(prompt, cfg: RolloutConfig) -> tuple[str, dict]:
    """The config's env replaces the prompt's (and its kwargs); config kwargs refine the prompt's own env.
    An env that takes `instructions` gets `cfg.tool_instructions` unless the kwargs say otherwise."""
    if cfg.env is not None and cfg.env != prompt.env_name:
        name, kwargs = cfg.env, dict(cfg.env_kwargs)
    else:
        name, kwargs = prompt.env_name, {**prompt.env_kwargs, **cfg.env_kwargs}
    if "instructions" not in kwargs and name in ENVS.names() and "instructions" in env_kwarg_names(name):
        kwargs["instructions"] = cfg.instructions
    return name, kwargs


def roll_out(engine, tokenizer, prompts: list, documents: list, cfg: RolloutConfig, *, seed: int,
             policy_version: int, episode_prefix: str, group_size: int | None = None) -> list:
    """Episodes of `prompts` with `engine` in the config's envs; the step records (also used by the
    warm start's oracle episodes)."""
    chat = ChatCapabilities(template_supports_tools(tokenizer), template_supports_tool_role(tokenizer))
    resources = EnvResources(search_index=Bm25Index(documents), chat=chat)
    sampling = SamplingParams(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        seed=seed, stop_token_ids=eos_token_ids(tokenizer),
    )
    settings = LoopSettings(
        group_size=group_size or cfg.group_size, max_steps=cfg.max_steps, max_context_tokens=cfg.max_context_tokens,
        policy_version=policy_version, episode_prefix=episode_prefix,
        context=ContextPolicy(cfg.context_mode, cfg.keep_last_turns, cfg.max_observation_tokens),
        env_workers=cfg.env_workers, straggler_wait_s=cfg.straggler_wait_s,
    )
    return run_episodes(engine, tokenizer, prompts, lambda p: make_env(*_env_of(p, cfg), resources), sampling, settings)


@stage_task(name="rollout")
def rollout(run: RunLayout, iteration: int, prompts_uri: str, corpus_uri: str, policy_dir: str,
            cfg: RolloutConfig, seed: int, resume: bool = True) -> str:
    log = stage_logger("rollout")
    record = StageRecord(run.manifest_path("rollout", iteration), "rollout",
                         inputs={"prompts": prompts_uri, "corpus": corpus_uri, "policy": policy_dir},
                         params={"rollout": cfg, "seed": seed, "iteration": iteration})
    if (done := completed_outputs(record, resume, f"iteration {iteration} rollout")) is not None:
        return done["steps"]
    started = time.perf_counter()
    # Bad input (an unknown env or tool, a checkpoint without weights) fails here, naming the file,
    # before an engine starts or anything is written.
    prompts = prompts_from_table("prompts", read_table("prompts", prompts_uri), prompts_uri,
                                 env_of=lambda prompt: _env_of(prompt, cfg))
    check_checkpoint(Path(policy_dir))
    documents = read_corpus(corpus_uri)
    tokenizer = load_tokenizer(Path(policy_dir))
    engine = ENGINES.get(cfg.engine)(Path(policy_dir), engine_options(cfg))
    try:
        records = roll_out(engine, tokenizer, prompts, documents, cfg, seed=seed * 100_003 + iteration,
                           policy_version=iteration, episode_prefix=f"{run.run_id}-i{iteration}-")
    finally:
        close_engine(engine)
    rows = rows_of(records, run_id=run.run_id, iteration=iteration)  # shallow: asdict deep-copies every token list
    uri = write_table("steps", rows, run.table_uri(iteration, "steps"))
    record.commit({"steps": uri}, metrics={"seconds": time.perf_counter() - started})
    episodes = len(prompts) * cfg.group_size
    log.info("iteration %d: %d episodes, %d steps, %d generated tokens", iteration, episodes, len(records),
             sum(len(r.response_ids) for r in records))
    return uri
