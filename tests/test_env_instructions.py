"""The env switch `instructions` (ToolEnv, and the tool_env / search_qa factories of the env registry):
off, reset returns the prompt's own messages unchanged; on (the default), the format's tool
instructions are in the system message. Evaluation follows `rollout.env_kwargs.instructions`
(tasks/evaluate.py `run_eval_settings` -> EvalSettings.instructions -> the search_qa env of
agent_core/eval/methods.py `tool_agent_episodes`), checked on the contexts a policy is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_core.data.oracle import OracleEngine
from agent_core.data.synthetic import SYSTEM_PROMPT, generate_synthetic_qa
from agent_core.envs.registry import EnvResources, env_kwarg_names, make_env
from agent_core.envs.search import Bm25Index
from agent_core.envs.tool_env import ToolEnv
from agent_core.envs.tools import function_tool
from agent_core.training.model import build_tokenizer
from agent_core.types import ChatMessage, Prompt

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = Prompt("p", "t", "train", (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi?")), ("x",), "tool_env")


@function_tool
def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: What to repeat.
    """
    return text


@pytest.fixture(scope="module")
def task():
    return generate_synthetic_qa(seed=2, num_films=16, num_people=12, num_cities=5, num_countries=3)


@pytest.mark.parametrize("tool_format", ["tag", "hermes"])
def test_tool_env_without_instructions_returns_the_prompt_messages(tool_format):
    off = ToolEnv([echo], tool_format, instructions=False)
    assert off.reset(PROMPT) == PROMPT.messages
    on = ToolEnv([echo], tool_format)
    system = on.reset(PROMPT)[0]
    instructions = on.format.system_prompt(on.tool_specs)
    assert system.content == f"Be brief.\n\n{instructions}" and "echo" in instructions
    no_system = Prompt("q", "t", "train", (ChatMessage("user", "Hi?"),), ("x",), "tool_env")
    assert off.reset(no_system) == no_system.messages  # no system message is invented either
    assert [m.role for m in on.reset(no_system)] == ["system", "user"]


def test_without_instructions_the_env_still_runs_tools_and_takes_answers():
    env = ToolEnv([echo], "tag", instructions=False)
    env.reset(PROMPT)
    step = env.step("<echo>hello</echo>")
    assert step.parse_error is None and "hello" in step.observation and not step.done
    assert env.step("<answer>x</answer>").info["answer"] == "x"


def test_the_registry_factories_accept_instructions(task):
    assert "instructions" in env_kwarg_names("tool_env") and "instructions" in env_kwarg_names("search_qa")
    plain = make_env("tool_env", {"instructions": False}, EnvResources())
    assert plain.reset(PROMPT) == PROMPT.messages
    assert make_env("tool_env", {}, EnvResources()).reset(PROMPT) != PROMPT.messages


def test_search_qa_with_and_without_instructions(task):
    resources = EnvResources(search_index=Bm25Index(task.documents))
    prompt = task.prompts[0]
    off = make_env("search_qa", {**prompt.env_kwargs, "instructions": False}, resources)
    assert off.reset(prompt) == prompt.messages
    on = make_env(prompt.env_name, prompt.env_kwargs, resources)  # the default: instructions on
    system = on.reset(prompt)[0].content
    assert system.startswith(prompt.messages[0].content) and "<search>" in system
    assert "<search>" not in off.reset(prompt)[0].content
    title = task.documents[0].title
    step = off.step(f"<search> {title}</search>")  # the tool works the same without instructions
    assert step.parse_error is None and task.documents[0].doc_id in step.info["doc_ids"]


def test_rollout_tool_instructions_and_env_kwargs_reach_the_eval_settings():
    from agent_core.validation import load_config
    from tasks.evaluate import run_eval_settings

    tiny = REPO_ROOT / "configs" / "tiny.yaml"
    assert run_eval_settings(load_config(tiny), greedy=True).instructions is False  # the default: off
    on = load_config(tiny, ["rollout.tool_instructions=true"])
    assert run_eval_settings(on, greedy=True).instructions is True
    off = load_config(tiny, ["rollout.tool_instructions=true", "rollout.env_kwargs.instructions=false"])
    assert run_eval_settings(off, greedy=True).instructions is False  # env_kwargs win


def test_rollout_tool_instructions_reach_the_training_envs(monkeypatch):
    from agent_core.config import RolloutConfig
    from agent_core.rollout.spec import env_for as _env_of

    prompt = generate_synthetic_qa(seed=0, num_films=8, num_people=6, num_cities=3, num_countries=2).prompts[0]
    assert _env_of(prompt, RolloutConfig())[1]["instructions"] is False
    assert _env_of(prompt, RolloutConfig(tool_instructions=True))[1]["instructions"] is True
    kwargs = _env_of(prompt, RolloutConfig(tool_instructions=True, env_kwargs={"instructions": False}))[1]
    assert kwargs["instructions"] is False
    # an env that takes no `instructions` (a user's) is not given one
    monkeypatch.setattr("agent_core.rollout.spec.env_kwarg_names", lambda name: ["top_k", "tool_format"])
    assert "instructions" not in _env_of(prompt, RolloutConfig())[1]


class _Recording:
    """The oracle, recording every context it is asked to continue."""

    def __init__(self, engine):
        self.engine, self.contexts = engine, []

    def generate(self, prompts, params):
        self.contexts += [list(p) for p in prompts]
        return self.engine.generate(prompts, params)


@pytest.mark.parametrize("instructions", [True, False])
def test_tool_agent_evaluation_follows_the_setting(task, instructions):
    from agent_core.eval.methods import EvalSettings, tool_agent_episodes

    prompts = [p for p in task.prompts if p.metadata["type"] == "bridge"][:4]
    tokenizer = build_tokenizer([d.text for d in task.documents] + [m.content for p in prompts for m in p.messages],
                                vocab_size=400)
    engine = _Recording(OracleEngine(tokenizer, prompts))
    settings = EvalSettings(max_new_tokens=96, max_steps=6, max_context_tokens=4096, instructions=instructions)
    episodes = tool_agent_episodes(engine, tokenizer, prompts, task.documents, settings)
    assert [e.em for e in episodes] == [1.0] * len(prompts)  # the oracle answers either way
    env = make_env("search_qa", {}, EnvResources(search_index=Bm25Index(task.documents)))
    first_line = env.format.system_prompt(env.tool_specs).splitlines()[0]  # "You can use these tools ..."
    decoded = [tokenizer.decode(c) for c in engine.contexts]
    assert len(decoded) >= 2 * len(prompts)
    assert all((first_line in text) == instructions for text in decoded)
    assert all(SYSTEM_PROMPT in text for text in decoded)  # the prompt's own system message stays
