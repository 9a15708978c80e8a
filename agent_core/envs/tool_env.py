"""`ToolEnv`: an `AgentEnv` made of tools and a tool-call format (docs/architecture.md §2).

An action may call several tools or give the final answer with `<answer>...</answer>` ("answered"). Everything
the model can get wrong comes back as an error observation (with a configurable penalty), never a crash; tool
use is bounded per action, per episode and per call (time and size). Only action text is parsed, never tool
results. Each step's `anchor` is GiGPO's anchor state (agent_core/algos/gigpo.py); answer steps have none.
Design notes: docs/architecture.md §11 (agent_core/envs/tool_env.py).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from agent_core.envs.base import EnvStep, ToolCall
from agent_core.envs.formats import build_format
from agent_core.envs.tools import Tool, ToolCallOutcome, execute_call
from agent_core.types import ChatMessage, Prompt

DEFAULT_MAX_TOOL_CALLS_PER_EPISODE = 16


@dataclass(frozen=True)
class ChatCapabilities:
    """What the policy's chat template can render (probed from the tokenizer by the rollout).

    tools_in_template: `apply_chat_template(..., tools=...)` writes the tool list itself.
    tool_role: the template has a "tool" role for tool results.
    """

    tools_in_template: bool = False
    tool_role: bool = False


def add_instructions(messages: Sequence[ChatMessage], text: str) -> tuple[ChatMessage, ...]:
    """`text` appended to the system message (one is added in front if there is none)."""
    if not text:
        return tuple(messages)
    if messages and messages[0].role == "system":
        merged = f"{messages[0].content}\n\n{text}" if messages[0].content else text
        return (ChatMessage("system", merged), *messages[1:])
    return (ChatMessage("system", text), *messages)


def check_tool_env_values(invalid_action_penalty: float = 0.0, tool_error_penalty: float = 0.0,
                          tool_timeout_s: float = 10.0, max_calls_per_action: int = 4, max_result_chars: int = 4000,
                          max_tool_calls_per_episode: int | None = DEFAULT_MAX_TOOL_CALLS_PER_EPISODE,
                          **_other: Any) -> None:
    """ValueError naming the first out-of-range setting of a ToolEnv. Other keys are ignored, so the
    config check can pass `rollout.env_kwargs` whole and fail at load, not when an env is first built."""
    for name, value in (("invalid_action_penalty", invalid_action_penalty), ("tool_error_penalty", tool_error_penalty)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (it is subtracted), got {value}")
    if tool_timeout_s <= 0 or max_calls_per_action < 1 or max_result_chars < 1:
        raise ValueError("tool_timeout_s, max_calls_per_action and max_result_chars must be positive, got "
                         f"{tool_timeout_s}, {max_calls_per_action} and {max_result_chars}")
    if max_tool_calls_per_episode is not None and max_tool_calls_per_episode < 0:
        raise ValueError(f"max_tool_calls_per_episode must be >= 0 or None, got {max_tool_calls_per_episode}")


class ToolEnv:
    """Tools + a tool-call format. One instance runs one episode at a time.

    tools: the tools the policy may call (unique names). tool_format: "tag" or "hermes".
    invalid_action_penalty: subtracted when an action has a call that cannot be read, or neither
        calls nor an answer. tool_error_penalty: subtracted per call that fails (unknown tool, bad
        arguments, exception, timeout). tool_timeout_s: default per-call time limit.
    max_calls_per_action: calls beyond this are not run and count as an invalid action.
    max_tool_calls_per_episode: calls the episode may run in all, failed ones included (None: no
        limit); each call past it is not run and comes back as a failed call (error_kind
        "over_budget", penalised like other failed calls), so a looping policy cannot make an
        episode run tools without end. The default, 16, is max_steps x max_calls_per_action at the
        rollout defaults (4 x 4): it binds only once an episode may take more steps than that.
    max_result_chars: each tool result is cut to this many characters (marked).
    instructions: add the format's tool instructions to the system message (default). Off, the
        policy sees only the prompt's own messages (nor does a chat template that could list the
        tools get them): for a from-scratch policy that learns the format
        from demonstrations, where ~100 tokens of instructions in every context only slow it down.
    """

    def __init__(self, tools: Sequence[Tool], tool_format: str = "tag", *, chat: ChatCapabilities = ChatCapabilities(),
                 invalid_action_penalty: float = 0.0, tool_error_penalty: float = 0.0, tool_timeout_s: float = 10.0,
                 max_calls_per_action: int = 4, max_result_chars: int = 4000,
                 max_tool_calls_per_episode: int | None = DEFAULT_MAX_TOOL_CALLS_PER_EPISODE,
                 instructions: bool = True):
        names = [tool.name for tool in tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(duplicates)}")
        check_tool_env_values(invalid_action_penalty, tool_error_penalty, tool_timeout_s, max_calls_per_action,
                              max_result_chars, max_tool_calls_per_episode)
        self.tools = {tool.name: tool for tool in tools}
        self.tool_specs = [tool.spec() for tool in tools]
        self.format = build_format(tool_format, self.tool_specs)
        self.chat = chat
        uses_template = instructions and tool_format == "hermes" and chat.tools_in_template and bool(self.tool_specs)
        self.tools_for_template = self.tool_specs if uses_template else None
        self.observation_role = "tool" if tool_format == "hermes" and chat.tool_role else "user"
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.tool_error_penalty = float(tool_error_penalty)
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_calls_per_action = max_calls_per_action
        self.max_result_chars = max_result_chars
        self.max_tool_calls_per_episode = max_tool_calls_per_episode
        self.instructions = instructions
        self.calls_run = 0  # in this episode, counted against max_tool_calls_per_episode

    def reset(self, prompt: Prompt) -> tuple[ChatMessage, ...]:
        self.calls_run = 0
        if not self.instructions:
            return tuple(prompt.messages)
        if self.tools_for_template is not None:  # the template lists the tools; say how to answer
            return add_instructions(prompt.messages, self.format.answer_instructions)
        return add_instructions(prompt.messages, self.format.system_prompt(self.tool_specs))

    def step(self, action_text: str) -> EnvStep:
        parsed = self.format.parse(action_text, list(self.tools))
        if parsed.answer is not None:
            return EnvStep(observation="", reward=0.0, done=True, termination="answered",
                           info={"answer": parsed.answer, "format_ok": True})
        errors = [f"{e.kind}: {e.message}" for e in parsed.errors]
        error_kinds = [e.kind for e in parsed.errors]
        calls = parsed.calls[: self.max_calls_per_action]
        if len(parsed.calls) > len(calls):
            error_kinds.append("too_many_calls")
            errors.append(f"too_many_calls: only the first {len(calls)} of {len(parsed.calls)} calls were run")
        outcomes = [self._run(call.name, call.arguments) for call in calls]
        results = [(o.name, o.text) for o in outcomes]
        if errors:
            hint = "" if calls else f" {self.format.answer_instructions}"
            results.append(("error", "Invalid action: " + "; ".join(errors) + hint))
        messages = tuple(self.format.observation_messages(results, self.chat.tool_role))
        reward = sum(o.reward for o in outcomes) - (self.invalid_action_penalty if errors else 0.0)
        return EnvStep(
            observation="\n".join(m.content for m in messages),
            observation_messages=messages,
            reward=reward,
            done=False,
            tool_calls=tuple(_tool_call(o) for o in outcomes),
            parse_error="; ".join(errors) or None,
            info=_step_info(outcomes, parsed.errors, format_ok=not errors),
            anchor=observation_anchor(outcomes, error_kinds),
        )

    def _run(self, name: str, arguments: Any) -> ToolCallOutcome:
        budget = self.max_tool_calls_per_episode
        if budget is not None and self.calls_run >= budget:
            text = (f"Error: this episode's tool-call budget ({budget} calls) is used up; the call was not run. "
                    f"{self.format.answer_instructions}")
            return ToolCallOutcome(name=str(name), arguments=arguments if isinstance(arguments, dict) else {},
                                   ok=False, text=text, reward=-self.tool_error_penalty, error_kind="over_budget",
                                   latency_s=0.0, info={"budget": budget})
        self.calls_run += 1
        return execute_call(self.tools, name, arguments, default_timeout_s=self.tool_timeout_s,
                            error_reward=-self.tool_error_penalty, max_result_chars=self.max_result_chars)


def observation_anchor(outcomes: Sequence[ToolCallOutcome], error_kinds: Sequence[str]) -> str:
    """The anchor of the state a step's observation leads to (module docstring)."""
    parts = []
    for outcome in outcomes:
        doc_ids = outcome.info.get("doc_ids")
        if outcome.ok and isinstance(doc_ids, list):
            parts.append("docs:" + ",".join(sorted(str(doc) for doc in doc_ids)))
        elif not outcome.ok:
            parts.append(f"{outcome.name}:{outcome.error_kind}")
        else:
            text = " ".join(outcome.text.lower().split())
            digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest()
            parts.append(f"{outcome.name}:{digest}")
    if error_kinds:
        parts.append("invalid:" + ",".join(sorted(error_kinds)))
    return "|".join(parts)


def _tool_call(outcome: ToolCallOutcome) -> ToolCall:
    return ToolCall(name=outcome.name, arguments=outcome.arguments if isinstance(outcome.arguments, dict) else {},
                    ok=outcome.ok, error_kind=outcome.error_kind, latency_s=round(outcome.latency_s, 6))


def _step_info(outcomes: Sequence[ToolCallOutcome], parse_errors, format_ok: bool) -> dict[str, Any]:
    """Counts worth querying in SQL, plus what tools chose to report (e.g. retrieved doc ids)."""
    info: dict[str, Any] = {
        "format_ok": format_ok,
        "num_calls": len(outcomes),
        "num_failed_calls": sum(not o.ok for o in outcomes),
        "call_errors": dict(Counter(o.error_kind for o in outcomes if o.error_kind)),
        "parse_errors": dict(Counter(e.kind for e in parse_errors)),
        "tool_seconds": round(sum(o.latency_s for o in outcomes), 6),
    }
    reported = [{k: v for k, v in o.info.items() if (k, v) != ("truncated_chars", 0)} for o in outcomes]
    if any(reported):
        info["tool_info"] = reported
    doc_ids = [doc for o in outcomes for doc in o.info.get("doc_ids", ())]
    if doc_ids:
        info["doc_ids"] = doc_ids
    return info
