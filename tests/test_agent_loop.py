"""The agent loop: token-in/token-out contexts, budgets, terminations, and a real HF engine run."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Sequence

import pytest

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.base import EnvStep
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.tables import write_table
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.context import TRUNCATION_MARKER, ContextPolicy
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
        self.batch_sizes: list[int] = []
        self.turn = 0

    def generate(self, prompts, params):
        text = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.end_with_eos:
            ids = ids + [self.tokenizer.eos_token_id]
        self.received.extend(list(p) for p in prompts)
        self.batch_sizes.append(len(prompts))
        reason = "stop" if self.end_with_eos else "length"
        return [Generation(list(ids), [-1.0] * len(ids), reason) for _ in prompts]


def _run(task, engine, *, group_size=2, max_steps=4, max_context=2048, max_new_tokens=16, prompts=2,
         context=ContextPolicy(), make=None):
    dataset, tokenizer, resources = task
    settings = LoopSettings(group_size=group_size, max_steps=max_steps, max_context_tokens=max_context,
                            policy_version=0, episode_prefix="t-", context=context)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=eos_token_ids(tokenizer))
    make = make or (lambda p: make_env(p.env_name, p.env_kwargs, resources))
    return run_episodes(engine, tokenizer, dataset.prompts[:prompts], make, sampling, settings)


def _episodes(steps) -> dict[str, list]:
    by_episode: dict[str, list] = {}
    for step in steps:
        by_episode.setdefault(step.episode_id, []).append(step)
    return by_episode


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


SEARCH_FOREVER = ["<search>Quill</search>", "<search>Paris</search>", "<search>film</search>", "<search>born</search>"]


@pytest.mark.parametrize("context", [ContextPolicy(), ContextPolicy("last_k", keep_last_turns=1),
                                     ContextPolicy("last_k", keep_last_turns=2), ContextPolicy(max_observation_tokens=5)])
def test_every_context_mode_records_exactly_what_the_engine_received(task, context):
    engine = ScriptedEngine(task[1], SEARCH_FOREVER)
    steps = _run(task, engine, context=context, max_steps=4)
    assert sorted(map(tuple, engine.received)) == sorted(tuple(s.prompt_ids) for s in steps)
    assert len(steps) == 2 * 2 * 4


def test_last_k_keeps_the_head_and_the_last_turns_and_reports_prefix_sharing(task):
    tokenizer = task[1]
    full = _episodes(_run(task, ScriptedEngine(tokenizer, SEARCH_FOREVER), max_steps=4, prompts=1))
    window = _episodes(_run(task, ScriptedEngine(tokenizer, SEARCH_FOREVER), max_steps=4, prompts=1,
                            context=ContextPolicy("last_k", keep_last_turns=1)))
    for episode_id, steps in window.items():
        appended = full[episode_id]
        head = appended[0].prompt_ids
        turns = [appended[k + 1].prompt_ids[len(appended[k].prompt_ids):] for k in range(3)]
        for k, step in enumerate(steps):
            expected = head if k == 0 else head + turns[k - 1]
            assert step.prompt_ids == expected, (episode_id, k)
        # step 0 -> 1 only appends; from then on the oldest turn is dropped
        assert [s.prefix_shared for s in steps] == [True, False, False, False]
        assert [s.prefix_shared for s in appended] == [True, True, True, False]


def test_observation_cut_is_marked_and_bounded(task):
    tokenizer = task[1]
    steps = _run(task, ScriptedEngine(tokenizer, SEARCH_FOREVER), max_steps=2, prompts=1,
                 context=ContextPolicy(max_observation_tokens=6))
    cut = [s for s in steps if not s.done]
    assert cut and all(s.observation_text.endswith(TRUNCATION_MARKER) for s in cut)
    marker = len(tokenizer.encode(TRUNCATION_MARKER, add_special_tokens=False))
    for s in cut:
        assert len(tokenizer.encode(s.observation_text, add_special_tokens=False)) <= 6 + marker + 1
        assert json.loads(s.info)["observation_tokens_cut"] > 0


def test_budget_endings_are_truncations_and_answers_are_not(task):
    budget = _run(task, ScriptedEngine(task[1], SEARCH_FOREVER), max_steps=2)
    answered = _run(task, ScriptedEngine(task[1], ["<answer>x</answer>"]))
    assert all(s.truncated == s.done for s in budget)
    assert {s.termination for s in budget if s.done} == {"max_steps"}
    assert not any(s.truncated for s in answered)


class _BrokenEnv:
    observation_role = "user"

    def __init__(self, prompt, fail_on: str):
        self.prompt, self.fail_on = prompt, fail_on

    def reset(self, prompt):
        return prompt.messages

    def step(self, action_text):
        if self.fail_on in self.prompt.prompt_id:
            raise RuntimeError("env bug")
        return EnvStep(observation="", reward=0.0, done=True, termination="answered")


def test_an_env_that_raises_ends_only_its_episode_with_error(task):
    dataset = task[0]
    bad = dataset.prompts[0].prompt_id
    steps = _run(task, ScriptedEngine(task[1], ["<answer>x</answer>"]), make=lambda p: _BrokenEnv(p, bad))
    by_prompt = {s.prompt_id: s for s in steps}
    assert by_prompt[bad].termination == "error" and not by_prompt[bad].truncated
    assert "RuntimeError: env bug" in json.loads(by_prompt[bad].info)["error"]
    assert by_prompt[dataset.prompts[1].prompt_id].termination == "answered"


class _SlowEnv(_BrokenEnv):
    def step(self, action_text):
        if self.fail_on in self.prompt.prompt_id:
            time.sleep(0.6)
        return EnvStep(observation="<information>x</information>", reward=0.0, done=False)


def test_a_slow_env_does_not_hold_up_the_other_episodes(task):
    dataset, tokenizer, _ = task
    slow = dataset.prompts[0].prompt_id
    engine = ScriptedEngine(tokenizer, ["<search>a</search>"])
    settings = LoopSettings(group_size=1, max_steps=3, max_context_tokens=2048, policy_version=0,
                            straggler_wait_s=0.05)
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=eos_token_ids(tokenizer))
    steps = run_episodes(engine, tokenizer, dataset.prompts[:2], lambda p: _SlowEnv(p, slow), sampling, settings)
    # the fast episode's later turns went to the engine in calls of their own, without the slow one
    sizes = engine.batch_sizes
    assert sizes[0] == 2 and 1 in sizes[1:]
    assert len(steps) == 6 and {s.termination for s in steps if s.done} == {"max_steps"}


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
