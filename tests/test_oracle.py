"""The scripted oracle: its actions read back as the planned searches and answer, and OracleEngine,
run through the real agent loop, env and BM25 index, answers every question type correctly in both
tool-call formats and records a valid steps table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agent_core.data.oracle import OracleEngine, oracle_actions
from agent_core.data.synthetic import TEMPLATES, generate_synthetic_qa
from agent_core.envs.formats import build_format
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.tables import write_table
from agent_core.rewards.qa import exact_match
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.context import ContextPolicy
from agent_core.rollout.engine import SamplingParams
from agent_core.training.model import build_tokenizer
from agent_core.types import Prompt

PER_TEMPLATE = 4  # 9 templates -> 36 prompts


@pytest.fixture(scope="module")
def task():
    dataset = generate_synthetic_qa(seed=5, num_films=40, num_people=30, num_cities=10, num_countries=4)
    chosen: list[Prompt] = []
    for template in TEMPLATES:
        chosen += [p for p in dataset.prompts if p.metadata["template"] == template][:PER_TEMPLATE]
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    tokenizer = build_tokenizer(texts, vocab_size=400)
    return dataset, chosen, tokenizer, EnvResources(search_index=Bm25Index(dataset.documents))


def _roll_out(task, tool_format: str, group_size: int = 1, context: ContextPolicy = ContextPolicy()):
    dataset, prompts, tokenizer, resources = task
    engine = OracleEngine(tokenizer, prompts, tool_format=tool_format)
    settings = LoopSettings(group_size=group_size, max_steps=6, max_context_tokens=4096, policy_version=0,
                            episode_prefix=f"oracle-{tool_format}-", context=context)
    sampling = SamplingParams(max_new_tokens=96, stop_token_ids=eos_token_ids(tokenizer))
    make = lambda p: make_env(p.env_name, {**p.env_kwargs, "tool_format": tool_format}, resources)  # noqa: E731
    return run_episodes(engine, tokenizer, prompts, make, sampling, settings)


@pytest.mark.parametrize("tool_format", ["tag", "hermes"])
def test_actions_read_back_as_the_plan(task, tool_format):
    reader = build_format(tool_format, [{"function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}])
    for prompt in task[1]:
        plan = prompt.metadata["oracle_plan"]
        *searches, answer = [reader.parse(text) for text in oracle_actions(prompt, tool_format)]
        assert [[(c.name, c.arguments) for c in a.calls] for a in searches] == [[("search", {"query": q})] for q in plan["queries"]]
        assert answer.answer == plan["answer"] == prompt.answers[0]


@pytest.mark.parametrize("tool_format", ["tag", "hermes"])
def test_oracle_episodes_through_the_agent_loop_answer_correctly(task, tool_format, tmp_path):
    prompts = task[1]
    steps = _roll_out(task, tool_format)
    by_prompt = {p.prompt_id: p for p in prompts}
    finals = [s for s in steps if s.done]
    assert len(finals) == len(prompts) and {s.termination for s in finals} == {"answered"}
    correct = sum(exact_match(json.loads(s.info)["answer"], by_prompt[s.prompt_id].answers) for s in finals)
    assert correct >= 0.95 * len(prompts)
    for step in steps:
        prompt = by_prompt[step.prompt_id]
        plan = prompt.metadata["oracle_plan"]
        assert step.response_logprobs == [0.0] * len(step.response_ids) and step.finish_reason == "stop"
        if not step.done:  # search k retrieves supporting page k: the plan works on the real index
            assert step.parse_error is None
            assert prompt.metadata["supporting_doc_ids"][step.step_idx] in json.loads(step.info)["doc_ids"]
        else:
            assert step.step_idx == len(plan["queries"])
    rows = [{"run_id": "r", "iteration": 0, **dataclasses.asdict(s)} for s in steps]
    assert write_table("steps", rows, str(tmp_path / "steps.parquet")).endswith("steps.parquet")


def test_several_episodes_per_prompt_and_a_windowed_context_each_follow_their_own_plan(task):
    steps = _roll_out(task, "tag", group_size=2, context=ContextPolicy("last_k", keep_last_turns=1))
    finals = [s for s in steps if s.done]
    prompts = {p.prompt_id: p for p in task[1]}
    assert len(finals) == 2 * len(prompts)
    assert all(exact_match(json.loads(s.info)["answer"], prompts[s.prompt_id].answers) for s in finals)


def test_cut_actions_report_length_and_unknown_contexts_fail_clearly(task):
    _, prompts, tokenizer, _ = task
    engine = OracleEngine(tokenizer, prompts[:1])
    context = tokenizer.encode(prompts[0].messages[1].content, add_special_tokens=False)
    (cut,) = engine.generate([context], SamplingParams(max_new_tokens=3))
    assert len(cut.token_ids) == 3 and cut.finish_reason == "length"
    with pytest.raises(ValueError, match="holds none of the 1 questions"):
        engine.generate([tokenizer.encode(prompts[1].messages[1].content, add_special_tokens=False)],
                        SamplingParams(max_new_tokens=8))


def test_a_prompt_without_a_plan_is_refused(task):
    bare = dataclasses.replace(task[1][0], metadata={}, prompt_id="hotpot-1")
    with pytest.raises(ValueError, match="'hotpot-1' has no metadata\\['oracle_plan'\\]"):
        oracle_actions(bare)


def test_rag_demonstrations_are_the_naive_rag_prompt_answered_with_the_gold(task, tmp_path):
    from agent_core.data.oracle import rag_demonstrations
    from agent_core.eval.methods import answer_of, naive_rag_messages, question_text
    from agent_core.rollout.chat import encode_conversation

    dataset, chosen, tokenizer, resources = task
    records = rag_demonstrations(tokenizer, chosen[:5], dataset.documents, top_k=2, episode_prefix="rag-")
    index = Bm25Index(dataset.documents)
    for prompt, record in zip(chosen[:5], records):
        passages = index.search(question_text(prompt), 2)
        assert record.prompt_ids == encode_conversation(tokenizer, naive_rag_messages(prompt, passages))
        text = tokenizer.decode(record.response_ids, skip_special_tokens=True)
        assert exact_match(answer_of(text), prompt.answers) == 1.0
        assert record.response_ids[-1] == eos_token_ids(tokenizer)[-1] and record.done
        assert json.loads(record.info)["answer"] == prompt.metadata["oracle_plan"]["answer"]
    rows = [{"run_id": "r", "iteration": 0, **dataclasses.asdict(r)} for r in records]
    write_table("steps", rows, tmp_path / "steps.parquet")  # a valid steps table


# ---- the warm start is refused, at config check, where the oracle cannot run ----------------------

_NO_SEARCH = {"rollout": {"env": "tool_env", "env_kwargs": {"tools": ["calculator"], "tool_format": "hermes"}}}


def _config_error(data: dict) -> str:
    from agent_core.config import ConfigError
    from agent_core.validation import build_config

    with pytest.raises(ConfigError) as raised:
        build_config(data)
    return str(raised.value)


def test_an_env_without_the_oracles_tools_is_refused_naming_tools_and_fixes():
    message = _config_error(_NO_SEARCH)
    assert "rollout.env_kwargs.tools" in message and "calls tool(s) search" in message
    assert "env 'tool_env' does not have (its tools: calculator)" in message
    assert "Add search to rollout.env_kwargs.tools" in message and "--set warm_start.enabled=false" in message
    assert "warm_start.source=steps" in message
    # the default tool list (calculator) is what the env would get, so it is refused too
    assert "its tools: calculator" in _config_error({"rollout": {"env": "tool_env"}})


def test_an_env_whose_tools_are_unknown_and_a_dataset_without_plans_are_refused():
    # the env guide's example env: a game without tools (examples/guess_number_env.py)
    message = _config_error({"plugins": ["examples.guess_number_env"], "rollout": {"env": "guess_number"}})
    assert "rollout.env" in message and "env 'guess_number' does not say which tools it has" in message
    assert "--set warm_start.enabled=false" in message
    message = _config_error({"data": {"source": "musique", "files": {"dev": "d.jsonl"}}})
    assert "data.source" in message and "only the built-in synthetic task" in message


@pytest.mark.parametrize("fix", [
    {"rollout": {"env": "tool_env", "env_kwargs": {"tools": ["search", "calculator"], "tool_format": "hermes"}}},
    {"rollout": {"env": "tool_env", "env_kwargs": {"tools": [{"name": "search", "kwargs": {"top_k": 2}}]}}},
    {**_NO_SEARCH, "warm_start": {"enabled": False}},
    {**_NO_SEARCH, "warm_start": {"source": "steps", "steps_uri": "/runs/r/warm_start/steps.parquet"}},
    {"rollout": {"env": "search_qa", "env_kwargs": {"tool_format": "hermes"}}},
    {},  # the synthetic prompts' own env, search_qa
])
def test_the_fixes_pass(fix):
    from agent_core.validation import build_config

    build_config(fix)


def test_a_misspelt_tool_is_told_once_not_as_a_missing_search_too():
    message = _config_error({"rollout": {"env": "tool_env", "env_kwargs": {"tools": ["serch"]}}})
    assert "unknown tool 'serch'" in message and "scripted oracle" not in message


def test_an_agent_program_is_warm_started_by_the_oracle_in_the_gateways_format():
    # its tools are declared by the program per request: the config cannot tell, the run checks (below)
    from agent_core.envs.registry import env_tool_format
    from agent_core.validation import build_config

    config = build_config({"rollout": {"env": "agent_program", "env_kwargs": {"command": ["python", "agent.py"]}}})
    assert env_tool_format(config.rollout.env, config.rollout.env_kwargs) == "hermes"  # the gateway's, always
    assert env_tool_format("search_qa", {}) == "tag"  # the argument's default
    assert env_tool_format("tool_env", {}) == "hermes"
    assert env_tool_format("search_qa", {"tool_format": "hermes"}) == "hermes"


def test_an_oracle_that_solved_none_of_its_ideal_episodes_fails_the_warm_start():
    from agent_core.data.oracle import check_oracle_solved

    with pytest.raises(ValueError, match="solved none of its 24 ideal episodes in env 'agent_program'"):
        check_oracle_solved(0, 24, "agent_program")
    with pytest.raises(ValueError, match="3 of its replies were cut by the token limit"):
        check_oracle_solved(0, 24, "agent_program", cut_actions=3)
    check_oracle_solved(1, 24, "agent_program")
    check_oracle_solved(0, 0, "agent_program")  # every episode lazy: none is expected to solve
