"""The gateway uses the engine as the in-process agent loop does (agent_core/gateway/batching.py): a
serial engine (hf) gets concurrent requests as one generate call, each sequence with its own seed and
its own record exactly what the engine returned for it; requests with different max_tokens never
share a call; a concurrent engine gets up to `concurrent_calls` calls in flight at once.

No timing is asserted: waits are bounded (a broken gateway fails slowly, never flakily)."""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_core.gateway import EpisodeCalls, Gateway, GatewayLimits
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy, build_tokenizer

TEXTS = ["Who directed Harbor? The answer is Ana. Go on, episode number one two three four five six."] * 20
N = 4  # concurrent episodes
BOUND_S = 20.0  # the longest any wait here may take (a generous bound, never a timing assertion)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=300)


class _Spy:
    """Forwards to an engine and keeps every call: its prompts, params and what the engine returned."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[list[list[int]], SamplingParams, list[Generation]]] = []

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], params, out))
        return out


def _post(gateway: Gateway, token: str, content: str, **fields) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=BOUND_S)
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": content}], **fields})
    connection.request("POST", "/v1/chat/completions", body=body,
                       headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    assert response.status == 200, payload
    return payload


def _all_at_once(gateway: Gateway, tokens: list[str], fields_of=lambda k: {}) -> list[tuple[dict, EpisodeCalls]]:
    """Each episode's last request, all sent at once; each episode finishes as its reply arrives
    (as a program's would: a queue waiting for it then stops waiting)."""
    def last_request(k: int, token: str) -> tuple[dict, EpisodeCalls]:
        reply = _post(gateway, token, f"Who directed Harbor? episode {k}", **fields_of(k))
        return reply, gateway.finish_episode(token)

    with ThreadPoolExecutor(len(tokens)) as pool:
        futures = [pool.submit(last_request, k, token) for k, token in enumerate(tokens)]
        return [f.result(timeout=BOUND_S) for f in futures]


def _sampling(tokenizer) -> SamplingParams:
    return SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, stop_token_ids=eos_token_ids(tokenizer))


def test_concurrent_requests_share_one_hf_call_and_each_gets_exactly_its_own_generation(tokenizer):
    policy = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    spy = _Spy(HFEngine(policy, tokenizer))
    limits = GatewayLimits(max_calls=4, max_context_tokens=512, batch_window_s=0.0)
    with Gateway(spy, tokenizer, _sampling(tokenizer), limits) as gateway:
        tokens = [gateway.open_episode(f"ep-{k}") for k in range(N)]
        for k, token in enumerate(tokens):  # one request each, one after another: every episode is active
            _post(gateway, token, f"warm up {k}")
        # now a long window: the call goes out because every active episode has a request queued (rule (a))
        gateway.core.engine_queue.window_s = BOUND_S
        before = len(spy.calls)
        done = _all_at_once(gateway, tokens)
    replies, calls = [reply for reply, _ in done], [episode.calls[-1] for _, episode in done]
    assert before == N  # one at a time: nothing to batch
    (batched,) = spy.calls[before:]  # N requests, one generate call
    prompts, params, generations = batched
    assert len(prompts) == N and {c.batch_size for c in calls} == {N}
    # each sequence sampled with its own request's seed, the one its record names
    assert sorted(params.prompt_seeds) == sorted(c.seed for c in calls) and len(set(params.prompt_seeds)) == N
    for call, reply in zip(calls, replies):
        index = prompts.index(call.prompt_ids)
        assert params.prompt_seeds[index] == call.seed
        own = generations[index]
        assert call.response_ids == own.token_ids and call.response_logprobs == own.logprobs
        assert call.finish_reason == own.finish_reason
        assert reply["choices"][0]["message"]["content"] == tokenizer.decode(own.token_ids, skip_special_tokens=True)
    # and a request's seed makes its sample whether or not it shared the call (up to padding noise)
    alone = spy.engine.generate([calls[0].prompt_ids], SamplingParams(
        max_new_tokens=10, temperature=1.0, seed=calls[0].seed, stop_token_ids=eos_token_ids(tokenizer)))[0]
    assert alone.token_ids == calls[0].response_ids
    assert alone.logprobs == pytest.approx(calls[0].response_logprobs, abs=1e-5)


class _Scripted:
    """Answers "hello" at once; keeps each call's params and prompt count."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode("hello", add_special_tokens=False) + [eos_token_ids(tokenizer)[0]]
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params))
        return [Generation(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts]


def test_requests_with_different_max_tokens_never_share_a_call(tokenizer):
    engine = _Scripted(tokenizer)
    limits = GatewayLimits(max_calls=4, max_context_tokens=512, batch_window_s=0.0)
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits) as gateway:
        tokens = [gateway.open_episode(f"ep-{k}") for k in range(N)]
        for token in tokens:
            _post(gateway, token, "warm up")
        engine.calls.clear()
        # all four queue (rule (a)); the first setting's two go, finish, and the other two go
        gateway.core.engine_queue.window_s = BOUND_S
        done = _all_at_once(gateway, tokens, lambda k: {"max_tokens": 5} if k % 2 else {})
    assert sorted(params.max_new_tokens for _, params in engine.calls) == [5, 10]  # one call per setting
    assert [count for count, _ in engine.calls] == [N // 2, N // 2]
    assert [episode.calls[-1].batch_size for _, episode in done] == [N // 2] * N


class _Overlapping:
    """A concurrent engine (max_concurrent_calls=2) whose calls wait, bounded, until another is in
    flight: it records the most calls it ever saw at once."""

    max_concurrent_calls = 2

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode("hello", add_special_tokens=False) + [eos_token_ids(tokenizer)[0]]
        self.cond = threading.Condition()
        self.in_flight = self.most = self.calls = 0
        self.sizes: list[int] = []

    def generate(self, prompts, params):
        with self.cond:
            self.in_flight += 1
            self.calls += 1
            self.sizes.append(len(prompts))
            self.most = max(self.most, self.in_flight)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.most >= 2, timeout=BOUND_S)
            self.in_flight -= 1
        return [Generation(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts]


def test_a_concurrent_engine_gets_concurrent_calls_up_to_its_limit(tokenizer):
    engine = _Overlapping(tokenizer)
    with Gateway(engine, tokenizer, _sampling(tokenizer), GatewayLimits(max_calls=4, max_context_tokens=512)) as gateway:
        tokens = [gateway.open_episode(f"ep-{k}") for k in range(N)]
        done = _all_at_once(gateway, tokens)
    replies, calls = [reply for reply, _ in done], [episode.calls for _, episode in done]
    assert engine.most == 2  # two calls were in flight together, never more
    assert engine.calls == N and engine.sizes == [1] * N  # one request per call: the engine batches itself
    assert all(len(c) == 1 and c[0].batch_size == 1 for c in calls)
    assert all(r["choices"][0]["message"]["content"] == "hello" for r in replies)


def _staggered(gateway: Gateway, tokens: list[str], gap_s: float) -> list[dict]:
    """One request per episode, sent `gap_s` apart (programs starting one after another)."""
    def request(k: int, token: str) -> dict:
        return _post(gateway, token, f"Who directed Harbor? episode {k}")

    futures = []
    with ThreadPoolExecutor(len(tokens)) as pool:
        for k, token in enumerate(tokens):
            futures.append(pool.submit(request, k, token))
            threading.Event().wait(gap_s)
        return [f.result(timeout=BOUND_S) for f in futures]


def test_first_requests_of_started_programs_share_one_call_though_they_arrive_apart(tokenizer):
    # Programs start one after another; their first requests arrive apart. The engine waits for
    # every started program (program_started) while requests keep coming: one call, not a call for
    # the first arrival and another for the rest (before: "active" counted only episodes that had
    # already asked, so the first request went alone).
    engine = _Scripted(tokenizer)
    limits = GatewayLimits(max_calls=4, max_context_tokens=512, batch_window_s=BOUND_S, batch_max_wait_s=BOUND_S)
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits) as gateway:
        tokens = [gateway.open_episode(f"ep-{k}") for k in range(N)]
        for token in tokens:
            gateway.program_started(token)
        replies = _staggered(gateway, tokens, gap_s=0.05)
    assert [count for count, _ in engine.calls] == [N]
    assert all(r["choices"][0]["message"]["content"] == "hello" for r in replies)


def test_a_call_waits_at_most_max_wait_for_started_programs_that_do_not_ask(tokenizer):
    # Four programs started, two ask: the quiet window (60 s) alone would hold their call past the
    # client's timeout; batch_max_wait_s sends it with the two that are queued.
    engine = _Scripted(tokenizer)
    limits = GatewayLimits(max_calls=4, max_context_tokens=512, batch_window_s=3 * BOUND_S, batch_max_wait_s=0.2)
    with Gateway(engine, tokenizer, _sampling(tokenizer), limits) as gateway:
        tokens = [gateway.open_episode(f"ep-{k}") for k in range(N)]
        for token in tokens:
            gateway.program_started(token)
        replies = _staggered(gateway, tokens[:2], gap_s=0.0)
    assert [count for count, _ in engine.calls] == [2]
    assert all(r["choices"][0]["message"]["content"] == "hello" for r in replies)
