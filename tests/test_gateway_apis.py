"""The APIs agents use, through their official clients against the real gateway: chat completions
streamed, tool_choice and parallel_tool_calls honoured by what is generated, log-probs returned,
fields the gateway does not serve refused by name; OpenAI's Responses API and Anthropic's Messages
API over the same episode recording (an agent's appended history packs whichever API it speaks)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from agent_core.gateway import Gateway, GatewayLimits  # noqa: E402
from agent_core.gateway.steps import EpisodeEnd, EpisodeIdentity, steps_from_calls  # noqa: E402
from agent_core.rollout.chat import eos_token_ids  # noqa: E402
from tests.test_gateway import TOOLS, ScriptedEngine, _client, _sampling, engine, tokenizer  # noqa: E402,F401

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "Harbor"}}\n</tool_call>'
LIMITS = GatewayLimits(max_calls=4, max_context_tokens=2048)
QUESTION = [{"role": "user", "content": "Who directed Harbor?"}]


def _served(tokenizer, text: str, **request):
    """(the reply through the real client, the episode's recorded calls, the engine) for one request."""
    engine = ScriptedEngine(tokenizer, text)
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        reply = _client(gateway, token).chat.completions.create(model="policy", messages=QUESTION, **request)
        calls = gateway.finish_episode(token)
    return reply, calls, engine


def test_a_streamed_reply_is_the_same_completion_and_the_same_recording(tokenizer):
    engine = ScriptedEngine(tokenizer, "Let me look. " + CALL)
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = _client(gateway, token)
        plain = client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
        chunks = list(client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, stream=True,
                                                     stream_options={"include_usage": True}))
        calls = gateway.finish_episode(token).calls
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == plain.choices[0].message.content == "Let me look."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed_calls] == [("search", {"query": "Harbor"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == len(engine.ids)
    assert len(calls) == 2 and calls[0].response_ids == calls[1].response_ids == engine.ids


def test_tool_choice_required_and_named_put_the_calls_opening_in_the_prompt(tokenizer):
    rest = '{"name": "search", "arguments": {"query": "Harbor"}}\n</tool_call>'
    reply, calls, engine = _served(tokenizer, rest, tools=TOOLS, tool_choice="required")
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "search" and reply.choices[0].finish_reason == "tool_calls"
    opening = tokenizer.encode("<tool_call>\n", add_special_tokens=False)
    assert engine.prompts[0][-len(opening):] == opening  # the policy wrote only what follows
    assert calls.calls[0].prompt_ids[-len(opening):] == opening and calls.calls[0].response_ids == engine.ids
    reply, calls, engine = _served(tokenizer, '{"query": "Harbor"}}\n</tool_call>', tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "search"}})
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"query": "Harbor"}
    assert tokenizer.decode(engine.prompts[0]).endswith('<tool_call>\n{"name": "search", "arguments": ')
    # auto (the default) forces nothing; none offers no tools and parses no call
    _, _, engine = _served(tokenizer, CALL, tools=TOOLS)
    assert not tokenizer.decode(engine.prompts[0]).endswith("<tool_call>\n")
    reply, _, engine = _served(tokenizer, CALL, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and "search the corpus" not in tokenizer.decode(engine.prompts[0])
    with pytest.raises(openai.BadRequestError, match="'lookup', which is not among the tools offered"):
        _served(tokenizer, CALL, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}})


def test_parallel_tool_calls_false_ends_the_reply_and_the_recorded_ids_after_the_first_call(tokenizer):
    two = CALL + "\n" + CALL.replace("Harbor", "Ana")
    reply, calls, engine = _served(tokenizer, two, tools=TOOLS)
    assert len(reply.choices[0].message.tool_calls) == 2
    reply, calls, engine = _served(tokenizer, two, tools=TOOLS, parallel_tool_calls=False)
    (only,) = reply.choices[0].message.tool_calls
    assert json.loads(only.function.arguments) == {"query": "Harbor"}
    (call,) = calls.calls
    assert tokenizer.decode(call.response_ids).endswith("</tool_call>") and len(call.response_ids) < len(engine.ids)
    assert call.response_ids == engine.ids[:len(call.response_ids)]
    assert len(call.response_logprobs) == len(call.response_ids)


def test_logprobs_are_returned_when_asked_and_are_the_recorded_ones(engine, tokenizer):
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = _client(gateway, token)
        without = client.chat.completions.create(model="policy", messages=QUESTION)
        reply = client.chat.completions.create(model="policy", messages=QUESTION, logprobs=True)
        calls = gateway.finish_episode(token).calls
    assert without.choices[0].logprobs is None
    returned = reply.choices[0].logprobs.content
    assert [t.logprob for t in returned] == pytest.approx(calls[1].response_logprobs)
    assert "".join(t.token for t in returned).strip() == reply.choices[0].message.content.strip()


def test_a_field_the_gateway_does_not_serve_is_refused_by_name_never_ignored(tokenizer):
    for request, named in (({"response_format": {"type": "json_object"}}, "response_format"),
                           ({"extra_body": {"best_of": 3}}, "best_of"),
                           ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
                           ({"frequency_penalty": 0.5}, "frequency_penalty")):
        with pytest.raises(openai.BadRequestError, match=named):
            _served(tokenizer, "Ana", **request)
    _, calls, _ = _served(tokenizer, "Ana", seed=3, frequency_penalty=0, response_format={"type": "text"})
    assert json.loads(calls.calls[0].requested) == {"seed": 3}  # recorded: the run's seeding decides


def test_the_responses_api_serves_the_same_recording_and_an_appended_turn_packs(tokenizer):
    engine = ScriptedEngine(tokenizer, CALL)
    tools = [{"type": "function", "name": "search", "description": "search the corpus",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = _client(gateway, token)
        first = client.responses.create(model="policy", instructions="Answer briefly.", input="Who directed Harbor?",
                                        tools=tools)
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "search" and json.loads(call.arguments) == {"query": "Harbor"}
        history = [{"role": "user", "content": "Who directed Harbor?"}, *[i.model_dump(exclude_none=True) for i in first.output],
                   {"type": "function_call_output", "call_id": call.call_id, "output": "Harbor was directed by Ana."}]
        second = client.responses.create(model="policy", instructions="Answer briefly.", input=history, tools=tools)
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            client.responses.create(model="policy", input="and?", previous_response_id=first.id)
        calls = gateway.finish_episode(token)
    assert second.usage.output_tokens == len(engine.ids)
    assert "Answer briefly." in tokenizer.decode(calls.calls[0].prompt_ids)
    rows = steps_from_calls(EpisodeIdentity("ep", "g", "p", 0, 0), calls, EpisodeEnd("Ana", None, {}), tokenizer)
    assert [r.history for r in rows] == ["start", "appended"]  # the tool result appended to what it was sent
    assert "Harbor was directed by Ana." in rows[0].observation_text


def test_anthropics_messages_api_through_its_client_serves_the_same_recording(tokenizer):
    engine = ScriptedEngine(tokenizer, "Let me look. " + CALL)
    tools = [{"name": "search", "description": "search the corpus", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = anthropic.Anthropic(base_url=gateway.root_url, api_key=token, max_retries=0, timeout=30)
        question = {"role": "user", "content": "Who directed Harbor?"}
        first = client.messages.create(model="policy", max_tokens=10, system="Answer briefly.", messages=[question],
                                       tools=tools)
        assert first.stop_reason == "tool_use" and first.content[0].text == "Let me look."
        use = first.content[1]
        assert (use.name, use.input) == ("search", {"query": "Harbor"})
        turn = [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "Harbor was directed by Ana."}]}]
        client.messages.create(model="policy", max_tokens=10, system="Answer briefly.", messages=[question, *turn],
                               tools=tools, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        with pytest.raises(anthropic.BadRequestError, match="top_k"):
            client.messages.create(model="policy", max_tokens=10, messages=[question], extra_body={"top_k": 5})
        with pytest.raises(anthropic.AuthenticationError, match="unknown or finished episode token"):
            anthropic.Anthropic(base_url=gateway.root_url, api_key="agr1-not-a-token", max_retries=0,
                                timeout=30).messages.create(model="policy", max_tokens=5, messages=[question])
        calls = gateway.finish_episode(token)
    rows = steps_from_calls(EpisodeIdentity("ep", "g", "p", 0, 0), calls, EpisodeEnd("Ana", None, {}), tokenizer)
    assert [r.history for r in rows] == ["start", "appended"] and len(calls.calls) == 2
    assert "Answer briefly." in tokenizer.decode(calls.calls[0].prompt_ids)


def test_a_call_names_its_agent_by_header_or_user_field_and_a_bad_name_is_refused(tokenizer):
    with Gateway(ScriptedEngine(tokenizer, "Ana"), tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = _client(gateway, token)
        client.chat.completions.create(model="policy", messages=QUESTION, user="solver")
        client.chat.completions.create(model="policy", messages=QUESTION, extra_headers={"X-AgentR1-Agent": "planner"})
        client.chat.completions.create(model="policy", messages=QUESTION)
        with pytest.raises(openai.BadRequestError, match="agent name 'two words'"):
            client.chat.completions.create(model="policy", messages=QUESTION, user="two words")
        calls = gateway.finish_episode(token)
    assert [c.agent for c in calls.calls] == ["solver", "planner", None]
    rows = steps_from_calls(EpisodeIdentity("ep", "g", "p", 0, 0), calls, EpisodeEnd("Ana", None, {}), tokenizer)
    assert sorted((r.episode_id, r.group_id) for r in rows) == [("ep", "g"), ("ep@planner", "g@planner"),
                                                                 ("ep@solver", "g@solver")]


def test_a_tool_message_reporting_an_error_marks_the_call_failed_for_the_audit(tokenizer):
    engine = ScriptedEngine(tokenizer, CALL + "\n" + CALL.replace("Harbor", "Ana"))
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = _client(gateway, token)
        reply = client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
        first, second = reply.choices[0].message.tool_calls
        messages = [*QUESTION, reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": first.id, "content": "Harbor was directed by Ana."},
                    {"role": "tool", "tool_call_id": second.id, "content": '{"error": "no page named Ana"}'}]
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        claude = anthropic.Anthropic(base_url=gateway.root_url, api_key=token, max_retries=0, timeout=30)
        tools = [{"name": "search", "input_schema": TOOLS[0]["function"]["parameters"]}]
        question = {"role": "user", "content": "Who directed Harbor?"}
        use = claude.messages.create(model="policy", max_tokens=60, messages=[question], tools=tools).content[0]
        claude.messages.create(model="policy", max_tokens=60, tools=tools, messages=[
            question, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "timeout",
                                          "is_error": True}]}])
        calls = gateway.finish_episode(token).calls
    assert [c.get("ok") for c in json.loads(calls[0].tool_calls)] == [True, False]
    assert [c.get("ok") for c in json.loads(calls[2].tool_calls)] == [False, None]  # only the first was answered
    assert all("ok" not in c for c in json.loads(calls[3].tool_calls))  # no result sent back: not judged


def test_a_streamed_responses_request_gets_the_events_the_client_assembles(tokenizer):
    engine = ScriptedEngine(tokenizer, "Let me look. " + CALL)
    tools = [{"type": "function", "name": "search", "parameters": TOOLS[0]["function"]["parameters"]}]
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = _client(gateway, token)
        events = list(client.responses.create(model="policy", input="Who directed Harbor?", tools=tools, stream=True))
        with client.responses.stream(model="policy", input="Who directed Harbor?", tools=tools) as stream:
            final = stream.get_final_response()
        calls = gateway.finish_episode(token).calls
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me look."
    assert final.output_text == "Let me look."
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"query": "Harbor"} and len(calls) == 2


def test_a_streamed_messages_request_gets_the_events_the_anthropic_client_assembles(tokenizer):
    engine = ScriptedEngine(tokenizer, "Let me look. " + CALL)
    tools = [{"name": "search", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with Gateway(engine, tokenizer, _sampling(tokenizer), LIMITS) as gateway:
        token = gateway.open_episode("ep")
        client = anthropic.Anthropic(base_url=gateway.root_url, api_key=token, max_retries=0, timeout=30)
        with client.messages.stream(model="policy", max_tokens=60, tools=tools,
                                    messages=[{"role": "user", "content": "Who directed Harbor?"}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        calls = gateway.finish_episode(token).calls
    assert text == "Let me look." and final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("text", None),
                                                                           ("tool_use", {"query": "Harbor"})]
    assert final.usage.output_tokens == len(engine.ids) and len(calls) == 1
