"""BM25 search, the search_qa env (the search tool in a ToolEnv, tag or hermes format) and the env
registry, on a real corpus (the synthetic task) with a real bm25s index. The formats' own parsing
is tested in tests/test_formats.py."""

from __future__ import annotations

import json
import re

import pytest

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.registry import ENVS, EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.envs.tool_env import ToolEnv
from agent_core.registry import UnknownNameError
from agent_core.rewards.qa import exact_match


@pytest.fixture(scope="module")
def task():
    return generate_synthetic_qa(seed=1, num_films=60, num_people=40, num_cities=15, num_countries=5)


@pytest.fixture(scope="module")
def index(task):
    return Bm25Index(task.documents)


# ---- BM25 -------------------------------------------------------------------------------------


def test_entity_name_finds_its_own_document_in_top_3(task, index):
    for doc in task.documents:
        assert doc in index.search(doc.title, top_k=3), doc.title


def test_search_respects_top_k_and_ranks_best_first(task, index):
    films = [d for d in task.documents if d.doc_id.startswith("film-")]
    results = index.search("film", top_k=5)
    assert len(results) == 5 and all(doc in films for doc in results)
    assert len(index.search("film", top_k=1000)) == len(films)  # only documents sharing a term
    director = next(d for d in task.documents if d.doc_id.startswith("person-") and d.title in films[0].text)
    results = index.search(director.title, top_k=3)
    assert results[0] == director  # its own page first, then pages that mention it
    assert len(results) > 1 and all(director.title in doc.text for doc in results[1:])


@pytest.mark.parametrize("query", ["", "   ", "the of and is", "!!!", "unknownword"])
def test_queries_without_known_terms_find_nothing(index, query):
    assert index.search(query, top_k=3) == []


def test_index_argument_errors(index):
    with pytest.raises(ValueError, match="top_k"):
        index.search("x", top_k=0)
    assert Bm25Index([]).search("anything at all", top_k=3) == []  # a dataset without documents


# ---- env --------------------------------------------------------------------------------------


def _search_qa(index, **kwargs) -> ToolEnv:
    return make_env("search_qa", kwargs, EnvResources(search_index=index))


def test_reset_adds_the_tool_instructions_to_the_prompt(task, index):
    prompt = task.prompts[0]
    messages = _search_qa(index).reset(prompt)
    assert messages[1:] == prompt.messages[1:] and messages[0].content.startswith(prompt.messages[0].content)
    assert "<search>" in messages[0].content and "<answer>" in messages[0].content
    hermes = _search_qa(index, tool_format="hermes").reset(prompt)[0].content
    assert "<tool_call>" in hermes and '"name": "search"' in hermes


def test_search_step(task, index):
    prompt = task.prompts[0]
    first_doc_id = prompt.metadata["supporting_doc_ids"][0]
    first_doc = next(d for d in task.documents if d.doc_id == first_doc_id)
    env = _search_qa(index, top_k=2)
    env.reset(prompt)
    step = env.step(f"<search>{first_doc.title}</search>")
    assert not step.done and step.termination is None and step.reward == 0.0 and step.parse_error is None
    assert [(c.name, c.arguments, c.ok) for c in step.tool_calls] == [("search", {"query": first_doc.title}, True)]
    assert 1 <= len(step.info["doc_ids"]) <= 2 and step.info["doc_ids"][0] == first_doc_id
    assert step.observation.startswith("<information>") and step.observation.endswith("</information>")
    assert f"({first_doc.title}): {first_doc.text}" in step.observation


def test_hermes_search_step_finds_the_same_documents(task, index):
    title = task.documents[0].title
    tag = _search_qa(index).step(f"<search>{title}</search>")
    call = json.dumps({"name": "search", "arguments": {"query": title}})
    hermes = _search_qa(index, tool_format="hermes").step(f"<tool_call>{call}</tool_call>")
    assert hermes.info["doc_ids"] == tag.info["doc_ids"] and "<tool_response>" in hermes.observation


def test_answer_step(index):
    step = _search_qa(index).step("<answer> Norveth </answer>")
    assert step.done and step.termination == "answered" and step.observation == ""
    assert step.info == {"answer": "Norveth", "format_ok": True} and step.tool_calls == () and step.reward == 0.0


@pytest.mark.parametrize("penalty", [0.0, 0.25])
def test_invalid_step(index, penalty):
    step = _search_qa(index, invalid_action_penalty=penalty).step("<search>Quillport")
    assert not step.done and step.reward == -penalty
    assert "unclosed_tag" in step.parse_error and step.info["format_ok"] is False
    assert "Invalid action" in step.observation and "<answer>" in step.observation


def test_scripted_two_hop_episodes_reach_the_right_answer(task, index):
    """Search the question's entity, read the bridge off the passage, search it, answer."""
    hops = {"director_birthplace": ("directed by", "was born in"), "person_country": ("was born in", "is a city in")}
    solved = 0
    for prompt in task.prompts:
        if prompt.metadata["template"] not in hops:
            continue
        entity = re.search(r"(?:director of|was) ([A-Z]\w+(?: [A-Z]\w+)?) born", prompt.messages[1].content)[1]
        env = make_env(prompt.env_name, prompt.env_kwargs, EnvResources(search_index=index))
        env.reset(prompt)
        first_relation, second_relation = hops[prompt.metadata["template"]]
        observation = env.step(f"<search>{entity}</search>").observation
        bridge = re.search(f"{re.escape(entity)} .*?{first_relation} ([^.]+)\\.", observation)[1]
        observation = env.step(f"<search>{bridge}</search>").observation
        answer = re.search(f"{re.escape(bridge)} {second_relation} ([^.]+)\\.", observation)[1]
        final = env.step(f"<answer>{answer}</answer>")
        assert final.done and final.termination == "answered"
        solved += exact_match(final.info["answer"], prompt.answers)
    assert solved == sum(p.metadata["template"] in hops for p in task.prompts) > 50


# ---- registry ---------------------------------------------------------------------------------


def test_make_env_builds_search_qa(index):
    env = make_env("search_qa", {"top_k": 2, "invalid_action_penalty": 0.1}, EnvResources(search_index=index))
    assert isinstance(env, ToolEnv) and list(env.tools) == ["search"] and env.tools["search"].default_top_k == 2
    assert env.invalid_action_penalty == 0.1
    assert "search_qa" in ENVS.names()


def test_unknown_env_lists_valid_names(index):
    with pytest.raises(UnknownNameError, match="search_qa"):
        make_env("serch_qa", {}, EnvResources(search_index=index))


def test_bad_env_kwarg_names_env_and_key(index):
    with pytest.raises(TypeError, match=r"'search_qa'.*'topk'.*valid arguments: top_k, tool_format"):
        make_env("search_qa", {"topk": 3}, EnvResources(search_index=index))


def test_search_qa_without_a_corpus_says_so():
    with pytest.raises(ValueError, match="needs a corpus"):
        make_env("search_qa", {}, EnvResources())
