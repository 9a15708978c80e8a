"""Token-in/token-out chat rendering (agent_core/rollout/chat.py) with a real trained tokenizer."""

from __future__ import annotations

import copy

import pytest

from agent_core.rollout.chat import encode_conversation, encode_observation, eos_token_ids
from agent_core.training.model import IM_END, PAD, build_tokenizer
from agent_core.types import ChatMessage

TEXTS = [
    "Answer the question. Use <search>query</search> to search and <answer>x</answer> to answer.",
    "Who directed The Silent Harbor? <information>Doc 1: directed by Ana Kowalski.</information>",
    "Where was Ana Kowalski born? <answer>Gdansk</answer>",
] * 20

OPENING = (
    ChatMessage("system", "Answer the question. Use <search>query</search> to search."),
    ChatMessage("user", "Where was the director of The Silent Harbor born?"),
)
# (action text, observation role, observation text): one 3-turn episode
TURNS = (
    (
        "<search>The Silent Harbor director</search>",
        "user",
        "<information>Doc 1: directed by Ana Kowalski.</information>",
    ),
    ("<search>Ana Kowalski born</search>", "tool", "<information> Doc 7: born in Gdansk, 1950.\n</information>"),
    ("I think it is Gdansk.", "user", "Please answer with tags."),
)

# A Qwen2.5-like ChatML template: a default system prompt, and tool turns wrapped as user turns.
QWEN_LIKE_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=400)


@pytest.fixture(scope="module")
def qwen_like(tokenizer):
    other = copy.deepcopy(tokenizer)
    other.chat_template = QWEN_LIKE_TEMPLATE
    return other


def _action_ids(tokenizer, text: str, with_eos: bool) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] if with_eos else ids


def _run_episode(tokenizer, opening, turns, ended_with_eos=True):
    """Build the context incrementally as the agent loop does; return it and the full conversation."""
    context = encode_conversation(tokenizer, opening)
    messages = list(opening)
    for action, role, observation in turns:
        context += _action_ids(tokenizer, action, ended_with_eos)
        context += encode_observation(tokenizer, role, observation, ended_with_eos)
        messages += [ChatMessage("assistant", action), ChatMessage(role, observation)]
    return context, messages


def test_encode_conversation_matches_the_template(tokenizer):
    ids = encode_conversation(tokenizer, OPENING)
    messages = [m.as_dict() for m in OPENING]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids) == rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]  # no doubled BOS
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def test_incremental_episode_equals_full_rendering(tokenizer):
    context, messages = _run_episode(tokenizer, OPENING, TURNS)
    assert context == encode_conversation(tokenizer, messages)


def test_observation_ids_are_the_turn_glue(tokenizer):
    ids = encode_observation(tokenizer, "tool", "<information>d</information>", action_ended_with_eos=True)
    expected = "\n<|im_start|>tool\n<information>d</information><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == expected


def test_truncated_action_gets_the_end_of_turn_it_did_not_produce(tokenizer):
    ended = encode_observation(tokenizer, "user", "go on", action_ended_with_eos=True)
    truncated = encode_observation(tokenizer, "user", "go on", action_ended_with_eos=False)
    assert truncated == [tokenizer.eos_token_id, *ended]
    context, messages = _run_episode(tokenizer, OPENING, TURNS[:2], ended_with_eos=False)
    assert context == encode_conversation(tokenizer, messages)


def test_glue_follows_another_chatml_like_template(qwen_like):
    opening = OPENING[1:]  # no system message: the template adds its default one
    context, messages = _run_episode(qwen_like, opening, TURNS)
    assert context == encode_conversation(qwen_like, messages)
    glue = qwen_like.decode(encode_observation(qwen_like, "tool", "doc", action_ended_with_eos=True))
    assert glue == "\n<|im_start|>user\n<tool_response>\ndoc\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_eos_token_ids(tokenizer):
    assert eos_token_ids(tokenizer) == (tokenizer.convert_tokens_to_ids(IM_END),)
    other = copy.deepcopy(tokenizer)
    other.eos_token = PAD  # a tokenizer whose eos is not the end-of-turn token
    assert eos_token_ids(other) == (other.convert_tokens_to_ids(PAD), other.convert_tokens_to_ids(IM_END))


def test_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="at least one message"):
        encode_conversation(tokenizer, [])
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        encode_conversation(bare, OPENING)
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor -%}"
    with pytest.raises(ValueError, match="end-of-turn tokens"):
        encode_observation(odd, "user", "x", action_ended_with_eos=True)
