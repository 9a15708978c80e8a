"""Token-in/token-out chat rendering for multi-turn episodes.

An episode's context grows by appending ids: context + sampled action ids + observation ids. For
training to see exactly what the policy saw, and for a packed episode to equal the chat template's
rendering of the whole conversation, the observation ids must carry the template's own turn glue
(end of the assistant turn, the observation turn, the next generation prompt).

The glue is not hard-coded for ChatML: `encode_observation` renders a dummy conversation through
the tokenizer's chat template and keeps what follows the assistant's end-of-turn token, so any
ChatML-like template (ours, SmolLM2's, Qwen2.5's tool turns) works. Templates that rewrite earlier
assistant turns when a later turn is added (e.g. ones that strip reasoning from history) cannot be
rendered incrementally at all; for them the ids still follow the template's glue for the new turn.
"""

from __future__ import annotations

from typing import Sequence

from agent_core.types import ChatMessage

_EXTRA_END_OF_TURN = "<|im_end|>"
# Stands in for the assistant's action when rendering the dummy conversation; it must survive
# templates that trim content, hence no whitespace and no markup.
_ACTION_MARKER = "AGENTR1ACTIONMARKER7F3A"
_DUMMY_QUESTION = "AGENTR1QUESTIONMARKER"


def encode_conversation(tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Ids of `messages` rendered by the chat template, ending with the generation prompt.

    The template's text is encoded without the tokenizer's automatic special tokens, so a BOS is
    present only if the template itself writes one (what apply_chat_template does too).
    """
    if not messages:
        raise ValueError("encode_conversation needs at least one message")
    text = _render(tokenizer, [m.as_dict() for m in messages])
    return tokenizer.encode(text, add_special_tokens=False)


def encode_observation(tokenizer, role: str, content: str, action_ended_with_eos: bool) -> list[int]:
    """Ids that follow an assistant action: end of its turn, the observation turn, the next prompt.

    With `context` = encode_conversation(messages) and `action` = ids of an assistant turn that
    ended with its end-of-turn token, context + action + encode_observation(...) equals the
    template's rendering of messages + [assistant action, role: content] with the generation
    prompt, token for token. If the action was cut by the length budget
    (action_ended_with_eos=False), the ids start with the end-of-turn token it did not produce.
    """
    end_of_turn, glue = _glue_after_action(tokenizer, role, content)
    # The text after a special/added token is tokenized independently of what precedes it, so
    # encoding the suffix alone gives the same ids as encoding the full rendering.
    ids = tokenizer.encode(glue, add_special_tokens=False)
    if not action_ended_with_eos:
        ids = [tokenizer.convert_tokens_to_ids(end_of_turn), *ids]
    return ids


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


def _render(tokenizer, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _glue_after_action(tokenizer, role: str, content: str) -> tuple[str, str]:
    """(end-of-turn token, text after it) in the rendering of [user, assistant, role: content]."""
    messages = [
        {"role": "user", "content": _DUMMY_QUESTION},
        {"role": "assistant", "content": _ACTION_MARKER},
        {"role": role, "content": content},
    ]
    text = _render(tokenizer, messages)
    at = text.find(_ACTION_MARKER)
    if at < 0:
        raise ValueError("the chat template dropped the assistant turn; cannot derive the observation glue")
    after_action = text[at + len(_ACTION_MARKER):]
    for token_id in eos_token_ids(tokenizer):
        end_of_turn = tokenizer.convert_ids_to_tokens(token_id)
        if after_action.startswith(end_of_turn):
            return end_of_turn, after_action[len(end_of_turn):]
    ends = [tokenizer.convert_ids_to_tokens(i) for i in eos_token_ids(tokenizer)]
    raise ValueError(
        f"the chat template does not end an assistant turn with one of the end-of-turn tokens {ends}; "
        f"it renders {after_action[:40]!r} after the assistant's content"
    )
