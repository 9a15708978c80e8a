"""Stage 0: the policy the first iteration rolls out with."""

from __future__ import annotations

import json
from pathlib import Path

from agent_core.config import PolicyConfig
from agent_core.data.rows import row_to_document, row_to_prompt
from agent_core.types import Document
from agent_core.envs.formats import FORMATS, ParsedCall
from agent_core.envs.registry import EnvResources, env_kwarg_names, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.checkpoints import load_policy, policy_source_dir, save_critic, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import read_table
from agent_core.training.critic import build_critic
from agent_core.training.model import build_tiny_policy, build_tokenizer, count_parameters
from agent_core.training.pretrain import induction_pretrain
from tasks._common import DatasetUris, completed_outputs, stage_logger, stage_task

_FIXED_TEXT_WEIGHT = 32  # copies of the tool instructions among the tokenizer's training texts


def _fixed_texts(prompt_row: dict, corpus_rows: list[dict]) -> list[str]:
    """Text every episode repeats that is not in the data: the system prompts the dataset's env writes
    in every tool-call format it supports (the tool syntax), the chat template's role names, and what
    a search result looks like (the env's own rendering of one), so the tokenizer learns them too."""
    prompt = row_to_prompt(prompt_row)
    resources = EnvResources(search_index=Bm25Index([row_to_document(row) for row in corpus_rows]))
    texts = ["system\n", "user\n", "assistant\n", "tool\n"]
    if "tool_format" not in env_kwarg_names(prompt.env_name):
        return texts + [m.content for m in make_env(prompt.env_name, prompt.env_kwargs, resources).reset(prompt)]
    layout = EnvResources(search_index=Bm25Index([Document(f"d{i}", "xx", "xx") for i in range(3)]))
    for name in FORMATS.names():
        env = make_env(prompt.env_name, {**prompt.env_kwargs, "tool_format": name}, resources)
        texts += [m.content for m in env.reset(prompt) if m.role == "system"]
        if "search" in env.tools:  # the layout of a search result ("Doc 1 (title): text"), on placeholder docs
            dummy = make_env(prompt.env_name, {**prompt.env_kwargs, "tool_format": name}, layout)
            texts.append(dummy.step(dummy.format.format_calls([ParsedCall("search", {"query": "xx"})])).observation)
    return texts


@stage_task(name="init_policy")
def init_policy(run: RunLayout, dataset: DatasetUris, policy: PolicyConfig, resume: bool = True) -> str:
    """Build (tiny) or copy (path, smollm2) the initial policy into the run; return its directory."""
    log = stage_logger("init_policy")
    target = run.initial_policy_dir
    source = policy_source_dir(policy.source, policy.path)
    inputs = {"dataset_prompts": dataset.prompts_uri, "corpus": dataset.corpus_uri} if source is None else {"source": source}
    # policy.lora leaves the initial policy as it is (adapters start at the train stage): not compared
    record = StageRecord(run.manifest_path("init_policy"), "init_policy", inputs=inputs,
                         params={"policy": policy.model_dump(mode="json", exclude={"lora"})})
    if (done := completed_outputs(record, resume, "initial policy")) is not None:
        return done["policy"]
    if policy.source == "tiny":
        corpus_rows = read_table("corpus", dataset.corpus_uri).to_pylist()
        prompt_rows = read_table("dataset_prompts", dataset.prompts_uri).to_pylist()
        texts = [row["text"] for row in corpus_rows]
        # unique message texts: the shared system prompt would otherwise dominate the BPE merges ...
        texts += sorted({m["content"] for row in prompt_rows for m in json.loads(row["messages"])})
        # ... but the env's fixed text is in every episode's context, so it weighs as much as the
        # corpus: compressed to a few tokens it makes every training sequence shorter.
        texts += _fixed_texts(prompt_rows[0], corpus_rows) * _FIXED_TEXT_WEIGHT
        tokenizer = build_tokenizer(texts, vocab_size=policy.vocab_size)
        model = build_tiny_policy(
            tokenizer, hidden_size=policy.hidden_size, num_layers=policy.num_layers, num_heads=policy.num_heads,
            intermediate_size=policy.intermediate_size, seed=policy.seed,
        )
        if policy.pretrain_steps:
            _pretrain(model, tokenizer, policy, log)
    else:
        if policy.source == "smollm2" and not source.exists():
            raise FileNotFoundError(f"SmolLM2 checkpoint not found at {source}: run `make smollm2` first")
        model, tokenizer = load_policy(source)
    record.commit({"policy": save_policy(model, tokenizer, target)})
    log.info("initial policy (%s, %.2fM parameters, vocab %d) at %s",
             policy.source, count_parameters(model) / 1e6, len(tokenizer), target)
    return str(target)


def _pretrain(model, tokenizer, policy: PolicyConfig, log) -> None:
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    result = induction_pretrain(model, ordinary, tokenizer.eos_token_id, steps=policy.pretrain_steps,
                                lr=policy.pretrain_lr, seed=policy.seed, log=log, log_every=200)
    log.info("induction pretraining: %d steps in %.0fs, copy accuracy %.2f (loss %.3f) over the last tenth",
             result.steps, result.seconds, result.final_accuracy, result.final_loss)


@stage_task(name="init_critic")
def init_critic(run: RunLayout, policy_dir: str) -> str:
    """The critic before iteration 0 (estimators with values): the initial policy's backbone and a
    fresh value head. Kept while the policy it came from is unchanged, so a resumed run does not reset it."""
    target = run.initial_critic_dir
    record = StageRecord(run.manifest_path("init_critic"), "init_critic", inputs={"policy": policy_dir}, params={})
    if completed_outputs(record, True, "initial critic") is None:
        record.commit({"critic": save_critic(build_critic(Path(policy_dir)), target)})
    stage_logger("init_critic").info("initial critic at %s", target)
    return str(target)
