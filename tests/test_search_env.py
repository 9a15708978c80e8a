"""The tag action format, BM25 search, the search_qa env and the env registry, on a real corpus
(the synthetic task) with a real bm25s index."""

from __future__ import annotations

import random
import re

import pytest

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.base import ToolCall
from agent_core.envs.registry import ENVS, EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.envs.search_qa import SearchQAEnv, render_passage
from agent_core.envs.tag_format import (
    ACTION_KINDS,
    FORMAT_HINT,
    ParsedAction,
    format_answer,
    format_information,
    format_search,
    parse_action,
)
from agent_core.registry import UnknownNameError
from agent_core.rewards.qa import exact_match


@pytest.fixture(scope="module")
def task():
    return generate_synthetic_qa(seed=1, num_films=60, num_people=40, num_cities=15, num_countries=5)


@pytest.fixture(scope="module")
def index(task):
    return Bm25Index(task.documents)


# ---- tag format -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Tessa Dunmar", "director of Varo Kelmin", "1987"])
def test_round_trips(text):
    assert parse_action(format_search(text)) == ParsedAction("search", text, None)
    assert parse_action(format_answer(text)) == ParsedAction("answer", text, None)


def test_content_is_stripped_and_surrounding_text_ignored():
    assert parse_action("I think.\n<search>  Quillport \n</search> then more") == ParsedAction("search", "Quillport")
    action = parse_action("<search>q</search><information>made up</information><answer>x</answer>")
    assert action == ParsedAction("search", "q")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>Norveth</answer><search>q</search>", ParsedAction("answer", "Norveth")),
        ("<search>q</search><answer>Norveth</answer>", ParsedAction("search", "q")),
        # An answer after an unclosed search tag does not count: the first tag opened decides.
        ("<search>q <answer>Norveth</answer>", ParsedAction("invalid", "", "unclosed <search> tag")),
        ("<answer>Norveth <search>q</search>", ParsedAction("search", "q")),
        ("<answer>a</answer><answer>b</answer>", ParsedAction("answer", "a")),
    ],
)
def test_which_tag_wins(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    "text, error",
    [
        ("<search></search>", "empty search query"),
        ("<search>  \n </search>", "empty search query"),
        ("<answer> </answer>", "empty answer"),
        ("<search>Quillport", "unclosed <search> tag"),
        ("<answer>Quillport", "unclosed <answer> tag"),
        ("Quillport</answer>", "no <search> or <answer> tag"),
        ("just words", "no <search> or <answer> tag"),
        ("", "no <search> or <answer> tag"),
        ("<SEARCH>q</SEARCH>", "no <search> or <answer> tag"),
    ],
)
def test_invalid_actions(text, error):
    assert parse_action(text) == ParsedAction("invalid", "", error)


def test_non_text_is_invalid_not_an_exception():
    assert parse_action(None).kind == "invalid"  # type: ignore[arg-type]


def test_parser_never_raises_on_random_fragment_soup():
    rng = random.Random(0)
    fragments = ["<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>",
                 "<", ">", "/", " ", "\n", "Tessa", "Dunmar", "x", "é", "\x00", "<search", "answer>", ""]
    kinds = set()
    for _ in range(10_000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        action = parse_action(text)
        assert action.kind in ACTION_KINDS
        kinds.add(action.kind)
        if action.kind == "invalid":
            assert action.error and action.content == ""
        else:
            assert action.error is None and action.content and action.content == action.content.strip()
            # The content was really written between an opening and a closing tag of its kind.
            assert re.search(f"<{action.kind}>\\s*{re.escape(action.content)}\\s*</{action.kind}>", text)
    assert kinds == set(ACTION_KINDS)


def test_format_information():
    assert format_information(["a: b", "c: d"]) == "<information>a: b\nc: d</information>"
    assert format_information([]) == "<information>no results</information>"


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
    with pytest.raises(ValueError, match="empty"):
        Bm25Index([])


# ---- env --------------------------------------------------------------------------------------


def test_reset_returns_the_prompt_messages(task, index):
    env = SearchQAEnv(index)
    assert env.observation_role == "user"
    assert env.reset(task.prompts[0]) == task.prompts[0].messages


def test_search_step(task, index):
    prompt = task.prompts[0]
    first_doc_id = prompt.metadata["supporting_doc_ids"][0]
    first_doc = next(d for d in task.documents if d.doc_id == first_doc_id)
    env = SearchQAEnv(index, top_k=2)
    env.reset(prompt)
    step = env.step(f"<search>{first_doc.title}</search>")
    assert not step.done and step.termination is None and step.reward == 0.0 and step.parse_error is None
    assert step.tool_calls == (ToolCall("search", {"query": first_doc.title}),)
    assert 1 <= step.info["num_results"] == len(step.info["doc_ids"]) <= 2
    assert step.info["doc_ids"][0] == first_doc_id
    assert step.observation.startswith("<information>") and step.observation.endswith("</information>")
    assert render_passage(first_doc) in step.observation.splitlines()[0]


def test_answer_step(index):
    step = SearchQAEnv(index).step("<answer> Norveth </answer>")
    assert step.done and step.termination == "answered" and step.observation == ""
    assert step.info == {"answer": "Norveth", "format_ok": True} and step.tool_calls == () and step.reward == 0.0


@pytest.mark.parametrize("penalty", [0.0, 0.25])
def test_invalid_step(index, penalty):
    step = SearchQAEnv(index, invalid_action_penalty=penalty).step("<search>Quillport")
    assert not step.done and step.reward == -penalty
    assert step.parse_error == "unclosed <search> tag" and step.info == {"format_ok": False}
    assert "unclosed <search> tag" in step.observation and FORMAT_HINT in step.observation


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
        observation = env.step(format_search(entity)).observation
        bridge = re.search(f"{re.escape(entity)} .*?{first_relation} ([^.]+)\\.", observation)[1]
        observation = env.step(format_search(bridge)).observation
        answer = re.search(f"{re.escape(bridge)} {second_relation} ([^.]+)\\.", observation)[1]
        final = env.step(format_answer(answer))
        assert final.done and final.termination == "answered"
        solved += exact_match(final.info["answer"], prompt.answers)
    assert solved == sum(p.metadata["template"] in hops for p in task.prompts) > 50


# ---- registry ---------------------------------------------------------------------------------


def test_make_env_builds_search_qa(index):
    env = make_env("search_qa", {"top_k": 2, "invalid_action_penalty": 0.1}, EnvResources(search_index=index))
    assert isinstance(env, SearchQAEnv) and env.top_k == 2 and env.invalid_action_penalty == 0.1
    assert "search_qa" in ENVS.names()


def test_unknown_env_lists_valid_names(index):
    with pytest.raises(UnknownNameError, match="search_qa"):
        make_env("serch_qa", {}, EnvResources(search_index=index))


def test_bad_env_kwarg_names_env_and_key(index):
    with pytest.raises(TypeError, match=r"'search_qa'.*'topk'.*valid arguments: top_k, invalid_action_penalty"):
        make_env("search_qa", {"topk": 3}, EnvResources(search_index=index))


def test_search_qa_without_a_corpus_says_so():
    with pytest.raises(ValueError, match="needs a corpus"):
        make_env("search_qa", {}, EnvResources())
