"""The hf engine's KV reuse across an episode's turns and its static cache (agent_core/rollout/kv_reuse.py,
hf_engine.py): the same tokens and log-probs as a full re-prefill, with only the appended tokens prefilled."""

from __future__ import annotations

import pytest
import torch

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import encode_conversation, eos_token_ids
from agent_core.rollout.context import ContextPolicy
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.hf_engine import HFEngine
from agent_core.rollout.kv_reuse import KeptCache, SessionCaches
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage

QUESTIONS = ("Who directed The Silent Harbor?", "Where?", "Where was Ana Kowalski born, and when was she born?")
OBSERVATION = "<information>Doc 1: The Silent Harbor was directed by Ana Kowalski.</information>"


@pytest.fixture(scope="module")
def task():
    dataset = generate_synthetic_qa(seed=3, num_films=12, num_people=10, num_cities=5, num_countries=3)
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    tokenizer = build_tokenizer(texts + list(QUESTIONS) + [OBSERVATION], vocab_size=400)
    return dataset, tokenizer, EnvResources(search_index=Bm25Index(dataset.documents))


@pytest.fixture(scope="module")
def model(task):
    policy = build_tiny_policy(task[1], hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    with torch.no_grad():  # sharper logits: float noise from another padding layout flips no greedy choice
        policy.lm_head.weight.mul_(20.0)
    return policy


class PrefillCounter:
    """Counts the tokens of every forward pass longer than one token per row (the prefills)."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self.seen, with_kwargs=True)

    def seen(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            self.tokens += ids.shape[0] * ids.shape[1]


def _turns(engine, tokenizer, params, sessions, turns=3):
    """Three turns of three sessions: each prompt = the last prompt + its response + an observation."""
    prompts = [encode_conversation(tokenizer, [ChatMessage("user", q)]) for q in QUESTIONS]
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    out = []
    for turn in range(turns):
        gens = engine.generate(prompts, params, **({"sessions": sessions} if sessions else {}))
        out.append(gens)
        prompts = [p + g.token_ids + observation for p, g in zip(prompts, gens)]
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_reuse_gives_the_tokens_and_logprobs_of_a_full_prefill_and_prefills_less(task, model, temperature):
    tokenizer = task[1]
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=7)
    plain, reusing = HFEngine(model, tokenizer), HFEngine(model, tokenizer, kv_reuse_bytes=1 << 30)
    assert reusing.routes_sessions and not plain.routes_sessions
    counter = PrefillCounter(model)
    try:
        expected = _turns(plain, tokenizer, params, None)
        full_prefill, counter.tokens = counter.tokens, 0
        got = _turns(reusing, tokenizer, params, ["a", "b", "c"])
        reused_prefill = counter.tokens
    finally:
        counter.handle.remove()
    for want_turn, got_turn in zip(expected, got):
        for want, have in zip(want_turn, got_turn):
            assert have.token_ids == want.token_ids
            assert have.finish_reason == want.finish_reason
            torch.testing.assert_close(torch.tensor(have.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert reusing.sessions.reused_tokens > 0
    assert reused_prefill < full_prefill  # turns 2 and 3 prefilled only what was appended
    reusing.close()
    assert len(reusing.sessions) == 0  # closing drops the kept caches


def test_a_rewritten_context_or_a_new_session_is_prefilled_whole(task, model):
    tokenizer = task[1]
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    engine, plain = HFEngine(model, tokenizer, kv_reuse_bytes=1 << 30), HFEngine(model, tokenizer)
    first = encode_conversation(tokenizer, [ChatMessage("user", QUESTIONS[0])])
    gen = engine.generate([first], params, sessions=["a"])[0]
    rewritten = encode_conversation(tokenizer, [ChatMessage("user", QUESTIONS[2])]) + gen.token_ids
    fresh = encode_conversation(tokenizer, [ChatMessage("user", QUESTIONS[1])])
    # one call mixing: a kept session that was rewritten, a brand-new session
    before = engine.sessions.reused_tokens
    got = engine.generate([rewritten, fresh], params, sessions=["a", "b"])
    assert engine.sessions.reused_tokens == before  # nothing extended a kept cache
    want = plain.generate([rewritten, fresh], params)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_kept_caches_are_bounded_least_recently_used_first():
    def kept(tokens: int) -> KeptCache:
        return KeptCache(list(range(tokens)), [(torch.zeros(1, tokens, 2), torch.zeros(1, tokens, 2))])

    caches = SessionCaches(max_bytes=kept(10).nbytes * 2)
    caches.put("a", kept(10))
    caches.put("b", kept(10))
    caches.put("c", kept(10))  # over budget: "a", the oldest, goes
    assert len(caches) == 2
    assert caches.take("a", list(range(11))) is None
    assert caches.take("b", list(range(11))) is not None
    assert caches.take("c", list(range(10))) is None  # a prompt must add at least one token
    caches.put("d", kept(30))  # larger than the whole budget: not kept
    assert len(caches) == 0


def _roll_out(task, engine, *, context=ContextPolicy()):
    dataset, tokenizer, resources = task
    settings = LoopSettings(group_size=2, max_steps=3, max_context_tokens=2048, policy_version=0, episode_prefix="kv-",
                            context=context, straggler_wait_s=float("inf"))
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=eos_token_ids(tokenizer), seed=11)
    return run_episodes(engine, tokenizer, dataset.prompts[:3], lambda p: make_env(p.env_name, p.env_kwargs, resources),
                        sampling, settings)


@pytest.mark.slow  # ~20-40 s; the prefill-level equality tests above run by default
@pytest.mark.parametrize("context", [ContextPolicy(), ContextPolicy(mode="last_k", keep_last_turns=1)],
                         ids=["append", "last_k"])
def test_the_agent_loop_records_the_same_steps_with_kv_reuse(task, model, context):
    plain = _roll_out(task, HFEngine(model, task[1]), context=context)
    engine = HFEngine(model, task[1], kv_reuse_bytes=1 << 30)
    reused = _roll_out(task, engine, context=context)
    assert len(plain) == len(reused) and len(plain) > 6  # several multi-step episodes
    for want, have in zip(plain, reused):
        assert (have.episode_id, have.step_idx, have.prompt_ids, have.response_ids) == (
            want.episode_id, want.step_idx, want.prompt_ids, want.response_ids)
        torch.testing.assert_close(torch.tensor(have.response_logprobs), torch.tensor(want.response_logprobs),
                                   atol=1e-5, rtol=0)
    if context.mode == "append":
        assert engine.sessions.reused_tokens > 0


def test_the_static_cache_gives_the_dynamic_caches_tokens_and_logprobs(task, model):
    tokenizer = task[1]
    prompts = [encode_conversation(tokenizer, [ChatMessage("user", q)]) for q in QUESTIONS]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5)
        want = HFEngine(model, tokenizer).generate(prompts, params)
        static = HFEngine(model, tokenizer, cache="static", kv_reuse_bytes=1 << 30)
        assert not static.routes_sessions  # a preallocated cache per call: nothing kept across calls
        got = static.generate(prompts, params)
        assert static.cache == "static"  # no fallback happened: the static cache really ran
        for have, expected in zip(got, want):
            assert have.token_ids == expected.token_ids
            torch.testing.assert_close(torch.tensor(have.logprobs), torch.tensor(expected.logprobs),
                                       atol=1e-5, rtol=0)


def test_an_unknown_cache_kind_is_refused(task, model):
    with pytest.raises(ValueError, match="dynamic, static"):
        HFEngine(model, task[1], cache="paged")
