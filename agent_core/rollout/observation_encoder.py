"""Observation ids at one tokenizer call per step: `chat.encode_observation_messages` with its glue cached.

`ObservationEncoder` works out the template's glue once per kind of observation (roles, tools, which contents
are empty or whitespace only), a `_Plan`, with the reference's own code on probe contents; a step then encodes
all its text runs in one batched call. What the reference cannot split goes through the reference. The one
assumption beyond the reference's: a template's glue depends on a content's text only through its emptiness.
Design notes: docs/architecture.md §11 (agent_core/rollout/observation_encoder.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from agent_core.rollout.chat import (  # the reference's own helpers: both paths cut glue the same way
    ToolSpecs,
    _checked_tools,
    _segments_after_action,
    _special_tokens_pattern,
    encode_observation_messages,
)
from agent_core.types import ChatMessage

_PROBE = "AGENTR1OBSERVATIONPROBE{}X7F3A"
_EMPTY, _BLANK, _TEXT = 0, 1, 2  # a content's kind: "", whitespace only, anything else


@dataclass(frozen=True)
class _Slot:
    """Where message `index`'s content goes; `trims`: the template writes it stripped."""

    index: int
    trims: bool


@dataclass(frozen=True)
class _Plan:
    end_of_turn_id: int
    pieces: tuple[str | int | _Slot, ...]  # glue text, a special token's id (ends a text run), a content slot


class ObservationEncoder:
    """`encode_observation_messages(tokenizer, ...)`, token for token, with one tokenizer call per step.

    One per rollout (plans are per tokenizer and template, which do not change during one); used
    from one thread.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._plans: dict[tuple, _Plan | None] = {}
        self._tool_keys: dict[int, tuple[Any, str]] = {}  # id(tools) -> (tools, key): tools lists are per env

    def encode(self, messages: Sequence[ChatMessage], action_ended_with_eos: bool,
               tools: ToolSpecs | None = None) -> list[int]:
        """Ids that follow an assistant action (see `chat.encode_observation_messages`)."""
        if not messages:
            raise ValueError("encode_observation_messages needs at least one observation message")
        key = (tuple(m.role for m in messages), tuple(_content_kind(m.content) for m in messages),
               self._tools_key(tools))
        if key not in self._plans:
            self._plans[key] = _build_plan(self.tokenizer, messages, tools)  # raises as the reference does
        plan = self._plans[key]
        if plan is None:
            return encode_observation_messages(self.tokenizer, messages, action_ended_with_eos, tools)
        ids = _encode_with_plan(self.tokenizer, plan, messages)
        return ids if action_ended_with_eos else [plan.end_of_turn_id, *ids]

    def _tools_key(self, tools: ToolSpecs | None) -> str | None:
        if not tools:
            return None
        known = self._tool_keys.get(id(tools))
        if known is not None and known[0] is tools:
            return known[1]
        key = json.dumps(list(tools), default=repr)
        self._tool_keys[id(tools)] = (tools, key)  # holding `tools` keeps its id from being reused
        return key


def _content_kind(content: str) -> int:
    return _EMPTY if not content else _BLANK if content.isspace() else _TEXT


def _build_plan(tokenizer, messages: Sequence[ChatMessage], tools: ToolSpecs | None) -> _Plan | None:
    """The plan for observations like `messages`, or None where the reference cannot split them."""
    checked = _checked_tools(tokenizer, tools)  # a template that ignores tools= is refused here too
    # Probes: "" and whitespace-only contents as they are, other contents as a marker padded with
    # whitespace, which a trimming template writes without it.
    probes = [m.content if _content_kind(m.content) != _TEXT else f" \n{_PROBE.format(i)}\n " for i, m in
              enumerate(messages)]
    try:
        end_of_turn, segments = _segments_after_action(
            tokenizer, [ChatMessage(m.role, probe) for m, probe in zip(messages, probes)], checked)
    except ValueError:
        return None
    special = _special_tokens_pattern(tokenizer)
    pieces: list[str | int | _Slot] = []
    for segment in segments:
        if segment.is_content:
            index = segment.index - 2  # segments count the probe's [user, assistant] before the messages
            if index < 0:  # a template that writes earlier contents after the action: leave it to the reference
                return None
            pieces.append(_Slot(index, trims=segment.text != probes[index]))
            continue
        parts = [segment.text] if special is None else special.split(segment.text)
        for k, part in enumerate(parts):  # odd parts are the special tokens the split kept
            pieces.append(tokenizer.convert_tokens_to_ids(part) if k % 2 else part)
    return _Plan(tokenizer.convert_tokens_to_ids(end_of_turn), tuple(pieces))


def _encode_with_plan(tokenizer, plan: _Plan, messages: Sequence[ChatMessage]) -> list[int]:
    """The plan's glue with `messages`' contents in its slots: the same text runs, cut at the same
    special tokens, as the reference's `_encode_segments` builds, encoded in one batched call."""
    runs: list[list[str]] = [[]]
    specials: list[int] = []
    for piece in plan.pieces:
        if isinstance(piece, str):
            runs[-1].append(piece)
        elif isinstance(piece, int):
            specials.append(piece)
            runs.append([])
        else:
            content = messages[piece.index].content
            runs[-1].append(content.strip() if piece.trims else content)
    texts = ["".join(run) for run in runs]
    encoded = iter(_encode_plain_batch(tokenizer, [text for text in texts if text]))
    ids: list[int] = []
    for k, text in enumerate(texts):
        if text:
            ids += next(encoded)
        if k < len(specials):
            ids.append(specials[k])
    return ids


def _encode_plain_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids with special-token matching off (contents stay text), as one call."""
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, return_attention_mask=False,
                    return_token_type_ids=False)["input_ids"]
    # A fast tokenizer's backend keeps the last call's flag; put back the tokenizer's own setting for
    # code that calls the backend directly (what the reference does with a second encode call).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    own_setting = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend is not None and getattr(backend, "encode_special_tokens", own_setting) != own_setting:
        backend.encode_special_tokens = own_setting
    return ids
