"""ToolEnv: tools + a tool-call format; every bad action is an observation, counted in info."""

from __future__ import annotations

import json
import time

import pytest

from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.tool_env import ChatCapabilities, ToolEnv, add_instructions
from agent_core.envs.tools import function_tool
from agent_core.types import ChatMessage, Prompt


@function_tool(timeout_s=0.2)
def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


@function_tool
def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


@function_tool
def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: What to repeat.
    """
    return text


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _env(**kwargs) -> ToolEnv:
    return ToolEnv([nap, explode, echo], "hermes", **kwargs)


PROMPT = Prompt("p", "t", "train", (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi?")), ("x",), "tool_env")


def test_several_calls_in_one_action_run_in_order_and_are_recorded():
    step = _env().step(_call("echo", text="one") + "\n" + _call("echo", text="two"))
    assert not step.done and step.parse_error is None and step.reward == 0.0
    assert [c.name for c in step.tool_calls] == ["echo", "echo"] and all(c.ok for c in step.tool_calls)
    assert step.observation.index("one") < step.observation.index("two")
    assert step.info["num_calls"] == 2 and step.info["num_failed_calls"] == 0 and step.info["format_ok"]


@pytest.mark.parametrize("action, kind", [
    (_call("nope", text="x"), "unknown_tool"),
    (_call("echo", txt="x"), "bad_arguments"),
    (_call("echo", text=3), "bad_arguments"),
    (_call("explode", reason="boom"), "exception"),
    (_call("nap", seconds=3), "timeout"),
])
def test_failing_calls_are_observations_with_a_penalty(action, kind):
    started = time.perf_counter()
    step = _env(tool_error_penalty=0.25).step(action)
    assert time.perf_counter() - started < 2.5  # the timeout did not wait for the 3 s nap
    assert not step.done and step.reward == -0.25
    assert step.tool_calls[0].error_kind == kind and not step.tool_calls[0].ok
    assert step.info["call_errors"] == {kind: 1} and step.info["num_failed_calls"] == 1
    assert step.observation  # the model is told what went wrong


def test_exception_text_is_short_and_the_traceback_is_kept_in_info():
    step = _env().step(_call("explode", reason="boom"))
    assert "RuntimeError: boom" in step.observation and "Traceback" not in step.observation
    assert "Traceback" in step.info["tool_info"][0]["traceback"]


@pytest.mark.parametrize("action", ['<tool_call>{"name": "echo", "arguments": {</tool_call>', "just text", "<tool_call>"])
def test_unreadable_actions_are_invalid_with_the_answer_hint(action):
    step = _env(invalid_action_penalty=0.5).step(action)
    assert not step.done and step.reward == -0.5 and step.parse_error
    assert step.info["format_ok"] is False and sum(step.info["parse_errors"].values()) >= 1
    assert "Invalid action" in step.observation and "<answer>" in step.observation


def test_a_good_call_next_to_a_malformed_one_still_runs():
    step = _env(invalid_action_penalty=0.5).step(_call("echo", text="ok") + '<tool_call>{"name": </tool_call>')
    assert [c.name for c in step.tool_calls] == ["echo"] and "ok" in step.observation
    assert step.reward == -0.5 and step.parse_error


def test_calls_beyond_the_limit_are_not_run_and_are_reported():
    step = _env(max_calls_per_action=2, invalid_action_penalty=0.1).step("".join(_call("echo", text=str(i)) for i in range(4)))
    assert len(step.tool_calls) == 2 and "too_many_calls" in step.parse_error and step.reward == -0.1


def test_answer_ends_the_episode_and_calls_after_it_are_ignored():
    step = _env().step("<answer>42</answer>" + _call("explode", reason="no"))
    assert step.done and step.termination == "answered" and step.info["answer"] == "42" and step.tool_calls == ()


def test_tools_are_described_by_the_template_only_when_it_can():
    plain = _env()
    assert plain.tools_for_template is None
    system = plain.reset(PROMPT)[0]
    assert system.content.startswith("Be brief.") and '"name": "echo"' in system.content
    templated = _env(chat=ChatCapabilities(tools_in_template=True, tool_role=True))
    assert [t["function"]["name"] for t in templated.tools_for_template] == ["nap", "explode", "echo"]
    assert '"name": "echo"' not in templated.reset(PROMPT)[0].content and templated.observation_role == "tool"
    step = templated.step(_call("echo", text="a") + _call("echo", text="b"))
    assert [m.role for m in step.observation_messages] == ["tool", "tool"]


def test_add_instructions_merges_into_or_creates_the_system_message():
    user_only = (ChatMessage("user", "q"),)
    assert add_instructions(user_only, "Rules.") == (ChatMessage("system", "Rules."), ChatMessage("user", "q"))
    assert add_instructions(PROMPT.messages, "Rules.")[0].content == "Be brief.\n\nRules."


def test_bad_construction_is_refused_clearly():
    with pytest.raises(ValueError, match="unique"):
        ToolEnv([echo, echo])
    with pytest.raises(ValueError, match="tool_error_penalty"):
        ToolEnv([echo], "hermes", tool_error_penalty=-1)
    with pytest.raises(ValueError, match="valid"):
        ToolEnv([echo], "json")


def test_registered_tool_env_builds_named_tools_with_kwargs():
    env = make_env("tool_env", {"tools": ["calculator", {"name": "python", "kwargs": {"timeout_s": 2}}],
                                "tool_format": "hermes"}, EnvResources())
    assert sorted(env.tools) == ["calculator", "python"]
    step = env.step(_call("calculator", expression="6*7") + _call("python", code="print(sum(range(5)))"))
    assert "42" in step.observation and "10" in step.observation and all(c.ok for c in step.tool_calls)
    with pytest.raises(ValueError, match="valid tools"):
        make_env("tool_env", {"tools": [{"kwargs": {}}]}, EnvResources())


def test_calls_past_the_episode_budget_are_not_run_and_are_recorded():
    runs: list[str] = []

    class Counting(ToolEnv):  # records what really ran
        def _run(self, name, arguments):
            outcome = super()._run(name, arguments)
            if outcome.error_kind != "over_budget":
                runs.append(arguments["text"])
            return outcome

    env = Counting([echo], "hermes", max_tool_calls_per_episode=3, tool_error_penalty=0.5)
    env.reset(PROMPT)
    env.step(_call("echo", text="a") + _call("nope", text="b"))  # a failed call counts too
    step = env.step(_call("echo", text="c") + _call("echo", text="d"))
    assert runs == ["a", "b", "c"] and not step.done and step.reward == -0.5
    assert [(c.ok, c.error_kind) for c in step.tool_calls] == [(True, None), (False, "over_budget")]
    assert step.info["call_errors"] == {"over_budget": 1} and step.parse_error is None
    assert "tool-call budget (3 calls) is used up" in step.observation and "<answer>" in step.observation
    env.reset(PROMPT)  # a new episode gets a new budget
    assert env.step(_call("echo", text="e")).tool_calls[0].ok and runs[-1] == "e"


def test_the_episode_budget_is_an_env_kwarg_with_a_default():
    resources = EnvResources()
    assert make_env("tool_env", {}, resources).max_tool_calls_per_episode == 16
    assert make_env("tool_env", {"max_tool_calls_per_episode": None}, resources).max_tool_calls_per_episode is None
    unlimited = ToolEnv([echo], "hermes", max_tool_calls_per_episode=None)
    assert all(unlimited.step(_call("echo", text="x")).tool_calls[0].ok for _ in range(40))
    with pytest.raises(ValueError, match="max_tool_calls_per_episode"):
        ToolEnv([echo], "hermes", max_tool_calls_per_episode=-1)


def test_an_envs_tools_are_told_from_its_arguments_without_building_it():
    from agent_core.envs.registry import env_tool_names

    assert env_tool_names("tool_env", {"tools": ["search", {"name": "python", "kwargs": {}}]}) == ("search", "python")
    assert env_tool_names("tool_env", {}) == ("calculator",)  # the factory's default
    assert env_tool_names("search_qa", {"top_k": 2}) == ("search",)
