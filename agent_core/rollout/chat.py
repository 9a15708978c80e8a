"""Token-in/token-out chat rendering for multi-turn episodes, with tools and injection-safe content.

An episode's context grows by appending ids; observation ids carry the chat template's own turn glue, cut from
a rendering (`encode_observation_messages`), so any ChatML-like template works. Unlike
`apply_chat_template(tokenize=True)`, message contents are encoded as plain text (special-token matching off),
so a content cannot become the template's control tokens. Right for byte-level BPE, not SentencePiece.
Design notes: docs/architecture.md §11 (agent_core/rollout/chat.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from agent_core.types import ChatMessage

_EXTRA_END_OF_TURN = "<|im_end|>"
# Stand-ins for contents in probe renderings; no whitespace or markup, so templates that trim or
# escape content leave them intact.
_ACTION_MARKER = "AGENTR1ACTIONMARKER7F3A"
_DUMMY_QUESTION = "AGENTR1QUESTIONMARKER"
_CONTENT_MARKER = re.compile(r"AGENTR1CONTENT(\d+)MARKER7F3A")
_PROBE_TOOL_NAME = "agentr1_probe_tool_7f3a"
_PROBE_ROLE = "agentr1proberole"

ToolSpecs = Sequence[Mapping[str, Any]]


def encode_conversation(tokenizer, messages: Sequence[ChatMessage], tools: ToolSpecs | None = None) -> list[int]:
    """Ids of `messages` rendered by the chat template, ending with the generation prompt.

    With `tools` the template renders the tool list itself (`tools=`); a template that ignores
    `tools=` is refused with ValueError: put the format's system_prompt into the system message
    with `agent_core.envs.tool_env.add_instructions` instead. Contents are encoded as plain text (module docstring).
    The template's text is encoded without the tokenizer's automatic special tokens, so a BOS is
    present only if the template itself writes one (what apply_chat_template does too).
    """
    if not messages:
        raise ValueError("encode_conversation needs at least one message")
    tools = _checked_tools(tokenizer, tools)
    return _encode_segments(tokenizer, _rendered_segments(tokenizer, messages, tools))


def encode_observation_messages(
    tokenizer, messages: Sequence[ChatMessage], action_ended_with_eos: bool, tools: ToolSpecs | None = None
) -> list[int]:
    """Ids that follow an assistant action: end of its turn, the observation turn(s), the next prompt.

    With `context` = encode_conversation(conversation, tools) and `action` = ids of an assistant
    turn that ended with its end-of-turn token, context + action + these ids equal
    encode_conversation(conversation + [assistant action, *messages], tools), token for token.
    If the action was cut by the length budget (action_ended_with_eos=False), the ids start with
    the end-of-turn token it did not produce. Contents are encoded as plain text.
    """
    if not messages:
        raise ValueError("encode_observation_messages needs at least one observation message")
    tools = _checked_tools(tokenizer, tools)
    end_of_turn, glue = _segments_after_action(tokenizer, messages, tools)
    ids = _encode_segments(tokenizer, glue)
    if not action_ended_with_eos:
        ids = [tokenizer.convert_tokens_to_ids(end_of_turn), *ids]
    return ids


def encode_observation(tokenizer, role: str, content: str, action_ended_with_eos: bool) -> list[int]:
    """encode_observation_messages for a single observation message `role: content`."""
    return encode_observation_messages(tokenizer, [ChatMessage(role, content)], action_ended_with_eos)


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools=`: a probe tool's name appears in its rendering."""
    probe = {"type": "function", "function": {"name": _PROBE_TOOL_NAME, "description": "probe", "parameters": {}}}
    text = _try_render(tokenizer, [{"role": "user", "content": "hi"}], [probe])
    return text is not None and _PROBE_TOOL_NAME in text


def template_supports_tool_role(tokenizer) -> bool:
    """Whether the chat template has its own rendering for "tool" messages.

    The probe renders [user, assistant, tool: marker] and the same with a made-up role in place of
    "tool". A template that renders any role generically (ChatML's "<|im_start|>" + role) gives
    the same text with the role name swapped: it has no tool role, and a "tool" turn would reach a
    model that never saw one. A template with a tool branch (Qwen2.5 wraps it in a user turn) or
    one that refuses unknown roles renders them differently. A template that fails on the tool
    message, or drops its content, does not support it either.
    """

    def conversation(role: str) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": _DUMMY_QUESTION},
            {"role": "assistant", "content": _ACTION_MARKER},
            {"role": role, "content": "AGENTR1TOOLRESULTMARKER"},
        ]

    as_tool = _try_render(tokenizer, conversation("tool"), None)
    if as_tool is None or "AGENTR1TOOLRESULTMARKER" not in as_tool:
        return False
    as_made_up = _try_render(tokenizer, conversation(_PROBE_ROLE), None)
    return as_made_up is None or as_made_up.replace(_PROBE_ROLE, "tool") != as_tool


def eos_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids that end an assistant turn: the tokenizer's eos, plus <|im_end|> if distinct and present."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if _EXTRA_END_OF_TURN in tokenizer.get_vocab():
        extra = tokenizer.convert_tokens_to_ids(_EXTRA_END_OF_TURN)
        if extra not in ids:
            ids.append(extra)
    if not ids:
        raise ValueError("the tokenizer has neither an eos token nor <|im_end|>; set tokenizer.eos_token")
    return tuple(ids)


# ---- rendering -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    """A piece of a rendering: the template's glue, or the (rendered) content of message `index`."""

    text: str
    index: int | None = None  # None for glue

    @property
    def is_content(self) -> bool:
        return self.index is not None


def _require_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template")


def _render(tokenizer, messages: list[dict[str, str]], tools: ToolSpecs | None = None) -> str:
    _require_template(tokenizer)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def _try_render(tokenizer, messages: list[dict[str, str]], tools: ToolSpecs | None) -> str | None:
    """The rendering, or None where the template refuses it. No template at all is a setup error."""
    _require_template(tokenizer)
    try:
        return _render(tokenizer, messages, tools)
    except Exception:  # noqa: BLE001 - templates raise anything (jinja errors, raise_exception)
        return None


def _checked_tools(tokenizer, tools: ToolSpecs | None) -> list[Mapping[str, Any]] | None:
    if not tools:
        return None
    if not template_supports_tools(tokenizer):
        names = [_tool_label(spec) for spec in tools]
        raise ValueError(
            f"the chat template of {type(tokenizer).__name__} ignores tools= (tools {', '.join(names)}); "
            "put the format's system_prompt(tools) into the system message (agent_core.envs.tool_env.add_instructions)"
        )
    return list(tools)


def _tool_label(spec: Any) -> str:
    function = spec.get("function", spec) if isinstance(spec, Mapping) else None
    return str(function.get("name")) if isinstance(function, Mapping) else repr(spec)


def _rendered_segments(tokenizer, messages: Sequence[ChatMessage], tools: ToolSpecs | None) -> list[_Segment]:
    """The rendering of `messages`, split into glue and contents (see the module docstring)."""
    real = [m.as_dict() for m in messages]
    marked = [{**m, "content": f"AGENTR1CONTENT{i}MARKER7F3A"} for i, m in enumerate(real)]
    text = _render(tokenizer, real, tools)
    pieces = _CONTENT_MARKER.split(_render(tokenizer, marked, tools))  # glue, index, glue, ..., glue
    segments, position = [], 0
    for k in range(0, len(pieces), 2):
        glue = pieces[k]
        if not text.startswith(glue, position):
            raise ValueError("the chat template renders different glue when the contents change; cannot split it")
        segments.append(_Segment(glue))
        position += len(glue)
        if k + 1 < len(pieces):
            index, next_glue = int(pieces[k + 1]), pieces[k + 2]
            rendered = _rendered_content(text, position, messages[index], index, next_glue, k + 3 == len(pieces))
            segments.append(_Segment(rendered, index))
            position += len(rendered)
    return segments


def _rendered_content(text: str, at: int, message: ChatMessage, index: int, next_glue: str, is_last: bool) -> str:
    """How the template wrote `message`'s content at `at`: as is, or trimmed (templates' `| trim`)."""
    for candidate in dict.fromkeys((message.content, message.content.strip())):
        end = at + len(candidate)
        if text.startswith(candidate, at) and text.startswith(next_glue, end):
            if not is_last or end + len(next_glue) == len(text):
                return candidate
    raise ValueError(
        f"the chat template rewrites the content of message {index} ({message.role}) other than by trimming it; "
        "cannot tell its text from the template's glue"
    )


def _segments_after_action(tokenizer, messages: Sequence[ChatMessage], tools) -> tuple[str, list[_Segment]]:
    """(end-of-turn token, segments after it) in the rendering of [user, assistant, *messages]."""
    dummy = [ChatMessage("user", _DUMMY_QUESTION), ChatMessage("assistant", _ACTION_MARKER), *messages]
    segments = _rendered_segments(tokenizer, dummy, tools)
    at = next((k for k, segment in enumerate(segments) if segment.index == 1), None)
    if at is None:
        raise ValueError("the chat template dropped the assistant turn; cannot derive the observation glue")
    after = segments[at + 1 :]
    following = after[0].text if after and not after[0].is_content else ""
    for token_id in eos_token_ids(tokenizer):
        end_of_turn = tokenizer.convert_ids_to_tokens(token_id)
        if following.startswith(end_of_turn):
            return end_of_turn, [_Segment(following[len(end_of_turn) :]), *after[1:]]
    ends = [tokenizer.convert_ids_to_tokens(i) for i in eos_token_ids(tokenizer)]
    raise ValueError(
        f"the chat template does not end an assistant turn with one of the end-of-turn tokens {ends}; "
        f"it renders {following[:40]!r} after the assistant's content"
    )


def _encode_segments(tokenizer, segments: Sequence[_Segment]) -> list[int]:
    """Ids of the segments: the glue's special tokens as tokens, every other text as plain text."""
    special = _special_tokens_pattern(tokenizer)
    ids: list[int] = []
    run: list[str] = []
    for segment in segments:
        parts = [segment.text] if segment.is_content or special is None else special.split(segment.text)
        for k, part in enumerate(parts):
            if k % 2 == 0:
                run.append(part)
                continue
            ids += _encode_plain(tokenizer, "".join(run))
            ids.append(tokenizer.convert_tokens_to_ids(part))
            run = []
    ids += _encode_plain(tokenizer, "".join(run))
    # The fast tokenizer's backend keeps the flag of the last call; put back the tokenizer's own setting
    # for code that calls the backend directly.
    own_setting = getattr(tokenizer, "split_special_tokens", False)
    tokenizer.encode("", add_special_tokens=False, split_special_tokens=own_setting)
    return ids


def _encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


def _special_tokens_pattern(tokenizer) -> re.Pattern | None:
    """Matches the added tokens marked special (the ones split_special_tokens=True stops matching)."""
    special = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    if not special:
        return None
    # Longest first, so a token that is a prefix of another never wins the match.
    alternatives = "|".join(re.escape(token) for token in sorted(special, key=len, reverse=True))
    return re.compile(f"({alternatives})")
