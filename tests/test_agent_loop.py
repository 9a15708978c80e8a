"""The agent loop: token-in/token-out contexts, budgets, terminations, and a real HF engine run."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from typing import Callable, Sequence

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
         context=ContextPolicy(), make=None, straggler_wait_s=2.0, seed=None, temperature=1.0):
    dataset, tokenizer, resources = task
    settings = LoopSettings(group_size=group_size, max_steps=max_steps, max_context_tokens=max_context,
                            policy_version=0, episode_prefix="t-", context=context, straggler_wait_s=straggler_wait_s)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=eos_token_ids(tokenizer), seed=seed,
                              temperature=temperature)
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


# --- scheduling: concurrent calls, tools during generation, batching, errors, reproducibility ---


class TimedEngine:
    """Answers every request with `action` after `sleep` s; thread-safe, records every call.

    max_concurrent_calls is what the loop may use; max_in_flight is how many calls actually overlapped.
    on_call(call_number) runs inside each call (to synchronise with a tool, or to raise).
    """

    def __init__(self, tokenizer, slots: int = 1, sleep: float = 0.0, action: str = "<search>a</search>",
                 on_call: Callable[[int], None] | None = None):
        self.max_concurrent_calls = slots
        self.sleep, self.on_call = sleep, on_call
        self.ids = tokenizer.encode(action, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.lock = threading.Lock()
        self.started = self.in_flight = self.max_in_flight = 0
        self.calls: list[tuple[float, float, int, int | None]] = []  # (start, end, batch size, seed)

    def generate(self, prompts, params):
        with self.lock:
            number, self.started = self.started, self.started + 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start = time.perf_counter()
        try:
            time.sleep(self.sleep)
            if self.on_call is not None:
                self.on_call(number)
        finally:
            with self.lock:
                self.in_flight -= 1
        with self.lock:
            self.calls.append((start, time.perf_counter(), len(prompts), params.seed))
        return [Generation(list(self.ids), [-1.0] * len(self.ids), "stop") for _ in prompts]


class _ToolEnv:
    """Never ends on its own (the step budget ends it); each step runs tool(prompt_id, step number)."""

    observation_role = "user"

    def __init__(self, prompt, tool: Callable[[str, int], None]):
        self.prompt, self.tool, self.steps = prompt, tool, 0

    def reset(self, prompt):
        return prompt.messages

    def step(self, action_text):
        self.tool(self.prompt.prompt_id, self.steps)
        self.steps += 1
        return EnvStep(observation="<information>x</information>", reward=0.0, done=False)


def _run_tools(task, engine, tool, *, prompts=4, max_steps=3, straggler_wait_s=2.0, seed=None):
    return _run(task, engine, group_size=1, prompts=prompts, max_steps=max_steps, straggler_wait_s=straggler_wait_s,
                seed=seed, make=lambda p: _ToolEnv(p, tool))


def test_a_concurrent_engine_runs_fast_episodes_to_the_end_while_a_slow_tool_runs(task):
    prompt_ids = [p.prompt_id for p in task[0].prompts[:4]]
    slow, max_steps = prompt_ids[0], 3
    fast_steps = {pid: 0 for pid in prompt_ids[1:]}
    lock, fast_all_done, slow_saw_them = threading.Lock(), threading.Event(), []

    def tool(prompt_id, step):
        if prompt_id == slow:
            if step == 0:  # returns once the fast episodes are done (or after 1.5 s if they wait for it)
                slow_saw_them.append(fast_all_done.wait(timeout=1.5))
            return
        with lock:
            fast_steps[prompt_id] += 1
            if all(n == max_steps for n in fast_steps.values()):
                fast_all_done.set()

    engine = TimedEngine(task[1], slots=4, sleep=0.01)
    # a large straggler wait: only the engine's concurrency lets the fast episodes go on
    steps = _run_tools(task, engine, tool, max_steps=max_steps, straggler_wait_s=60.0)
    # every fast episode had its last action generated and its last tool run while the slow tool was still running
    assert slow_saw_them == [True]
    assert len(steps) == 4 * max_steps and {s.termination for s in steps if s.done} == {"max_steps"}
    assert 1 <= engine.max_in_flight <= 4


def test_a_serial_engine_generates_while_tools_run(task):
    prompt_ids = [p.prompt_id for p in task[0].prompts[:2]]
    generating, tool_saw_generation = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def on_call(number):
        if number == 1:  # the fast episode's second action, while the slow episode's first tool runs
            generating.set()
            seen["engine"] = tool_saw_generation.wait(timeout=1.0)

    def tool(prompt_id, step):
        if prompt_id == prompt_ids[0] and step == 0:
            started = time.perf_counter()
            seen["tool"] = generating.wait(timeout=1.0)
            tool_saw_generation.set()
            seen["tool_interval"] = (started, time.perf_counter())

    engine = TimedEngine(task[1], slots=1, on_call=on_call)
    steps = _run_tools(task, engine, tool, prompts=2, max_steps=2, straggler_wait_s=0.05)
    assert seen["tool"] is True and seen["engine"] is True
    tool_start, tool_end = seen["tool_interval"]
    call_start, call_end, size, _ = sorted(engine.calls)[1]
    assert size == 1 and call_start < tool_end and tool_start < call_end  # the two intervals overlap
    assert engine.max_in_flight == 1  # a serial engine never gets two calls at once
    assert len(steps) == 2 * 2


def test_a_serial_engine_with_fast_tools_gets_every_ready_episode_in_one_call(task):
    prompt_ids = [p.prompt_id for p in task[0].prompts[:4]]
    jitter = {pid: 0.01 * i for i, pid in enumerate(prompt_ids)}  # tools come back at different times

    engine = ScriptedEngine(task[1], ["<search>a</search>"])
    steps = _run_tools(task, engine, lambda pid, step: time.sleep(jitter[pid]), max_steps=4)
    assert engine.batch_sizes == [4, 4, 4, 4]  # one call per turn, never fragmented by the jitter
    info = {(s.prompt_id, s.step_idx): json.loads(s.info) for s in steps}
    for step_idx in range(4):
        timings = [info[(pid, step_idx)] for pid in prompt_ids]
        assert all(t["env_seconds"] >= 0 and t["queue_seconds"] >= 0 for t in timings)
        assert len({t["generate_seconds"] for t in timings}) == 1  # they shared one call
    # from the second call on, the first tool back waited in the queue for the last one
    assert info[(prompt_ids[0], 1)]["queue_seconds"] > info[(prompt_ids[3], 1)]["queue_seconds"]


@pytest.mark.parametrize("slots", [1, 3])
def test_a_one_call_engine_generates_on_the_calling_thread_and_a_concurrent_one_on_pool_threads(task, slots):
    """A second thread would give an in-process torch engine its own OpenMP team (docs/architecture.md §11, agent_core/rollout/agent_loop.py)."""
    threads: set[str] = set()
    engine = TimedEngine(task[1], slots=slots, on_call=lambda number: threads.add(threading.current_thread().name))
    _run_tools(task, engine, lambda pid, step: time.sleep(0.01), prompts=3, max_steps=2)
    assert len(engine.calls) >= 2
    if slots == 1:
        assert threads == {threading.current_thread().name}
    else:
        assert threads and all(name.startswith("agentr1-generate") for name in threads)


@pytest.mark.parametrize("seed", [None, 11])
def test_each_call_samples_with_its_own_seed(task, seed):
    engine = TimedEngine(task[1], slots=1)
    _run_tools(task, engine, lambda pid, step: None, prompts=2, max_steps=3, seed=seed)
    assert [call[3] for call in engine.calls] == ([None] * 3 if seed is None else [11, 12, 13])


@pytest.mark.parametrize("slots", [1, 4])
def test_an_engine_error_ends_the_rollout_without_waiting_for_running_tools(task, slots):
    prompt_ids = [p.prompt_id for p in task[0].prompts[:2]]
    release, tool_done = threading.Event(), threading.Event()

    def on_call(number):
        if number == 1:
            raise ConnectionError("engine server died")

    def tool(prompt_id, step):
        if prompt_id == prompt_ids[0]:
            release.wait(timeout=2.0)
            tool_done.set()

    engine = TimedEngine(task[1], slots=slots, on_call=on_call)
    try:
        with pytest.raises(ConnectionError, match="engine server died"):
            _run_tools(task, engine, tool, prompts=2, straggler_wait_s=0.05)
        assert not tool_done.is_set()  # the error came out while the slow tool was still running
    finally:
        release.set()


def test_seeded_lock_step_hf_rollout_is_reproducible(task):
    tokenizer = task[1]
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    engine = HFEngine(model, tokenizer)
    batch_sizes: list[int] = []

    class Counting:  # serial, like the HF engine it wraps
        def generate(self, prompts, params):
            batch_sizes.append(len(prompts))
            return engine.generate(prompts, params)

    def roll(seed):
        steps = _run(task, Counting(), group_size=2, max_steps=2, max_new_tokens=8, seed=seed,
                     straggler_wait_s=math.inf)
        return [(s.episode_id, s.step_idx, tuple(s.response_ids)) for s in steps], steps

    first, steps = roll(5)
    assert batch_sizes[0] == 4 and sum(batch_sizes) == len(steps)
    # lock-step: each call held every unfinished episode
    for turn, size in enumerate(batch_sizes):
        assert size == sum(1 for s in steps if s.step_idx == turn)
    assert roll(5)[0] == first
    assert roll(6)[0] != first  # the seed is what made the runs equal
