"""The gateway under an agent that does not wait its turn (issue 39): completions sent all at once
under one episode's token are held to the step budget, each with its own call index and seed, and a
message that is not valid Unicode (a lone surrogate) gets a one-line 400, not a 500 with a traceback.

Driven as the attacker did: real concurrent HTTP requests to a real gateway on 127.0.0.1 in front of
the tiny policy on the hf engine. The engine is slowed (as a real one is) so that the requests
overlap; what is asserted holds however they interleave."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_core.gateway import Gateway, GatewayLimits
from agent_core.gateway.steps import EpisodeEnd, EpisodeIdentity, steps_from_calls
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy
from test_gateway_batching import BOUND_S, _sampling, tokenizer  # noqa: F401 (a fixture)

MAX_STEPS, SENT = 3, 6
ENGINE_DELAY_S = 0.3  # each generate call takes at least this long: the requests overlap


class _SlowEngine:
    """The real engine, slowed; counts the prompts it generated for."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, 0

    def generate(self, prompts, params):
        time.sleep(ENGINE_DELAY_S)
        self.prompts += len(prompts)
        return self.engine.generate(prompts, params)


@pytest.fixture(scope="module")
def engine(tokenizer):  # noqa: F811
    policy = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return _SlowEngine(HFEngine(policy, tokenizer))


def _send(port: int, token: str, body: bytes) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
    connection.request("POST", "/v1/chat/completions", body=body,
                       headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    response = connection.getresponse()
    raw = response.read()
    connection.close()
    return response.status, json.loads(raw) if raw.startswith(b"{") else {"error": {"message": raw.decode()}}


def _chat(content: str) -> bytes:
    return json.dumps({"model": "policy", "messages": [{"role": "user", "content": content}]}).encode()


def test_completions_sent_at_once_are_held_to_the_step_budget_with_distinct_indices_and_seeds(engine, tokenizer):  # noqa: F811
    limits = GatewayLimits(max_calls=MAX_STEPS, max_context_tokens=512)
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits) as gateway:
        token = gateway.open_episode("greedy")
        start = threading.Barrier(SENT)

        def one(k: int) -> tuple[int, dict]:
            start.wait(BOUND_S)
            return _send(gateway.port, token, _chat(f"Who directed Harbor? try {k}"))

        with ThreadPoolExecutor(SENT) as pool:
            answers = [f.result(timeout=BOUND_S) for f in [pool.submit(one, k) for k in range(SENT)]]
        calls = gateway.finish_episode(token)
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200] * MAX_STEPS + [400] * (SENT - MAX_STEPS), answers
    for status, payload in answers:  # the refusal the sequential path gives
        if status == 400:
            assert payload["error"]["code"] == "max_steps"
            assert payload["error"]["message"] == f"this episode has used its {MAX_STEPS} calls (rollout.max_steps)"
    assert engine.prompts == MAX_STEPS  # the refused requests generated nothing
    assert [call.call_idx for call in calls.calls] == list(range(MAX_STEPS))
    assert len({call.seed for call in calls.calls}) == MAX_STEPS and None not in {call.seed for call in calls.calls}
    rows = steps_from_calls(EpisodeIdentity("greedy", "g", "p", 0, 0), calls, EpisodeEnd(None, None, {}), tokenizer)
    assert [row.step_idx for row in rows] == list(range(MAX_STEPS))
    assert rows[-1].termination == "max_steps" and rows[-1].truncated


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_lone_surrogate_gets_a_one_line_400_and_the_next_request_is_served(engine, tokenizer):  # noqa: F811
    limits = GatewayLimits(max_calls=4, max_context_tokens=512)
    kept, server_log = _Kept(), logging.getLogger("uvicorn.error")  # where uvicorn logs an app's traceback
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits) as gateway:
        server_log.addHandler(kept)
        try:
            token = gateway.open_episode("surrogate")
            raw = b'{"model": "policy", "messages": [{"role": "user", "content": "Who directed \\ud800 Harbor?"}]}'
            status, payload = _send(gateway.port, token, raw)
            served, reply = _send(gateway.port, token, _chat("Who directed Harbor?"))
        finally:
            server_log.removeHandler(kept)
        calls = gateway.finish_episode(token)
    message = payload["error"]["message"]
    assert status == 400 and "\n" not in message, payload
    assert "surrogate" in message and "messages[0].content" in message
    assert [r.getMessage() for r in kept.records if r.levelno >= logging.WARNING] == []  # no traceback logged
    assert served == 200 and reply["choices"][0]["message"]["role"] == "assistant"
    assert len(calls.calls) == 1  # the refused request took no step


class _FailsOnce:
    """The real engine, whose first call raises (a generation that fails in a reserved slot)."""

    def __init__(self, engine):
        self.engine, self.failed = engine, False

    def generate(self, prompts, params):
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected engine failure")
        return self.engine.generate(prompts, params)


def test_a_slot_whose_generation_fails_is_given_back_and_leaves_no_gap(engine, tokenizer):  # noqa: F811
    limits = GatewayLimits(max_calls=MAX_STEPS, max_context_tokens=512)
    with Gateway(_FailsOnce(engine.engine), tokenizer, _sampling(tokenizer), limits) as gateway:
        token = gateway.open_episode("unlucky")
        logging.getLogger("uvicorn.error").disabled = True  # the injected failure's expected 500 traceback
        try:
            statuses = [_send(gateway.port, token, _chat(f"try {k}"))[0] for k in range(MAX_STEPS + 2)]
        finally:
            logging.getLogger("uvicorn.error").disabled = False
        calls = gateway.finish_episode(token).calls
    assert statuses == [500] + [200] * MAX_STEPS + [400]
    assert [call.call_idx for call in calls] == list(range(MAX_STEPS))
    first = _sampling(tokenizer).seed  # episode 0's first seed went with the failed call and is not reused
    assert [call.seed for call in calls] == [first + 1 + k for k in range(MAX_STEPS)]
