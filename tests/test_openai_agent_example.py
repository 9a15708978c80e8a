"""The example agent's own logic (examples/openai_agent/agent.py), without a server: its loop against
a scripted stand-in for the openai client, its tool dispatch, answer extraction and corpus search.
The run through the real client and the gateway is the gateway's test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent_core.data.rows import document_to_row
from agent_core.io.tables import write_table
from agent_core.types import Document
from examples.openai_agent.agent import (
    SEARCH_TOOL, corpus_search, extract_answer, opening_messages, run_agent, run_tool_call,
)

AGENT = Path(__file__).resolve().parent.parent / "examples" / "openai_agent" / "agent.py"


def _call(call_id: str, name: str, arguments: str):
    return SimpleNamespace(id=call_id, type="function", function=SimpleNamespace(name=name, arguments=arguments))


def _completion(content: str | None, calls=()):
    message = SimpleNamespace(content=content, tool_calls=list(calls) or None)
    return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")])


class ScriptedClient:
    """Answers chat.completions.create with the given completions in turn, keeping what it was sent."""

    def __init__(self, completions):
        self.completions, self.requests = list(completions), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **request):
        self.requests.append(json.loads(json.dumps(request)))  # a snapshot: the agent keeps appending
        return self.completions.pop(0)


def _loop(client, search=lambda query: f"results for {query}", max_turns=4):
    return run_agent(client, "policy", opening_messages([{"role": "user", "content": "Question: who?"}]), search,
                     max_turns=max_turns, max_tokens=32, temperature=1.0)


def test_the_loop_runs_tool_calls_and_stops_at_a_reply_without_one():
    client = ScriptedClient([
        _completion("", [_call("c1", "search", '{"query": "Ada"}'), _call("c2", "search", "{not json")]),
        _completion("It is <answer>Ada Lovelace</answer>."),
    ])
    assert _loop(client) == "Ada Lovelace"
    first, second = client.requests
    assert first["tools"] == [SEARCH_TOOL] and first["model"] == "policy" and first["max_tokens"] == 32
    # The second request is the first's messages plus the assistant's calls and one tool message per call.
    assert second["messages"][: len(first["messages"])] == first["messages"]
    added = second["messages"][len(first["messages"]):]
    assert added[0]["role"] == "assistant" and [c["id"] for c in added[0]["tool_calls"]] == ["c1", "c2"]
    assert added[1] == {"role": "tool", "tool_call_id": "c1", "content": "results for Ada"}
    assert added[2]["tool_call_id"] == "c2" and added[2]["content"].startswith("Error: the arguments are not JSON")


def test_the_loop_gives_up_after_max_turns_with_the_last_text():
    client = ScriptedClient([_completion(f"try {n}", [_call(f"c{n}", "search", '{"query": "x"}')]) for n in range(3)])
    assert _loop(client, max_turns=2) == "try 1"
    assert len(client.requests) == 2


def test_a_refused_completion_ends_the_loop_with_the_last_text():
    class Refused(Exception):
        pass

    client = ScriptedClient([_completion("<answer>so far</answer>", [_call("c1", "search", '{"query": "x"}')])])
    original = client.chat.completions.create
    client.chat.completions.create = lambda **request: original(**request) if client.completions else _raise(Refused())
    answer = run_agent(client, "policy", [{"role": "user", "content": "Q"}], lambda query: "r", max_turns=4,
                       max_tokens=8, temperature=1.0, refused=(Refused,))
    assert answer == "so far" and len(client.requests) == 1


def _raise(error):
    raise error


@pytest.mark.parametrize("name, arguments, expected", [
    ("search", '{"query": "Paris"}', "hit: Paris"),
    ("search", "", "Error: search needs a non-empty string \"query\""),
    ("search", '{"query": 7}', "Error: search needs a non-empty string \"query\""),
    ("search", '["Paris"]', "Error: search needs a non-empty string \"query\""),
    ("search", '{"query": "  "}', "Error: search needs a non-empty string \"query\""),
    ("search", "<tool_call>", "Error: the arguments are not JSON"),
    ("browse", '{"query": "Paris"}', "Error: unknown tool 'browse'"),
])
def test_tool_calls_the_model_got_wrong_get_an_error_message_back(name, arguments, expected):
    assert run_tool_call(name, arguments, lambda query: f"hit: {query}").startswith(expected)


@pytest.mark.parametrize("text, answer", [
    ("<answer>Paris</answer>", "Paris"),
    ("I think <answer> first </answer> no, <answer>second</answer>", "second"),
    ("  Paris, I believe \n", "Paris, I believe"),
    ("<answer>unclosed", "<answer>unclosed"),
    ("", ""),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_opening_messages_add_the_instructions_to_the_system_message():
    with_system = opening_messages([{"role": "system", "content": "Answer."}, {"role": "user", "content": "Q"}])
    assert with_system[0]["content"].startswith("Answer.\n") and "<answer>" in with_system[0]["content"]
    assert len(with_system) == 2
    without = opening_messages([{"role": "user", "content": "Q"}])
    assert without[0]["role"] == "system" and without[1] == {"role": "user", "content": "Q"}


def test_corpus_search_reads_the_corpus_table_and_finds_by_bm25(tmp_path):
    documents = [Document("d1", "Ada Lovelace", "Ada Lovelace wrote the first program."),
                 Document("d2", "Paris", "Paris is a city in France.")]
    path = write_table("corpus", [document_to_row(d) for d in documents], tmp_path / "corpus.parquet")
    search = corpus_search(str(path), top_k=3)
    assert search("Which city is in France?") == "Doc 1 (Paris): Paris is a city in France."
    assert search("zebra") == "No results for 'zebra'."
    assert corpus_search(None, 3)("x").startswith("Error: no document collection")


def test_the_script_fails_in_one_stderr_line_when_no_server_answers(tmp_path):
    """Run as the runner runs it: nothing listens at the base URL, so it exits non-zero saying why."""
    done = subprocess.run(
        [sys.executable, str(AGENT), "--model", "policy"], input='{"messages": [{"role": "user", "content": "Q"}]}',
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "x"},
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith("the model server refused a completion: APIConnectionError")
