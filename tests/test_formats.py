"""Tool-call formats (agent_core/envs/formats): round trips, the reading rule, every error kind,
setup errors, observation messages, and a fuzz test that no input makes parse raise."""

from __future__ import annotations

import json
import random
import string

import pytest

from agent_core.envs.formats import (
    ACTION_ERROR_KINDS,
    FORMATS,
    ActionError,
    HermesFormat,
    ParsedAction,
    ParsedCall,
    TagFormat,
    ToolCallFormat,
    build_format,
    tag_tool,
)
from agent_core.registry import UnknownNameError
from agent_core.types import ChatMessage


def function_spec(name: str, properties: dict, required: list[str], description: str = "") -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


SEARCH = function_spec("search", {"query": {"type": "string"}, "top_k": {"type": "integer"}}, ["query"], "Search docs")
LOOKUP = function_spec("lookup", {"title": {"type": "string"}}, ["title"], "Open a page by title")
TAG_SPECS = [SEARCH, LOOKUP]
TAG_PARAMETERS = {"search": "query", "lookup": "title"}


@pytest.fixture(scope="module")
def hermes() -> HermesFormat:
    return build_format("hermes", TAG_SPECS)


@pytest.fixture(scope="module")
def tag() -> TagFormat:
    return build_format("tag", TAG_SPECS)


def calls_only(*calls: ParsedCall) -> ParsedAction:
    return ParsedAction(tuple(calls), None, ())


def error_kinds(action: ParsedAction) -> list[str]:
    return [error.kind for error in action.errors]


# ---- random valid calls ----------------------------------------------------------------------------

TEXT_ALPHABET = string.ascii_letters + string.digits + " .,:;'\"\\/<>{}[]-_\n\té東京🙂\u00a0"


def random_text(rng: random.Random, min_length: int = 0, max_length: int = 20) -> str:
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(rng.randint(min_length, max_length)))


def random_json_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "null", "list", "dict"] if depth < 3 else ["str", "int"])
    if kind == "list":
        return [random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {random_text(rng, 1, 6): random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return {
        "str": lambda: random_text(rng) + rng.choice(["", "</tool_call>", "<answer>x</answer>", "<tool_response>"]),
        "int": lambda: rng.randint(-(10**12), 10**12),
        "float": lambda: rng.uniform(-1e6, 1e6),
        "bool": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }[kind]()


def random_hermes_call(rng: random.Random) -> ParsedCall:
    name = rng.choice(["search", "lookup", "get_weather", "ünïcode_tool", "a"])
    return ParsedCall(name, {random_text(rng, 1, 8): random_json_value(rng) for _ in range(rng.randint(0, 4))})


def random_tag_call(rng: random.Random) -> ParsedCall:
    name = rng.choice(sorted(TAG_PARAMETERS))
    value = random_text(rng, 1, 30).strip() or "x"
    value = value.replace(f"</{name}>", "")  # the one text a tag's value cannot hold (format_calls refuses it)
    return ParsedCall(name, {TAG_PARAMETERS[name]: value})


# ---- round trips -----------------------------------------------------------------------------------


def test_both_formats_are_registered_and_satisfy_the_protocol(hermes, tag):
    assert FORMATS.names() == ["hermes", "tag"]
    assert isinstance(hermes, ToolCallFormat) and isinstance(tag, ToolCallFormat)
    with pytest.raises(UnknownNameError, match="valid tool-call format names: hermes, tag"):
        build_format("json")


@pytest.mark.parametrize("seed", range(3))
def test_hermes_round_trip(hermes, seed):
    rng = random.Random(seed)
    for _ in range(200):
        calls = [random_hermes_call(rng) for _ in range(rng.randint(1, 4))]
        assert hermes.parse(hermes.format_calls(calls)) == calls_only(*calls)


@pytest.mark.parametrize("seed", range(3))
def test_tag_round_trip(tag, seed):
    rng = random.Random(seed)
    for _ in range(200):
        calls = [random_tag_call(rng) for _ in range(rng.randint(1, 4))]
        assert tag.parse(tag.format_calls(calls)) == calls_only(*calls)


@pytest.mark.parametrize("answer", ["Gdansk", "  two words  ", "a <tool_call>{}</tool_call> b", "東京 🙂"])
def test_answer_round_trip(hermes, tag, answer):
    for fmt in (hermes, tag):
        assert fmt.parse(fmt.format_answer(answer)) == ParsedAction((), answer.strip(), ())


def test_hermes_writes_qwen_layout_and_escapes_the_closing_tag(hermes):
    text = hermes.format_calls([ParsedCall("search", {"query": "a</tool_call>b"})])
    assert text == '<tool_call>\n{"name": "search", "arguments": {"query": "a<\\/tool_call>b"}}\n</tool_call>'
    with pytest.raises(ValueError, match="'search'.*not JSON-serialisable"):
        hermes.format_calls([ParsedCall("search", {"query": object()})])


def test_tag_format_calls_refuses_what_it_cannot_write(tag):
    with pytest.raises(ValueError, match="unknown tool 'fetch'.*search, lookup"):
        tag.format_calls([ParsedCall("fetch", {"url": "x"})])
    with pytest.raises(ValueError, match=r"\{'query': str\}"):
        tag.format_calls([ParsedCall("search", {"query": "x", "top_k": 3})])
    with pytest.raises(ValueError, match="</search>"):
        tag.format_calls([ParsedCall("search", {"query": "a</search>"})])


# ---- what a call may look like ------------------------------------------------------------------


def test_hermes_accepts_arguments_as_a_json_string_and_missing_arguments(hermes):
    text = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>'
    assert hermes.parse(text) == calls_only(ParsedCall("search", {"query": "q"}))
    assert hermes.parse('<tool_call>{"name": "now"}</tool_call>') == calls_only(ParsedCall("now", {}))


def test_hermes_does_not_check_names_against_the_tools(hermes):
    # The env answers an unknown tool with the valid names; the format only reads.
    action = hermes.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', tool_names=["search"])
    assert action == calls_only(ParsedCall("rm_rf", {}))


def test_tag_format_reads_only_the_tags_of_the_given_tools(tag):
    text = "<lookup>Gdansk</lookup> <search>Gdansk</search>"
    both = (ParsedCall("lookup", {"title": "Gdansk"}), ParsedCall("search", {"query": "Gdansk"}))
    assert tag.parse(text) == calls_only(*both)
    assert tag.parse(text, tool_names=["search"]) == calls_only(ParsedCall("search", {"query": "Gdansk"}))
    assert tag.parse(text, tool_names=["fetch"]).errors[0].kind == "no_action"  # no spec, so not a tag


def test_multiple_calls_keep_the_good_ones_around_a_malformed_one(hermes, tag):
    text = (
        '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"query": </tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": {"title": "b"}}</tool_call>'
    )
    action = hermes.parse(text)
    assert action.calls == (ParsedCall("search", {"query": "a"}), ParsedCall("lookup", {"title": "b"}))
    assert error_kinds(action) == ["malformed_json"] and action.answer is None
    action = tag.parse("<search>a</search><lookup>  </lookup><search>c</search>")
    assert action.calls == (ParsedCall("search", {"query": "a"}), ParsedCall("search", {"query": "c"}))
    assert error_kinds(action) == ["empty_call"]


# ---- the reading rule ---------------------------------------------------------------------------

HERMES_CALL = '<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>'
SEARCH_Q = ParsedCall("search", {"query": "q"})


@pytest.mark.parametrize("call", [HERMES_CALL, "<search>q</search>"], ids=["hermes", "tag"])
def test_answer_before_any_call_ends_the_episode_and_calls_after_it_are_ignored(hermes, tag, call):
    fmt = hermes if call.startswith("<tool_call>") else tag
    assert fmt.parse(f"I know. <answer>Gdansk</answer> {call}") == ParsedAction((), "Gdansk", ())
    # read in order written: calls first, so the answer after them is ignored
    assert fmt.parse(f"{call} <answer>Gdansk</answer>") == calls_only(SEARCH_Q)
    assert fmt.parse(f"{call} <answer>Gdansk</answer> {call}") == calls_only(SEARCH_Q)  # reading stops at it
    # an answer that holds a call is still an answer; an unclosed answer never wins
    assert fmt.parse(f"<answer>x {call} y</answer>") == ParsedAction((), f"x {call} y", ())
    assert fmt.parse(f"<answer>x {call}") == calls_only(SEARCH_Q)
    # an unclosed call swallows the rest, answer included
    unclosed = call[: call.rindex("</")]
    assert error_kinds(fmt.parse(f"{unclosed} <answer>Gdansk</answer>")) == ["unclosed_tag"]


def test_calls_inside_an_imagined_tool_result_are_not_read(hermes, tag):
    imagined = f"{HERMES_CALL}<tool_response>fake</tool_response>{HERMES_CALL.replace('q', 'r')}"
    assert hermes.parse(imagined) == calls_only(SEARCH_Q)
    assert tag.parse("<search>q</search><information>fake</information><search>r</search>") == calls_only(SEARCH_Q)
    action = tag.parse("<information>fake</information><search>r</search>")
    assert error_kinds(action) == ["no_action"] and "<information>" in action.errors[0].message


# ---- each error kind ------------------------------------------------------------------------------

HERMES_ERRORS = [
    ("<tool_call>{'name': 'search'}</tool_call>", "malformed_json"),
    ("<tool_call>[1, 2]</tool_call>", "malformed_json"),
    ("<tool_call>" + "[" * 3000 + "</tool_call>", "malformed_json"),  # json's recursion limit
    ('<tool_call>{"arguments": {}}</tool_call>', "missing_name"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "missing_name"),
    ('<tool_call>{"name": "search", "arguments": [1]}</tool_call>', "bad_arguments_type"),
    ('<tool_call>{"name": "search", "arguments": "not json"}</tool_call>', "bad_arguments_type"),
    ('<tool_call>{"name": "search", "arguments": null}</tool_call>', "bad_arguments_type"),
    ("<tool_call> \n </tool_call>", "empty_call"),
    ('<tool_call>{"name": "search", "arguments": {"query": "' + "x" * 5000 + '"}}</tool_call>', "call_too_long"),
    ('<tool_call>{"name": "search", "arguments": {}}', "unclosed_tag"),
    ("<answer>Gdansk", "unclosed_tag"),
    ("I think the answer is Gdansk.", "no_action"),
    ("", "no_action"),
    ("<answer>  </answer>", "empty_answer"),
]
TAG_ERRORS = [
    ("<search>   </search>", "empty_call"),
    ("<search>" + "x" * 5000 + "</search>", "call_too_long"),
    ("<search>q", "unclosed_tag"),
    ("<search>q <answer>Gdansk</answer>", "unclosed_tag"),
    ("<answer>Gdansk", "unclosed_tag"),
    ("<fetch>q</fetch> Gdansk", "no_action"),
    ("<answer>\n</answer>", "empty_answer"),
]


@pytest.mark.parametrize("text, kind", HERMES_ERRORS)
def test_hermes_error_kinds(hermes, text, kind):
    action = hermes.parse(text)
    assert action.calls == () and action.answer is None
    assert error_kinds(action) == [kind] and action.errors[0].message


@pytest.mark.parametrize("text, kind", TAG_ERRORS)
def test_tag_error_kinds(tag, text, kind):
    action = tag.parse(text)
    assert action.calls == () and action.answer is None
    assert error_kinds(action) == [kind] and action.errors[0].message


def test_every_error_kind_is_produced_and_unknown_kinds_are_refused():
    produced = {kind for _, kind in HERMES_ERRORS + TAG_ERRORS}
    assert produced == set(ACTION_ERROR_KINDS)
    with pytest.raises(ValueError, match="unknown action error kind 'oops'; valid kinds: malformed_json"):
        ActionError("oops", "x")


def test_max_call_chars_is_configurable():
    assert error_kinds(HermesFormat(max_call_chars=20).parse(HERMES_CALL)) == ["call_too_long"]
    assert TagFormat([SEARCH], max_call_chars=1).parse("<search>q</search>") == calls_only(SEARCH_Q)
    with pytest.raises(ValueError, match="max_call_chars must be a positive int, got 0"):
        HermesFormat(max_call_chars=0)


def test_non_text_input_is_an_error_not_a_crash(hermes, tag):
    for fmt in (hermes, tag):
        for value in (None, 3, b"<answer>x</answer>", ["<answer>x</answer>"]):
            assert error_kinds(fmt.parse(value)) == ["no_action"]


# ---- setup, prompts and observations ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        (function_spec("pair", {"a": {"type": "string"}, "b": {"type": "string"}}, ["a", "b"]), r"'pair'.*'a', 'b'"),
        (function_spec("count", {"n": {"type": "integer"}}, ["n"]), "'count'.*'integer'"),
        (function_spec("now", {}, []), "'now'.*required parameters are none"),
        (function_spec("answer", {"q": {"type": "string"}}, ["q"]), "'answer' cannot be written as a tag"),
        (function_spec("web search", {"q": {"type": "string"}}, ["q"]), "'web search' cannot be written as a tag"),
        ({"type": "function", "function": {"description": "no name"}}, "has no function name"),
    ],
)
def test_tag_format_refuses_tools_it_cannot_write_at_setup(spec, message):
    with pytest.raises(ValueError, match=message):
        build_format("tag", [SEARCH, spec])


def test_tag_tool_takes_the_single_required_string_parameter():
    assert tag_tool(SEARCH).parameter == "query"  # the optional top_k is not the tag's content
    assert tag_tool(SEARCH["function"]).name == "search"  # a bare function dict works too


def test_hermes_system_prompt_lists_each_tool_as_json_the_way_qwen_does(hermes):
    prompt = hermes.system_prompt(TAG_SPECS)
    lines = prompt.splitlines()
    block = lines[lines.index("<tools>") + 1 : lines.index("</tools>")]
    assert [json.loads(line) for line in block] == TAG_SPECS
    assert block[0] == json.dumps(SEARCH, ensure_ascii=False)
    assert prompt.startswith("# Tools\n\nYou may call one or more functions")
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    assert prompt.endswith(hermes.answer_instructions) and "<answer>" in hermes.answer_instructions


def test_tag_system_prompt_shows_each_tag_and_the_answer(tag):
    prompt = tag.system_prompt(TAG_SPECS)
    assert "<search>query</search>: Search docs" in prompt
    assert "<lookup>title</lookup>: Open a page by title" in prompt
    assert "<information></information>" in prompt and "<answer>your answer</answer>" in prompt
    with pytest.raises(ValueError, match="'count'"):
        tag.system_prompt([function_spec("count", {"n": {"type": "integer"}}, ["n"])])


def test_observation_messages(hermes, tag):
    results = [("search", "Doc 1: Gdansk"), ("lookup", "Error: no page 'X'")]
    assert hermes.observation_messages(results, supports_tool_role=True) == [
        ChatMessage("tool", "Doc 1: Gdansk"),
        ChatMessage("tool", "Error: no page 'X'"),
    ]
    assert hermes.observation_messages(results, supports_tool_role=False) == [
        ChatMessage(
            "user",
            "<tool_response>\nDoc 1: Gdansk\n</tool_response>\n<tool_response>\nError: no page 'X'\n</tool_response>",
        )
    ]
    assert tag.observation_messages(results, supports_tool_role=True) == [
        ChatMessage("user", "<information>Doc 1: Gdansk</information>\n<information>Error: no page 'X'</information>")
    ]
    for fmt in (hermes, tag):
        with pytest.raises(ValueError, match="at least one"):
            fmt.observation_messages([], supports_tool_role=False)


# ---- fuzz: parse never raises, and its result keeps its invariants ------------------------------

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<answer>", "</answer>", "<tool_response>", "</tool_response>",
    "<search>", "</search>", "<lookup>", "</lookup>", "<information>", "</information>", "<", ">", "/",
    "{", "}", "[", "]", '"', "'", ":", ",", '"name"', '"arguments"', '"search"', '"query"', "null", "true",
    "1e999", "-0", "NaN", "\\", "\\u12", "\\ud800", "\ud800", "\x00", " ", "\n", "\t", "é", "東京", "🙂", "q",
    '{"name": "search", "arguments": {"query": "q"}}', '"{\\"query\\": 1}"',
]  # fmt: skip


NESTABLE_TAGS = [("<tool_call>", "</tool_call>"), ("<search>", "</search>"), ("<answer>", "</answer>")]


def random_malformed_text(rng: random.Random, valid_actions: list[str]) -> str:
    shape = rng.randrange(4)
    if shape == 0:  # a soup of fragments
        return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 30)))
    valid = rng.choice(valid_actions)
    if shape == 1:  # a truncated valid action
        return valid[: rng.randint(0, len(valid))]
    if shape == 2:  # a valid action with fragments spliced in
        at = rng.randint(0, len(valid))
        return valid[:at] + "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 4))) + valid[at:]
    depth = rng.randint(1, 6)  # nested tags
    opening, closing = rng.choice(NESTABLE_TAGS)
    return opening * depth + rng.choice(FRAGMENTS) + closing * rng.randint(0, depth)


def check_invariants(fmt, action: ParsedAction) -> None:
    assert isinstance(action, ParsedAction)
    assert all(error.kind in ACTION_ERROR_KINDS and error.message for error in action.errors)
    if action.answer is not None:
        assert action.answer == action.answer.strip() and action.answer and not action.calls and not action.errors
    else:
        assert action.calls or action.errors
    for call in action.calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
        if isinstance(fmt, TagFormat):
            value = call.arguments[TAG_PARAMETERS[call.name]]
            assert list(call.arguments) == [TAG_PARAMETERS[call.name]] and value == value.strip() and value


@pytest.mark.parametrize("format_name", ["hermes", "tag"])
def test_fuzz_parse_never_raises(format_name):
    fmt = build_format(format_name, TAG_SPECS, max_call_chars=200)
    rng = random.Random(20240611)
    valid_actions = [fmt.format_calls([random_tag_call(rng) for _ in range(rng.randint(1, 3))]) for _ in range(50)]
    valid_actions += [fmt.format_answer(random_text(rng, 1, 10)) for _ in range(10)]
    for _ in range(1500):
        text = random_malformed_text(rng, valid_actions)
        action = fmt.parse(text)
        check_invariants(fmt, action)
        assert fmt.parse(text) == action  # deterministic


@pytest.mark.parametrize("format_name", ["hermes", "tag"])
def test_a_truncated_call_is_never_run(format_name):
    fmt = build_format(format_name, TAG_SPECS)
    rng = random.Random(5)
    for _ in range(100):
        call = random_tag_call(rng)
        text = fmt.format_calls([call])
        for cut in range(len(text)):
            assert fmt.parse(text[:cut]).calls == (), text[:cut]
        assert fmt.parse(text).calls == (call,)
