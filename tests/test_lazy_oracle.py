"""The lazy oracle (agent_core/data/oracle.py): `oracle_actions(lazy=True)` searches the plan's first
query only and answers its second (the bridge entity); a one-query plan is played ideally even when
lazy; `OracleEngine(lazy_prompt_ids=...)` plays only those prompts lazily, checked through the real
agent loop, env and index. Config: unset, select_sql keeps every oracle episode (lazy ones score em 0);
an explicit "em = 1" selection with lazy_fraction > 0 is refused. The warm start's `oracle_episodes` stage makes round(lazy_fraction x prompts) of its
tool episodes lazy, and plays an agent program (env agent_program) against the run's corpus."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from agent_core.config import DataConfig, RewardConfig, RolloutConfig, WarmStartConfig
from agent_core.data.oracle import OracleEngine, oracle_actions, oracle_plan, unread_copies
from agent_core.data.synthetic import TEMPLATES, generate_synthetic_qa
from agent_core.drivers import DataAccess
from agent_core.envs.formats import build_format
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.checkpoints import save_policy
from agent_core.io.layout import DataRoot
from agent_core.io.tables import read_table
from agent_core.rewards.qa import exact_match
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import SamplingParams
from agent_core.training.model import build_tiny_policy, build_tokenizer
from tasks import warm_start
from tasks._common import read_corpus, split_prompts
from tasks.prepare_data import prepare_dataset
from tasks.warm_start import oracle_episodes

BRIDGES = [name for name, template in TEMPLATES.items() if template.type == "bridge"]
READER = build_format("tag", [{"function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}])


@pytest.fixture(scope="module")
def task():
    dataset = generate_synthetic_qa(seed=5, num_films=40, num_people=30, num_cities=10, num_countries=4)
    chosen = [p for t in BRIDGES for p in [p for p in dataset.prompts if p.metadata["template"] == t][:2]]
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    return dataset, chosen, build_tokenizer(texts, vocab_size=400)


def _read(actions: list[str]) -> tuple[list[list[str]], str]:
    *searches, answer = [READER.parse(text) for text in actions]
    return [[c.arguments["query"] for c in a.calls] for a in searches], answer.answer


def test_lazy_actions_search_once_and_answer_the_bridge_entity(task):
    for prompt in task[1]:
        queries, gold = oracle_plan(prompt)
        assert len(queries) >= 2
        searches, answer = _read(oracle_actions(prompt, "tag", lazy=True))
        assert searches == [[queries[0]]] and answer == queries[1] != gold
        assert _read(oracle_actions(prompt, "tag")) == ([[q] for q in queries], gold)  # not lazy: the plan


@pytest.mark.parametrize("tool_format", ["tag", "hermes"])
def test_a_one_query_plan_is_played_ideally_even_when_lazy(task, tool_format):
    prompt = task[1][0]
    queries, answer = oracle_plan(prompt)
    single = dataclasses.replace(prompt, metadata={**prompt.metadata,
                                                   "oracle_plan": {"queries": [queries[0]], "answer": answer}})
    actions = oracle_actions(single, tool_format, lazy=True)
    assert actions == oracle_actions(single, tool_format) and len(actions) == 2


def test_oracle_engine_plays_only_the_chosen_prompts_lazily(task):
    dataset, prompts, tokenizer = task
    lazy_ids = frozenset(p.prompt_id for p in prompts[::2])
    engine = OracleEngine(tokenizer, prompts, lazy_prompt_ids=lazy_ids)
    resources = EnvResources(search_index=Bm25Index(dataset.documents))
    settings = LoopSettings(group_size=1, max_steps=6, max_context_tokens=4096, policy_version=0, episode_prefix="l-")
    sampling = SamplingParams(max_new_tokens=96, stop_token_ids=eos_token_ids(tokenizer))
    steps = run_episodes(engine, tokenizer, prompts, lambda p: make_env(p.env_name, p.env_kwargs, resources),
                         sampling, settings)
    assert 0 < len(lazy_ids) < len(prompts)
    for prompt in prompts:
        queries, gold = oracle_plan(prompt)
        mine = sorted((s for s in steps if s.prompt_id == prompt.prompt_id), key=lambda s: s.step_idx)
        final = mine[-1]
        assert final.done and final.termination == "answered" and not any(s.done for s in mine[:-1])
        calls = [c["arguments"]["query"] for s in mine for c in json.loads(s.tool_calls)]
        answer = json.loads(final.info)["answer"]
        if prompt.prompt_id in lazy_ids:
            assert len(mine) == 2 and calls == [queries[0]]  # one search, then the answer
            assert answer == queries[1] and exact_match(answer, prompt.answers) == 0.0
        else:
            assert len(mine) == len(queries) + 1 and calls == list(queries)
            assert answer == gold and exact_match(answer, prompt.answers) == 1.0
    # each copied entity (the next query, the answer) is in a result its episode read before ...
    assert unread_copies(steps, prompts) == []
    # ... and where the search read nothing, every copy is flagged: 1 per lazy episode, one per query else
    blind = [dataclasses.replace(s, observation_text="Error: no document collection to search.") for s in steps]
    copies = sum(1 if p.prompt_id in lazy_ids else len(oracle_plan(p)[0]) for p in prompts)
    assert len(unread_copies(blind, prompts)) == copies > len(prompts)


def test_lazy_fraction_and_the_episode_selection():
    with pytest.raises(ValueError, match="select_sql"):
        WarmStartConfig(lazy_fraction=0.5, select_sql="select episode_id  from rewards where em = 1")
    assert WarmStartConfig(lazy_fraction=0.5).selection_sql == "select episode_id from rewards"  # every episode
    assert WarmStartConfig(lazy_fraction=0.0, select_sql="select episode_id from rewards where em = 1").lazy_fraction == 0
    solved = "select episode_id from rewards where em = 1"
    assert WarmStartConfig(source="steps", steps_uri="s.parquet").selection_sql == solved  # an earlier run: its successes
    assert WarmStartConfig(select_sql="select 1 as episode_id").selection_sql == "select 1 as episode_id"


def _small_run(tmp_path, **data):
    """A small synthetic dataset under `tmp_path`, its training prompts by id, and a tiny policy's folder."""
    dataset = prepare_dataset.fn(str(tmp_path), DataConfig(num_films=24, num_people=20, num_cities=8, num_countries=4,
                                                           comparison_fraction=0.0, **data))
    train = {p.prompt_id: p for p in split_prompts(dataset, "train")}
    tokenizer = build_tokenizer([d.text for d in read_corpus(dataset.corpus_uri)], vocab_size=400)
    policy_dir = save_policy(build_tiny_policy(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                               intermediate_size=16), tokenizer, tmp_path / "policy")
    return dataset, train, policy_dir


def test_oracle_episodes_make_the_lazy_fraction_of_tool_episodes_lazy(tmp_path):
    dataset, train, policy_dir = _small_run(tmp_path)
    cfg = WarmStartConfig(prompts=10, rag_prompts=0, lazy_fraction=0.5)
    rollout = RolloutConfig(max_steps=6, max_new_tokens=96, max_context_tokens=4096)
    steps_uri, rewards_uri = oracle_episodes.fn(DataRoot(tmp_path).run("lazy"), dataset, cfg, rollout, RewardConfig(),
                                                str(policy_dir), seed=0)
    finals = [s for s in read_table("steps", steps_uri).to_pylist() if s["done"]]
    assert len(finals) == 10
    kinds = []
    for final in finals:
        queries, gold = oracle_plan(train[final["prompt_id"]])
        answer = json.loads(final["info"])["answer"]
        kinds.append("lazy" if (final["step_idx"], answer) == (1, queries[1]) else
                     "ideal" if (final["step_idx"], answer) == (len(queries), gold) else "other")
    assert kinds.count("lazy") == 5 and kinds.count("ideal") == 5
    em = [r["em"] for r in read_table("rewards", rewards_uri).to_pylist() if r["em"] is not None]
    assert sorted(em) == [0.0] * 5 + [1.0] * 5


@pytest.mark.parametrize("corpus", ["given", "withheld"])
def test_an_agent_programs_oracle_episodes_search_the_runs_corpus(tmp_path, corpus, monkeypatch, caplog):
    """The oracle playing an agent program (env agent_program) must see the corpus the run's rollouts
    search: its demonstrations copy the bridge entity from the first search's result into the second
    query, so a result that says "no document collection" teaches a policy to make the entity up.
    Withheld (as before the fix), the stage says so."""
    pytest.importorskip("openai")
    dataset, train, policy_dir = _small_run(tmp_path, three_hop_fraction=0.0)
    agent = Path(__file__).resolve().parent.parent / "examples" / "openai_agent" / "agent.py"
    rollout = RolloutConfig(env="agent_program", max_steps=4, max_new_tokens=64, max_context_tokens=4096,
                            env_kwargs={"command": [sys.executable, str(agent), "--top-k", "1"], "timeout_s": 120})
    if corpus == "withheld":
        monkeypatch.setattr(warm_start, "DataAccess", lambda *args: DataAccess())
    steps_uri, _ = oracle_episodes.fn(DataRoot(tmp_path).run("program"), dataset,
                                      WarmStartConfig(prompts=4, lazy_fraction=0.0), rollout, RewardConfig(),
                                      str(policy_dir), seed=0)
    steps = read_table("steps", steps_uri).to_pylist()
    searched = [s for s in steps if not s["done"]]
    warned = [r.getMessage() for r in caplog.records if "copy an entity no earlier result" in r.getMessage()]
    if corpus == "withheld":
        assert all("no document collection" in s["observation_text"] for s in searched)
        assert len(warned) == 1 and warned[0].startswith(f"warm start: {len(searched)} of the oracle's steps"), warned
        return
    assert warned == []
    assert len(searched) >= 4 and all("Doc 1 (" in s["observation_text"] for s in searched), \
        [s["observation_text"] for s in searched]
    for first in (s for s in searched if s["step_idx"] == 0):
        queries, _ = oracle_plan(train[first["prompt_id"]])
        if len(queries) > 1:  # the next query is the bridge entity the first result names
            assert queries[1] in first["observation_text"], (queries, first["observation_text"])
