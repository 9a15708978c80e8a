"""The gateway's boundaries: a request needs an open episode's token, a finished episode's token is
dead, bodies over the limit are refused before parsing, no endpoint hands out recorded calls, and
the server listens on 127.0.0.1 only."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from agent_core.gateway import Gateway, GatewayLimits
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.training.model import build_tokenizer

BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


class _CountingEngine:
    def __init__(self, tokenizer):
        self.ids = tokenizer.encode("hello", add_special_tokens=False) + [eos_token_ids(tokenizer)[0]]
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        return [Generation(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["hello world, who is there?"] * 10, vocab_size=300)


@pytest.fixture
def gateway(tokenizer):
    engine = _CountingEngine(tokenizer)
    sampling = SamplingParams(max_new_tokens=8, seed=0, stop_token_ids=eos_token_ids(tokenizer))
    with Gateway(engine, tokenizer, sampling, GatewayLimits(max_calls=8, max_context_tokens=256),
                 max_body_bytes=10_000) as running:
        running.engine = engine
        yield running


def _post(gateway: Gateway, body: bytes, token: str | None, path: str = "/v1/chat/completions",
          headers: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
            **(headers or {})}
    connection.request(method, path, body=body, headers=sent)
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, (json.loads(payload) if payload.startswith(b"{") else {})


def test_a_missing_or_wrong_token_gets_401_and_nothing_is_generated(gateway):
    gateway.open_episode("a")
    for token in (None, "sk-wrong", "agr1-" + "x" * 32):
        status, body = _post(gateway, json.dumps(BODY).encode(), token)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _post(gateway, b"", "sk-wrong", path="/v1/models", method="GET")[0] == 401
    assert gateway.engine.calls == 0


def test_a_finished_episodes_token_gets_401(gateway):
    token = gateway.open_episode("a")
    assert _post(gateway, json.dumps(BODY).encode(), token)[0] == 200
    assert len(gateway.finish_episode(token).calls) == 1
    assert _post(gateway, json.dumps(BODY).encode(), token)[0] == 401
    with pytest.raises(KeyError):  # and it cannot be finished (read) twice
        gateway.finish_episode(token)


def test_a_body_over_the_limit_gets_413_declared_or_streamed(gateway):
    token = gateway.open_episode("a")
    big = json.dumps({**BODY, "messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    assert _post(gateway, big, token)[0] == 413

    def chunks():
        for _ in range(40):
            yield b"x" * 1000
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    connection.request("POST", "/v1/chat/completions", body=chunks(), encode_chunked=True,
                       headers={"Authorization": f"Bearer {token}", "Transfer-Encoding": "chunked"})
    assert connection.getresponse().status == 413
    connection.close()
    assert gateway.engine.calls == 0


def test_bad_requests_get_400_with_one_line(gateway):
    token = gateway.open_episode("a")
    for body in (b"not json", b"[]", json.dumps({**BODY, "messages": []}).encode(),
                 json.dumps({**BODY, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
                 json.dumps({**BODY, "max_tokens": -3}).encode()):
        status, answer = _post(gateway, body, token)
        assert status == 400 and "\n" not in answer["error"]["message"], body


def test_no_endpoint_exposes_another_episodes_calls(gateway):
    victim, attacker = gateway.open_episode("victim"), gateway.open_episode("attacker")
    assert _post(gateway, json.dumps(BODY).encode(), victim)[0] == 200
    for path, method in (("/v1/episodes", "GET"), ("/v1/calls", "GET"), ("/v1/episodes/victim", "GET"),
                         ("/docs", "GET"), ("/openapi.json", "GET"), ("/v1/chat/completions", "GET")):
        status, body = _post(gateway, b"", attacker, path=path, method=method)
        assert status in (404, 405), path
        assert "victim" not in json.dumps(body)
    # the attacker's own calls are recorded under the attacker only
    assert _post(gateway, json.dumps(BODY).encode(), attacker)[0] == 200
    assert len(gateway.finish_episode(attacker).calls) == 1
    assert len(gateway.finish_episode(victim).calls) == 1


def test_it_listens_on_127_0_0_1_only(gateway):
    assert gateway.base_url.startswith("http://127.0.0.1:")
    listening = [line.split() for line in open("/proc/net/tcp").read().splitlines()[1:]]
    port_hex = f"{gateway.port:04X}"
    bound = [fields[1] for fields in listening if fields[1].endswith(f":{port_hex}") and fields[3] == "0A"]
    assert bound == [f"0100007F:{port_hex}"]  # 127.0.0.1, not 0.0.0.0
    other = _non_loopback_address()
    if other is not None:
        with pytest.raises(OSError):
            socket.create_connection((other, gateway.port), timeout=2).close()


def _non_loopback_address() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: it only picks the outgoing interface
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address
