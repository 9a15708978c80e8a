"""Evaluation methods by name: a policy answers prompts, each answer is scored with EM and F1.

Every method has one signature, `(policy_dir, prompts, documents, settings) -> list[EvalEpisode]`,
and is registered in `EVAL_METHODS`:

- `naive_rag`: retrieve once, answer once. BM25 top-k over the corpus for the question text, the
  passages and the question in ONE user turn (the dataset's system message is kept; its tool
  instructions are not added, since no tool can be called), ONE generation. The prediction is the
  `<answer>` content if there is one, else the whole generation, stripped (a model that ignores
  the instruction still gets credit for a right answer, as in the paper's RAG baseline).
- `base_tool_call` and `agent`: the real agent loop (`run_episodes`) in the `search_qa` env. They
  run the same code: the caller passes the untrained policy for the first and a trained
  checkpoint for the second; both names exist so the eval table says which is which. The
  prediction is the answer of an episode that ended "answered", "" otherwise.

Where this differs from the training rollout: one episode per prompt (no groups), the env is always
`search_qa` with `settings.top_k` / `settings.tool_format` (a prompt's own env kwargs are ignored,
so every method sees the same retrieval), and greedy decoding is temperature 0.

The `*_episodes` functions take an engine and a tokenizer, so any Engine (a scripted double in
tests, vLLM) can be evaluated; the registered methods load both from `policy_dir`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent_core.data.naive_rag import naive_rag_messages, question_text
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.envs.tool_env import ChatCapabilities
from agent_core.registry import Registry
from agent_core.rewards.qa import exact_match, f1_score
from agent_core.progress import report
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import (
    encode_conversation,
    eos_token_ids,
    template_supports_tool_role,
    template_supports_tools,
)
from agent_core.rollout.engine import Engine, SamplingParams
from agent_core.rollout.records import StepRecord
from agent_core.rollout.vllm_server import VLLMOptions
from agent_core.types import Document, Prompt

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class EvalSettings:
    """How every method of one evaluation generates (plain values, so Prefect can log them).

    greedy: temperature 0 (then `temperature` is unused); otherwise sample at `temperature` with
    `seed`. top_k: passages per retrieval (naive_rag's one retrieval, and each search call).
    tool_format: the search_qa env's tool-call format. instructions: whether the env adds its tool
    instructions to the system message (as in training). engine: a name in the ENGINES registry.
    device: where an in-process (hf) engine's model lives: a `device` setting (agent_core/devices.py).
    """

    seed: int = 0
    greedy: bool = True
    temperature: float = 1.0
    max_new_tokens: int = 48
    max_steps: int = 4
    max_context_tokens: int = 1024
    top_k: int = 3
    tool_format: str = "tag"
    instructions: bool = True
    engine: str = "hf"
    max_batch_size: int = 64
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    device: str = "auto"

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"sampled evaluation needs temperature > 0, got {self.temperature} (or set greedy=True)")
        for name in ("max_new_tokens", "max_steps", "max_context_tokens", "top_k", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalSettings.{name} must be >= 1, got {getattr(self, name)}")

    def sampling(self, tokenizer) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=0.0 if self.greedy else self.temperature,
            seed=self.seed, stop_token_ids=eos_token_ids(tokenizer),
        )


@dataclass(frozen=True)
class EvalEpisode:
    """One prompt answered by one method: a row of the `eval` table without the run-level columns.

    format_ok: the episode ended with a well-formed <answer> and no action was unreadable.
    termination: how it ended (answered, max_steps, max_context, error); None for a naive_rag
    generation without an <answer>.
    """

    prompt_id: str
    data_source: str
    prediction: str
    em: float
    f1: float
    format_ok: bool
    steps: int
    tool_calls: int
    termination: str | None


EvalMethod = Callable[[Path, Sequence[Prompt], Sequence[Document], EvalSettings], list[EvalEpisode]]
EVAL_METHODS: Registry[EvalMethod] = Registry("eval method")


def answer_of(text: str) -> str | None:
    """The content of the first closed <answer> block, stripped; None if there is none."""
    found = _ANSWER.search(text)
    return None if found is None else found.group(1).strip()


def _scored(prompt: Prompt, prediction: str, **fields) -> EvalEpisode:
    return EvalEpisode(prompt_id=prompt.prompt_id, data_source=prompt.data_source, prediction=prediction,
                       em=exact_match(prediction, prompt.answers), f1=f1_score(prediction, prompt.answers), **fields)


def naive_rag_episodes(engine: Engine, tokenizer, prompts: Sequence[Prompt], documents: Sequence[Document],
                       settings: EvalSettings) -> list[EvalEpisode]:
    """Retrieve top-k passages per question, then one batched generation for all prompts."""
    index = Bm25Index(documents)
    contexts = []
    for prompt in prompts:
        messages = naive_rag_messages(prompt, index.search(question_text(prompt), settings.top_k))
        ids = encode_conversation(tokenizer, messages)
        if len(ids) + settings.max_new_tokens > settings.max_context_tokens:
            raise ValueError(
                f"naive_rag prompt {prompt.prompt_id!r} is {len(ids)} tokens; with max_new_tokens="
                f"{settings.max_new_tokens} it exceeds max_context_tokens={settings.max_context_tokens} (lower top_k)"
            )
        contexts.append(ids)
    generations = engine.generate(contexts, settings.sampling(tokenizer))
    report(len(prompts), total=len(prompts))
    episodes = []
    for prompt, generation in zip(prompts, generations):
        text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        answer = answer_of(text)
        episodes.append(_scored(
            prompt, text.strip() if answer is None else answer, format_ok=answer is not None, steps=1,
            tool_calls=0, termination="answered" if answer is not None else None,
        ))
    return episodes


def tool_agent_episodes(engine: Engine, tokenizer, prompts: Sequence[Prompt], documents: Sequence[Document],
                        settings: EvalSettings) -> list[EvalEpisode]:
    """One agent-loop episode per prompt in the search_qa env; scored on its final answer."""
    chat = ChatCapabilities(template_supports_tools(tokenizer), template_supports_tool_role(tokenizer))
    resources = EnvResources(search_index=Bm25Index(documents), chat=chat)
    env_kwargs = {"top_k": settings.top_k, "tool_format": settings.tool_format, "instructions": settings.instructions}
    loop = LoopSettings(group_size=1, max_steps=settings.max_steps, max_context_tokens=settings.max_context_tokens,
                        policy_version=0, episode_prefix="eval-")
    records = run_episodes(engine, tokenizer, prompts, lambda _: make_env("search_qa", env_kwargs, resources),
                           settings.sampling(tokenizer), loop)
    by_prompt: dict[str, list[StepRecord]] = {}
    for record in records:
        by_prompt.setdefault(record.prompt_id, []).append(record)
    return [_agent_episode(prompt, by_prompt[prompt.prompt_id]) for prompt in prompts]


def _agent_episode(prompt: Prompt, steps: list[StepRecord]) -> EvalEpisode:
    last = steps[-1]
    answer = json.loads(last.info).get("answer") if last.termination == "answered" else None
    prediction = answer if isinstance(answer, str) else ""
    return _scored(
        prompt, prediction,
        format_ok=isinstance(answer, str) and all(step.parse_error is None for step in steps),
        steps=len(steps), tool_calls=sum(len(json.loads(step.tool_calls)) for step in steps),
        termination=last.termination,
    )


def _with_policy(episodes_fn) -> EvalMethod:
    """A registered method: load the engine and tokenizer of `policy_dir`, run, close the engine."""

    def method(policy_dir: Path, prompts: Sequence[Prompt], documents: Sequence[Document],
               settings: EvalSettings) -> list[EvalEpisode]:
        from agent_core.io.checkpoints import load_tokenizer
        from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine

        factory = ENGINES.get(settings.engine)
        tokenizer = load_tokenizer(Path(policy_dir))
        options = EngineOptions(max_batch_size=settings.max_batch_size, max_model_len=settings.max_context_tokens,
                                vllm=settings.vllm, device=settings.device)
        engine = factory(Path(policy_dir), options)
        try:
            return episodes_fn(engine, tokenizer, list(prompts), list(documents), settings)
        finally:
            close_engine(engine)

    method.__doc__ = episodes_fn.__doc__
    return method


EVAL_METHODS.register("naive_rag")(_with_policy(naive_rag_episodes))
_tool_agent = _with_policy(tool_agent_episodes)
EVAL_METHODS.register("base_tool_call")(_tool_agent)
EVAL_METHODS.register("agent")(_tool_agent)
