"""The workload the benchmarks share: the built-in synthetic task, a tiny policy, synthetic episodes.

Everything is built in memory from a seed (no download, no data root), the way `init_policy`
builds the demo's policy: a byte-level BPE trained on the corpus, the questions and the env's
tool instructions, and a randomly initialised Llama. A random policy almost never answers, so
its episodes run to `max_steps` with full-length actions: a steady, predictable load (which is
what a throughput benchmark wants; learning is not measured here).
"""

from __future__ import annotations

import copy
import os
import random
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
import transformers

from agent_core.config import PolicyConfig, RolloutConfig
from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.checkpoints import save_policy
from agent_core.training.batches import TrainStep
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import Document, Prompt

# No per-file "Loading weights" / "Writing model shards" bars between the benchmarks' own lines.
transformers.utils.logging.disable_progress_bar()
huggingface_hub.utils.disable_progress_bars()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class PolicySize:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


_DEMO = PolicyConfig()  # the demo's policy is the PolicyConfig defaults (configs/demo.yaml)
POLICY_SIZES = {
    "demo": PolicySize(_DEMO.vocab_size, _DEMO.hidden_size, _DEMO.num_layers, _DEMO.num_heads,
                       _DEMO.intermediate_size),
    # head size 32: the smallest vLLM's CPU backend takes
    "quick": PolicySize(vocab_size=400, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
}
# configs/tiny.yaml's world: enough prompts for a smoke run, built in a fraction of a second
_SMALL_WORLD = dict(num_films=24, num_people=20, num_cities=8, num_countries=4)
_TOOL_TEXT_WEIGHT = 32  # as tasks/init_policy.py: the env's fixed text weighs as much as the corpus


@dataclass(frozen=True)
class Task:
    prompts: list[Prompt]  # training split
    documents: list[Document]


def synthetic_task(seed: int = 0, small: bool = False) -> Task:
    """The built-in synthetic multi-hop QA task (the demo's world, or tiny.yaml's when small)."""
    dataset = generate_synthetic_qa(seed=seed, **(_SMALL_WORLD if small else {}))
    return Task([p for p in dataset.prompts if p.split == "train"], list(dataset.documents))


def tiny_policy(task: Task, size: PolicySize, seed: int = 0):
    """(model, tokenizer): a from-scratch policy sized `size`, its BPE trained on the task's text."""
    texts = [d.text for d in task.documents]
    texts += sorted({m.content for p in task.prompts for m in p.messages})
    env = make_env(task.prompts[0].env_name, task.prompts[0].env_kwargs,
                   EnvResources(search_index=Bm25Index(task.documents)))
    texts += [m.content for m in env.reset(task.prompts[0]) if m.role == "system"] * _TOOL_TEXT_WEIGHT
    tokenizer = build_tokenizer(texts, vocab_size=size.vocab_size)
    model = build_tiny_policy(tokenizer, hidden_size=size.hidden_size, num_layers=size.num_layers,
                              num_heads=size.num_heads, intermediate_size=size.intermediate_size, seed=seed)
    return model, tokenizer


def save_policy_dir(model, tokenizer, directory: Path) -> Path:
    """The policy as a checkpoint directory (what engine factories load)."""
    return save_policy(model, tokenizer, directory)


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with the same weights (each benchmark arm trains its own)."""
    return copy.deepcopy(model)


def rollout_config(*, group_size: int, max_steps: int, max_new_tokens: int, engine: str = "hf",
                   max_context_tokens: int = 2048, max_batch_size: int = 64) -> RolloutConfig:
    """The demo's rollout settings with the benchmark's sizes (temperature 1, append contexts)."""
    return RolloutConfig(engine=engine, group_size=group_size, max_steps=max_steps, max_new_tokens=max_new_tokens,
                         max_context_tokens=max_context_tokens, max_batch_size=max_batch_size)


def append_only_episodes(count: int, *, steps: int, prompt_len: int, response_len: int, obs_len: int,
                         vocab_size: int, seed: int = 0) -> list[list[TrainStep]]:
    """`count` synthetic append-only episodes of exactly `steps` steps, as the trainer gets them.

    Step k's prompt = step k-1's prompt + response + observation. Response and observation lengths
    vary in [len/2, len] (real actions end early on a stop token, so micro-batches carry padding);
    token ids avoid the first 3 (special) ids; advantages are one +-1 per episode (GRPO-like).
    """
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab_size) for _ in range(n)]  # noqa: E731
    vary = lambda n: rng.randint(max(1, n // 2), max(1, n))  # noqa: E731
    episodes = []
    for _ in range(count):
        advantage = rng.choice((-1.0, 1.0))
        context, episode = tokens(vary(prompt_len)), []
        for k in range(steps):
            response = tokens(vary(response_len))
            episode.append(TrainStep(
                prompt_ids=list(context), response_ids=response,
                response_logprobs=[rng.uniform(-7.0, -5.0) for _ in response],
                advantages=[advantage] * len(response),
            ))
            if k + 1 < steps:
                context = context + response + tokens(vary(obs_len))
        episodes.append(episode)
    return episodes
