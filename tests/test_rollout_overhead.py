"""What the agent loop costs the engine (issue 20): the search index built once per corpus, the
loop's tokenizer calls per step, its time outside generate by kind, and the rollout benchmark's
why_missed computed from those measured parts."""

from __future__ import annotations

import dataclasses
import random

import pytest

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs import search
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index, corpus_key, shared_index
from agent_core.rollout.agent_loop import LoopSettings, RolloutTimings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import SamplingParams
from agent_core.training.model import build_tokenizer
from tests.test_agent_loop import ScriptedEngine
from tests.test_incremental_encoding import CountingTokenizer


@pytest.fixture(scope="module")
def dataset():
    return generate_synthetic_qa(seed=5, num_films=12, num_people=10, num_cities=5, num_countries=3)


@pytest.fixture()
def empty_cache(monkeypatch):
    monkeypatch.setattr(search, "_shared", type(search._shared)())


def _queries(dataset, count: int = 200) -> list[str]:
    rng = random.Random(0)
    words = [w for d in dataset.documents for w in (d.title + " " + d.text).split()]
    queries = [" ".join(rng.sample(words, rng.randint(1, 4))) for _ in range(count)]
    return queries + ["", "the of and", "zzzz unknown", dataset.documents[0].title]


def test_shared_index_is_built_once_per_corpus_and_finds_what_a_fresh_one_finds(dataset, empty_cache):
    documents = list(dataset.documents)
    first = shared_index(documents)
    assert shared_index(list(documents)) is first  # an equal corpus in another list: the same index
    fresh = Bm25Index(documents)
    for query in _queries(dataset):
        for top_k in (1, 3, 10):
            assert first.search(query, top_k) == fresh.search(query, top_k), (query, top_k)


def test_shared_index_tells_corpora_apart_and_keeps_a_few(dataset, empty_cache):
    documents = list(dataset.documents)
    edited = [dataclasses.replace(documents[0], text=documents[0].text + " Zanzibar"), *documents[1:]]
    assert corpus_key(edited) != corpus_key(documents) != corpus_key(documents[:-1])
    # one field's end moved into the next field is another corpus too (the fields are length-prefixed)
    moved = [dataclasses.replace(documents[0], title=documents[0].title + "x", text=documents[0].text[1:])]
    assert corpus_key(moved) != corpus_key([dataclasses.replace(documents[0])])
    original = shared_index(documents)
    changed = shared_index(edited)
    assert changed is not original and changed.search("Zanzibar", 1) == [edited[0]]
    assert shared_index(documents) is original  # still kept: two corpora fit
    for k in range(search.SHARED_INDEXES + 1):
        shared_index(documents[k + 1:])
    assert len(search._shared) == search.SHARED_INDEXES
    assert shared_index(documents) is not original  # the least recently used one was dropped


@pytest.fixture(scope="module")
def loop_task(dataset):
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    tokenizer = build_tokenizer(texts, vocab_size=400)
    return dataset, tokenizer, EnvResources(search_index=Bm25Index(dataset.documents))


def _roll_out(loop_task, tokenizer, *, prompts=3, group_size=2, max_steps=5, timings=None):
    dataset, real_tokenizer, resources = loop_task
    engine = ScriptedEngine(real_tokenizer, ["<search>Quill</search>", "not an action", "<search>born</search>"])
    settings = LoopSettings(group_size=group_size, max_steps=max_steps, max_context_tokens=4096, policy_version=0,
                            episode_prefix="t-", straggler_wait_s=float("inf"))
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=eos_token_ids(real_tokenizer), seed=0)
    steps = run_episodes(engine, tokenizer, dataset.prompts[:prompts],
                         lambda p: make_env(p.env_name, p.env_kwargs, resources), sampling, settings, timings)
    return engine, steps


def test_the_loop_makes_about_two_tokenizer_calls_per_step(loop_task):
    """One batched encode per step, one batched decode per generate call, plus a fixed set-up
    (the opening conversation once per prompt, one plan per kind of observation)."""
    counting = CountingTokenizer(loop_task[1])
    engine, steps = _roll_out(loop_task, counting)
    calls = sum(counting.calls.values())
    more = CountingTokenizer(loop_task[1])
    _, more_steps = _roll_out(loop_task, more, prompts=6, max_steps=10)
    per_extra_step = (sum(more.calls.values()) - calls) / (len(more_steps) - len(steps))
    assert per_extra_step <= 1.5, (more.calls, counting.calls)  # ~1 encode per step + 1 decode per call of 12
    assert more.calls["batch_decode"] == len(more_steps) // 12 and more.calls["decode"] == 0
    assert more.calls["apply_chat_template"] < 40  # opening conversations, probes: not per step


def test_timings_add_up_to_at_most_the_rollout(loop_task):
    import time

    timings = RolloutTimings()
    started = time.perf_counter()
    _, steps = _roll_out(loop_task, loop_task[1], timings=timings)
    wall = time.perf_counter() - started
    parts = dataclasses.asdict(timings)
    assert all(seconds >= 0 for seconds in parts.values()) and parts["index_seconds"] == 0  # the caller's part
    assert parts["start_seconds"] > 0 and parts["encode_seconds"] > 0 and parts["decode_seconds"] > 0
    assert sum(parts.values()) <= wall


def test_bench_why_missed_is_computed_from_the_measured_parts():
    from bench.rollout import GOAL, why_missed

    loop = {"loop_seconds": 12.0, "loop_generate_seconds": 10.5, "loop_tokens": 1000, "generate_calls": 8,
            "index_seconds": 0.0, "start_seconds": 0.1, "decode_seconds": 0.2, "env_wait_seconds": 0.9,
            "encode_seconds": 0.25}
    text = why_missed(loop, raw_tokens_per_s=100.0)  # the raw engine needs 10.0 s for 1000 tokens
    assert GOAL.value == 0.90
    assert "took 12.00s where the goal allows 11.11s" in text and "1.50s with no generate call in flight" in text
    assert "env steps (straggler wait included) 0.90s, observation encoding 0.25s" in text  # largest first
    assert "scheduling and the rest 0.05s" in text and "search index" not in text  # 0 s parts are left out
    assert "+0.50s (+5%)" in text
