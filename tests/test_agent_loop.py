"""The agent loop: token-in/token-out contexts, budgets, terminations, and a real HF engine run."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import pytest

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.tables import write_table
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy, build_tokenizer


@pytest.fixture(scope="module")
def task():
    dataset = generate_synthetic_qa(seed=3, num_films=12, num_people=10, num_cities=5, num_countries=3)
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    tokenizer = build_tokenizer(texts, vocab_size=400)
    resources = EnvResources(search_index=Bm25Index(dataset.documents))
    return dataset, tokenizer, resources


class ScriptedEngine:
    """Answers request n of every episode with script[n]; records every prompt it received."""

    def __init__(self, tokenizer, script: Sequence[str], end_with_eos: bool = True):
        self.tokenizer, self.script, self.end_with_eos = tokenizer, script, end_with_eos
        self.received: list[list[int]] = []
        self.turn = 0

    def generate(self, prompts, params):
        text = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.end_with_eos:
            ids = ids + [self.tokenizer.eos_token_id]
        self.received.extend(list(p) for p in prompts)
        reason = "stop" if self.end_with_eos else "length"
        return [Generation(list(ids), [-1.0] * len(ids), reason) for _ in prompts]


def _run(task, engine, *, group_size=2, max_steps=4, max_context=2048, max_new_tokens=16, prompts=2):
    dataset, tokenizer, resources = task
    settings = LoopSettings(group_size=group_size, max_steps=max_steps, max_context_tokens=max_context,
                            policy_version=0, episode_prefix="t-")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=eos_token_ids(tokenizer))
    return run_episodes(engine, tokenizer, dataset.prompts[:prompts],
                        lambda p: make_env(p.env_name, p.env_kwargs, resources), sampling, settings)


def test_recorded_contexts_are_exactly_what_the_engine_received(task):
    engine = ScriptedEngine(task[1], ["<search>Quill</search>", "<search>x</search>", "<answer>Paris</answer>"])
    steps = _run(task, engine)
    assert sorted(map(tuple, engine.received)) == sorted(tuple(s.prompt_ids) for s in steps)
    assert len(steps) == 2 * 2 * 3
    finals = [s for s in steps if s.done]
    assert len(finals) == 4 and {s.termination for s in finals} == {"answered"}


def test_prefix_shared_means_next_context_extends_this_one(task):
    engine = ScriptedEngine(task[1], ["<search>Quill</search>", "<answer>Paris</answer>"])
    steps = _run(task, engine)
    by_episode: dict[str, list] = {}
    for step in steps:
        by_episode.setdefault(step.episode_id, []).append(step)
    for episode in by_episode.values():
        first, second = episode
        assert first.prefix_shared and not second.prefix_shared
        head = first.prompt_ids + first.response_ids
        assert second.prompt_ids[: len(head)] == head
        observation = task[1].decode(second.prompt_ids[len(head):])
        assert "<information>" in observation and "</information>" in observation


def test_step_budget_ends_episodes_with_max_steps(task):
    steps = _run(task, ScriptedEngine(task[1], ["<search>Quill</search>"]), max_steps=3)
    finals = [s for s in steps if s.done]
    assert {s.termination for s in finals} == {"max_steps"}
    assert {s.step_idx for s in finals} == {2}


def test_context_budget_ends_episodes_with_max_context(task):
    opening = len(_run(task, ScriptedEngine(task[1], ["<answer>a</answer>"]), prompts=1)[0].prompt_ids)
    steps = _run(task, ScriptedEngine(task[1], ["<search>Quill</search>"]), max_context=opening + 40, prompts=1)
    finals = [s for s in steps if s.done]
    assert {s.termination for s in finals} == {"max_context"}
    assert all(len(s.prompt_ids) + 16 <= opening + 40 for s in steps)


def test_invalid_action_is_recorded_and_the_episode_goes_on(task):
    steps = _run(task, ScriptedEngine(task[1], ["I do not know the format", "<answer>x</answer>"]))
    first = [s for s in steps if s.step_idx == 0]
    assert all(s.parse_error for s in first) and not any(s.done for s in first)
    assert all(s.termination == "answered" for s in steps if s.done)


def test_truncated_action_gets_the_end_of_turn_it_did_not_produce(task):
    tokenizer = task[1]
    steps = _run(task, ScriptedEngine(tokenizer, ["<search>Quill</search>"], end_with_eos=False), max_steps=2)
    first, second = [s for s in steps if s.episode_id == steps[0].episode_id]
    assert first.finish_reason == "length"
    cut = len(first.prompt_ids) + len(first.response_ids)
    assert second.prompt_ids[cut] == tokenizer.eos_token_id


def test_prompt_over_budget_fails_clearly(task):
    with pytest.raises(ValueError, match="exceeds max_context_tokens"):
        _run(task, ScriptedEngine(task[1], ["<answer>a</answer>"]), max_context=20)


def test_real_hf_engine_rollout_produces_a_valid_steps_table(task, tmp_path):
    tokenizer = task[1]
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    engine = HFEngine(model, tokenizer)
    steps = _run(task, engine, group_size=3, max_steps=2, max_new_tokens=8)
    assert {s.finish_reason for s in steps} <= {"stop", "length"}
    rows = [{"run_id": "r", "iteration": 0, **dataclasses.asdict(s)} for s in steps]
    table = write_table("steps", rows, str(tmp_path / "steps.parquet"))
    assert table.endswith("steps.parquet")
    episodes = {s.episode_id for s in steps}
    assert len(episodes) == 2 * 3
    assert sum(s.done for s in steps) == len(episodes)
