"""Evaluation methods by name: a policy answers prompts, each answer is scored by the run's scorer
(`settings.scorer`, a name in agent_core/rewards/scorers.py SCORERS; its EM and F1 go to the table).

Every method is `(policy_dir, prompts, documents, settings) -> list[EvalEpisode]`, in `EVAL_METHODS`:
`naive_rag` (retrieve once, answer once, as the paper's RAG baseline), `base_tool_call`, `agent`. Unlike the
training rollout (`RolloutSpec`): one episode per prompt (no groups), greedy decoding is temperature 0.
Design notes: docs/architecture.md §11 (agent_core/eval/methods.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent_core.config import RolloutConfig, VLLMConfig
from agent_core.data.naive_rag import naive_rag_messages, question_text
from agent_core.drivers import DataAccess, roll_out
from agent_core.envs.search import Bm25Index
from agent_core.registry import Registry
from agent_core.rewards.scorers import SCORERS
from agent_core.progress import report
from agent_core.rollout.chat import encode_conversation, eos_token_ids
from agent_core.rollout.engine import Engine, SamplingParams
from agent_core.rollout.records import StepRecord
from agent_core.rollout.spec import RolloutSpec
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
    rollout: the run's rollout section (tasks/evaluate.py `run_eval_settings`): the agent methods then
    run its envs with its context policy and top_p (`spec`), and tool_format / instructions here are
    unused; the budgets are always this object's fields (run_eval_settings copies training's). None:
    the search_qa env with top_k, tool_format and instructions (a standalone eval).
    scorer: the outcome scorer (SCORERS) whose EM and F1 the table records; a run's reward.scorer.
    access: what an env's own program may read of the data root (the dataset's corpus; agent_program).
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
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    device: str = "auto"
    rollout: RolloutConfig | None = None
    scorer: str = "qa_em"
    access: DataAccess = DataAccess()

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"sampled evaluation needs temperature > 0, got {self.temperature} (or set greedy=True)")
        for name in ("max_new_tokens", "max_steps", "max_context_tokens", "top_k", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalSettings.{name} must be >= 1, got {getattr(self, name)}")
        SCORERS.check(self.scorer)

    def rollout_config(self) -> RolloutConfig:
        """The rollout section the agent methods run with: the run's, with this object's budgets."""
        budgets = {"max_new_tokens": self.max_new_tokens, "max_steps": self.max_steps,
                   "max_context_tokens": self.max_context_tokens, "engine": self.engine,
                   "max_batch_size": self.max_batch_size, "vllm": self.vllm}
        if self.rollout is not None:
            return self.rollout.model_copy(update=budgets)
        kwargs = {"top_k": self.top_k, "tool_format": self.tool_format, "instructions": self.instructions}
        return RolloutConfig(env="search_qa", env_kwargs=kwargs, **budgets)

    def spec(self) -> RolloutSpec:
        """The loop and sampling settings: training's (RolloutSpec.from_config) made eval's (for_eval)."""
        return RolloutSpec.from_config(self.rollout_config()).for_eval(greedy=self.greedy, temperature=self.temperature)

    def sampling(self, tokenizer) -> SamplingParams:
        return self.spec().sampling(self.seed, eos_token_ids(tokenizer))


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


EvalMethod = Callable[..., list[EvalEpisode]]  # (policy_dir, prompts, documents, settings) (module docstring)
EVAL_METHODS: Registry[EvalMethod] = Registry("eval method")


def answer_of(text: str) -> str | None:
    """The content of the first closed <answer> block, stripped; None if there is none."""
    found = _ANSWER.search(text)
    return None if found is None else found.group(1).strip()


def _scored(prompt: Prompt, answer: str | None, scorer: str, prediction: str | None = None, **fields) -> EvalEpisode:
    """`answer` (None: no well-formed answer) scored by `scorer`; `prediction` is what the table shows
    (default the answer, "" for none). The EM and F1 are the scorer's (its format bonus is not reported)."""
    score = SCORERS.get(scorer)(answer, prompt.answers, format_weight=0.0)
    shown = (answer or "") if prediction is None else prediction
    return EvalEpisode(prompt_id=prompt.prompt_id, data_source=prompt.data_source, prediction=shown,
                       em=score.em, f1=score.f1, **fields)


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
        prediction = text.strip() if answer is None else answer  # the raw text still gets credit (docstring)
        episodes.append(_scored(
            prompt, prediction, settings.scorer, format_ok=answer is not None, steps=1,
            tool_calls=0, termination="answered" if answer is not None else None,
        ))
    return episodes


def tool_agent_episodes(engine: Engine, tokenizer, prompts: Sequence[Prompt], documents: Sequence[Document],
                        settings: EvalSettings) -> list[EvalEpisode]:
    """One episode per prompt in the run's envs, each through its env's driver, with the run's loop
    settings (`settings.spec()`); scored on its final answer."""
    records = roll_out(engine, tokenizer, list(prompts), list(documents), settings.rollout_config(), seed=settings.seed,
                       policy_version=0, episode_prefix="eval-", spec=settings.spec(), access=settings.access)
    return agent_episodes(prompts, records, settings.scorer)


def agent_episodes(prompts: Sequence[Prompt], records: Sequence[StepRecord], scorer: str) -> list[EvalEpisode]:
    """The eval episode of each prompt from its episode's steps (one episode per prompt)."""
    by_prompt: dict[str, list[StepRecord]] = {}
    for record in records:
        by_prompt.setdefault(record.prompt_id, []).append(record)
    missing = [p.prompt_id for p in prompts if p.prompt_id not in by_prompt]
    if missing:
        raise ValueError(f"the rollout returned no steps for prompts {', '.join(missing[:5])}; "
                         "every prompt needs one episode (a rollout driver bug)")
    return [_agent_episode(prompt, by_prompt[prompt.prompt_id], scorer) for prompt in prompts]


def _agent_episode(prompt: Prompt, steps: list[StepRecord], scorer: str) -> EvalEpisode:
    steps = sorted(steps, key=lambda step: step.step_idx)
    last = steps[-1]
    answer = json.loads(last.info).get("answer") if last.termination == "answered" else None
    answer = answer if isinstance(answer, str) else None
    return _scored(
        prompt, answer, scorer,
        format_ok=answer is not None and all(step.parse_error is None for step in steps),
        steps=len(steps), tool_calls=sum(len(json.loads(step.tool_calls)) for step in steps),
        termination=last.termination,
    )


def _with_policy(episodes_fn) -> EvalMethod:
    """A registered method: load the engine and tokenizer of `policy_dir`, run, close the engine."""

    def method(policy_dir: Path, prompts: Sequence[Prompt], documents: Sequence[Document],
               settings: EvalSettings) -> list[EvalEpisode]:
        from agent_core.io.checkpoints import load_tokenizer
        from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine

        rollout = settings.rollout_config()
        tokenizer = load_tokenizer(Path(policy_dir))
        engine = ENGINES.get(rollout.engine)(Path(policy_dir), EngineOptions.from_rollout(rollout, settings.device))
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
