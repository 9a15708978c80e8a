"""The gateway against hostile bodies, through the real server over HTTP: a request that cannot fit the
context is refused before anything is tokenized, an episode that keeps sending refused requests gets
429 at once, every malformed body gets a one-line 4xx and leaves no traceback in the log, a generated
call with NaN arguments never puts bare NaN in a reply, and a call whose client disconnected is not
recorded (docs/architecture.md §6, the gateway)."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

from agent_core.gateway import Gateway, GatewayLimits
from agent_core.gateway.core import longest_token_chars
from tests.test_gateway import TOOLS, ScriptedEngine, _sampling, tokenizer  # noqa: F401

CONTEXT = 256
QUESTION = [{"role": "user", "content": "Who directed Harbor?"}]
NAN_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": NaN, "k": Infinity}}\n</tool_call>'


class _Counting:
    """Counts the tokenizer's tokenizing calls (the work a refused request must not cost)."""

    def __init__(self, tokenizer, monkeypatch):
        self.calls = 0
        for name in ("encode", "apply_chat_template", "__call__"):
            monkeypatch.setattr(tokenizer, name, self._counted(getattr(tokenizer, name)), raising=False)

    def _counted(self, method):
        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)
        return counted


class _Log(logging.Handler):
    """Every record of the gateway's and uvicorn's loggers (uvicorn's do not reach the root logger)."""

    NAMES = ("", "uvicorn", "uvicorn.error", "uvicorn.asgi")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        logging.getLogger("agent_core.gateway.server").setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)
        logging.getLogger("agent_core.gateway.server").setLevel(logging.NOTSET)

    def tracebacks(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.exc_info or "Traceback" in r.getMessage()
                or r.levelno >= logging.ERROR]


@pytest.fixture
def served(tokenizer):
    """A running gateway over an engine that answers "The answer is Ana.", logs captured."""
    engine = ScriptedEngine(tokenizer, "The answer is Ana.")
    limits = GatewayLimits(max_calls=4, max_context_tokens=CONTEXT)
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits) as gateway, _Log() as log:
        gateway.log = log
        yield gateway


def _post(gateway: Gateway, body, token: str, path: str = "/v1/chat/completions",
          headers: dict | None = None) -> tuple[int, bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    connection.request("POST", path, body=raw, headers={"Content-Type": "application/json", "x-api-key": token,
                                                        "Authorization": f"Bearer {token}", **(headers or {})})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, payload


def _strict(text: str | bytes):
    """json.loads that refuses NaN and Infinity, as JSON itself does."""
    def refuse(constant):
        raise ValueError(f"bare {constant} in the reply")
    return json.loads(text, parse_constant=refuse)


def _one_line_error(payload: bytes) -> str:
    message = _strict(payload)["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in message
    return message


def test_a_request_that_cannot_fit_the_context_is_refused_before_anything_is_tokenized(served, tokenizer,
                                                                                        monkeypatch):
    counting = _Counting(tokenizer, monkeypatch)
    token = served.open_episode("ep")
    many = [{"role": "user", "content": ""}] * 100_000
    tool_results = [{"type": "tool_result", "tool_use_id": f"t{i}", "content": ""} for i in range(CONTEXT + 1)]
    for path, body in (
            ("/v1/responses", {"input": [{"role": "user", "content": ""}] * (CONTEXT + 1)}),
            # one message whose blocks become CONTEXT + 1 tool messages: refused once converted
            ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": tool_results}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3_900_000}]}),
            ("/v1/chat/completions", {"messages": many}),
            ("/v1/responses", {"input": "word " * 780_000}),
            ("/v1/messages", {"max_tokens": 8, "messages": many})):
        status, payload = _post(served, body, token, path)
        assert status == 400 and "context" in _one_line_error(payload), (path, payload[:200])
        assert counting.calls == 0, f"{path}: tokenized before it was refused"
    assert served.core.engine.prompts == []
    # the counter sees tokenizing: a request that fits is tokenized and served
    assert _post(served, {"messages": QUESTION}, token)[0] == 200 and counting.calls > 0
    calls = served.finish_episode(token)
    assert calls.budget_hit == "max_context" and len(calls.calls) == 1


def test_the_character_bound_never_refuses_text_that_fits(tokenizer):
    """max_chars = context x the longest token: sound only if no token's text is longer than that."""
    longest = longest_token_chars(tokenizer)
    assert max(len(tokenizer.decode([i])) for i in range(len(tokenizer))) <= longest
    assert 1 < longest < 64


def test_an_episode_refused_max_refused_times_gets_429_at_once(tokenizer, monkeypatch):
    engine = ScriptedEngine(tokenizer, "The answer is Ana.")
    limits = GatewayLimits(max_calls=4, max_context_tokens=CONTEXT, max_refused=3)
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits, max_body_bytes=10_000) as gateway:
        token, other = gateway.open_episode("noisy"), gateway.open_episode("quiet")
        for body in (b"not json", b"x" * 20_000, {"messages": [{"role": "user", "content": "x" * 10 ** 4}]}):
            assert _post(gateway, body, token)[0] in (400, 413)
        counting = _Counting(tokenizer, monkeypatch)
        status, payload = _post(gateway, {"messages": QUESTION}, token)
        assert status == 429 and "refused 3 times" in _one_line_error(payload)
        assert counting.calls == 0 and engine.prompts == []
        assert _post(gateway, {"messages": QUESTION}, other)[0] == 200  # other episodes are served
        gateway.finish_episode(token)


def _assistant_call(arguments, call_id="c1") -> list[dict]:
    return [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "search", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "r"}]


MALFORMED = [
    ("/v1/chat/completions", {"messages": _assistant_call("[" * 200_000)}, None),
    ("/v1/chat/completions", {"messages": _assistant_call("[" * 150 + "]" * 150)}, None),
    ("/v1/chat/completions", {"messages": _assistant_call('{"a": 1}')[:2] + [
        {"role": "tool", "tool_call_id": ["x"], "content": "r"}]}, None),
    ("/v1/chat/completions", {"messages": _assistant_call('{"a": 1}')[:2] + [
        {"role": "tool", "tool_call_id": {}, "content": "r"}]}, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "q"}], "temperature": NaN}', None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "q"}], "metadata": {"x": -Infinity}}',
     None),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 200_000, None),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": json.loads("[" * 120 + "]" * 120)}}]}, None),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "search",
                                  "arguments": "[" * 200_000}]}, None),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": ["x"], "output": "r"}]}, None),
    ("/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "search",
                                           "input": json.loads('{"a":' * 500 + "1" + "}" * 500)}]}]}, None),
    ("/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": {"a": 1}, "content": [{"type": "x"}]}]}]},
     None),
    ("/v1/chat/completions", {"messages": QUESTION}, "."),
    ("/v1/chat/completions", {"messages": QUESTION}, ".."),
    ("/v1/chat/completions", {"messages": QUESTION}, "-"),
    ("/v1/chat/completions", {"messages": QUESTION, "user": ".."}, None),
    ("/v1/responses", {"input": "q", "metadata": {"agent": "."}}, None),
    ("/v1/chat/completions", {"messages": QUESTION}, "../etc"),
]


def test_every_malformed_body_gets_a_one_line_4xx_and_no_traceback_in_the_log(served):
    for n, (path, body, agent) in enumerate(MALFORMED):  # an episode each: refusals are counted per episode
        token = served.open_episode(f"ep-{n}")
        status, payload = _post(served, body, token, path, {"X-AgentR1-Agent": agent} if agent else None)
        assert 400 <= status < 500 and status != 429, (path, status, payload[:300])
        _one_line_error(payload)
    assert served.log.tracebacks() == []
    assert served.core.engine.prompts == []
    for agent in ("planner", "a.b-1", "0"):  # names that are safe still pass
        assert _post(served, {"messages": QUESTION}, token, headers={"X-AgentR1-Agent": agent})[0] == 200


class _Failing(ScriptedEngine):
    def generate(self, prompts, params):
        raise RuntimeError("engine fault\nsecond line of detail")


def test_an_unexpected_failure_is_a_one_line_500_and_one_log_line(tokenizer):
    limits = GatewayLimits(max_calls=4, max_context_tokens=CONTEXT)
    with Gateway(_Failing(tokenizer, "x"), tokenizer, _sampling(tokenizer), limits) as gateway, _Log() as log:
        token = gateway.open_episode("ep")
        status, payload = _post(gateway, {"messages": QUESTION}, token)
        assert status == 500 and "RuntimeError" in _one_line_error(payload)
        assert gateway.finish_episode(token).calls == ()
    assert log.tracebacks() == []
    (line,) = [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]
    assert "engine fault" in line and "second line" not in line


def _replies(gateway: Gateway, token: str) -> list[bytes]:
    """The raw replies to one tool-offering request on each API, plain and streamed."""
    tools_anthropic = [{"name": "search", "input_schema": TOOLS[0]["function"]["parameters"]}]
    tools_responses = [{"type": "function", "name": "search", "parameters": TOOLS[0]["function"]["parameters"]}]
    requests = [("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS, "logprobs": True}),
                ("/v1/responses", {"input": QUESTION, "tools": tools_responses}),
                ("/v1/messages", {"max_tokens": 30, "messages": QUESTION, "tools": tools_anthropic})]
    replies = []
    for path, body in requests:
        for stream in (False, True):
            status, payload = _post(gateway, {**body, "stream": stream}, token, path)
            assert status == 200, (path, stream, payload[:300])
            replies.append(payload)
    return replies


def _json_documents(payload: bytes) -> list:
    """A reply's JSON: the body, or each server-sent event's data."""
    text = payload.decode()
    if not text.startswith(("data:", "event:")):
        return [_strict(text)]
    datas = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [_strict(data) for data in datas if data != "[DONE]"]


def _tool_calls(value) -> list:
    """Every tool call anywhere in decoded replies: chat's tool_calls, Responses' function_call items,
    Messages' tool_use blocks."""
    found, stack = [], [value]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            found += value.get("tool_calls") or []
            found += [value] if value.get("type") in ("function_call", "tool_use") else []
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return found


def test_a_generated_call_with_nan_arguments_is_no_call_and_every_reply_is_strict_json(tokenizer):
    engine = ScriptedEngine(tokenizer, "Let me look. " + NAN_CALL)
    limits = GatewayLimits(max_calls=8, max_context_tokens=2048)  # the tools' listing takes ~400 tokens
    with Gateway(engine, tokenizer, _sampling(tokenizer, max_new_tokens=64), limits) as gateway:
        token = gateway.open_episode("ep")
        replies = _replies(gateway, token)
        calls = gateway.finish_episode(token).calls
    documents = [document for payload in replies for document in _json_documents(payload)]
    assert _tool_calls(documents) == []
    assert "NaN" in json.dumps(documents)  # the call came back as the text the policy wrote
    assert all(call.parse_error and "NaN or Infinity" in call.parse_error and call.tool_calls == "[]"
               for call in calls) and len(calls) == 6


class _Held(ScriptedEngine):
    """Generates only once released, so the client can hang up first."""

    def __init__(self, tokenizer, text):
        super().__init__(tokenizer, text)
        self.started, self.release = threading.Event(), threading.Event()

    def generate(self, prompts, params):
        self.started.set()
        assert self.release.wait(30)
        return super().generate(prompts, params)


def _wait(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_call_whose_client_disconnected_is_not_recorded_and_gives_its_slot_back(tokenizer):
    engine = _Held(tokenizer, "The answer is Ana.")
    limits = GatewayLimits(max_calls=1, max_context_tokens=CONTEXT)
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits) as gateway, _Log() as log:
        token = gateway.open_episode("ep")
        body = json.dumps({"messages": QUESTION}).encode()
        client = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert engine.started.wait(20)
        client.close()  # the agent gave up (its timeout) while the reply was being generated
        _wait(lambda: not gateway._server.server_state.connections, "the server to see the hang-up")
        engine.release.set()
        _wait(lambda: any("disconnected" in r.getMessage() for r in log.records), "the call to be dropped")
        # its slot was given back: the episode's one call is still available, and is call 0
        status, payload = _post(gateway, {"messages": QUESTION}, token)
        assert status == 200 and _strict(payload)["choices"][0]["message"]["content"] == "The answer is Ana."
        calls = gateway.finish_episode(token)
    assert [call.call_idx for call in calls.calls] == [0] and calls.budget_hit is None
    assert len(engine.prompts) == 2 and log.tracebacks() == []
