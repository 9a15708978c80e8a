"""A plain OpenAI-client agent with one function tool, `search`, trainable as it is (env agent_program).

Nothing in it knows about training: it talks to whatever OPENAI_BASE_URL / OPENAI_API_KEY name
(the `openai` client reads both), which during training is the pipeline's gateway, where every
completion it asks for is recorded as a step. What makes it trainable is its contract with the
runner (docs/guides/train-your-agent.md):

- stdin: one JSON object, {"prompt_id", "messages", "env_kwargs", "metadata"}; it reads "messages";
- AGENTR1_CORPUS: the dataset's corpus (a Parquet table of doc_id, title, text) its `search` reads;
- stdout: its final answer as the last line, {"answer": "..."}.

Run by hand against any OpenAI-compatible server:
    echo '{"messages": [{"role": "user", "content": "Question: ..."}]}' | \
        OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x python examples/openai_agent/agent.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Callable

INSTRUCTIONS = ("Use the search tool to look facts up. When you know the answer, reply without a tool call "
                "and put the answer alone in <answer>...</answer>.")
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the document collection and return the best-matching passages, best first.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to search for, e.g. a name."}},
            "required": ["query"],
        },
    },
}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

Search = Callable[[str], str]  # query -> the text the model sees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-turns", type=int, default=4, help="completions per question, at most")
    parser.add_argument("--top-k", type=int, default=3, help="passages per search")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per completion, at most")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    args = parser.parse_args(argv)

    import openai  # here, not at the top: the functions below are usable (and tested) without it

    prompt = json.load(sys.stdin)
    search = corpus_search(os.environ.get("AGENTR1_CORPUS"), args.top_k)
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = args.model or client.models.list().data[0].id
    try:
        # A 400 is the server refusing one more completion (during training: the episode used its
        # calls or its context); the agent then answers with what it has, as a budget-bound agent should.
        answer = run_agent(client, model, opening_messages(prompt["messages"]), search, max_turns=args.max_turns,
                           max_tokens=args.max_tokens, temperature=args.temperature,
                           refused=(openai.BadRequestError,))
    except openai.APIError as error:  # one line on stderr: the runner quotes its tail as the reason
        print(f"the model server refused a completion: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"answer": answer}))
    return 0


def run_agent(client: Any, model: str, messages: list[dict[str, Any]], search: Search, *, max_turns: int,
              max_tokens: int, temperature: float, refused: tuple[type[BaseException], ...] = ()) -> str:
    """The loop: ask for a completion with the tool offered, run the calls it makes, send their
    results back, until it replies without a call (its answer), max_turns completions were made, or
    the server refuses a completion with one of `refused` (the last text is then the answer)."""
    text = ""
    for _ in range(max_turns):
        try:
            completion = client.chat.completions.create(model=model, messages=messages, tools=[SEARCH_TOOL],
                                                        max_tokens=max_tokens, temperature=temperature)
        except refused:
            break
        message = completion.choices[0].message
        text = message.content or ""
        calls = list(message.tool_calls or ())
        if not calls:
            break
        # The history grows by appending, never rewriting: the gateway then packs the episode.
        messages.append({"role": "assistant", "content": text, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}} for call in calls]})
        for call in calls:
            content = run_tool_call(call.function.name, call.function.arguments, search)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return extract_answer(text)


def run_tool_call(name: str, arguments: str, search: Search) -> str:
    """The tool message for one call; a call the model got wrong gets an error text back, not a crash."""
    if name != "search":
        return f"Error: unknown tool {name!r}; the only tool is 'search'."
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return f"Error: the arguments are not JSON: {arguments[:200]!r}. Call search with {{\"query\": \"...\"}}."
    query = parsed.get("query") if isinstance(parsed, dict) else None
    if not isinstance(query, str) or not query.strip():
        return "Error: search needs a non-empty string \"query\", e.g. {\"query\": \"Ada Lovelace\"}."
    return search(query)


def extract_answer(text: str) -> str:
    """What is inside the last <answer>...</answer> of `text`, else the whole text, stripped."""
    found = _ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def opening_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt's conversation with the agent's instructions added to its system message."""
    opened = [{"role": m["role"], "content": m["content"]} for m in messages]
    if opened and opened[0]["role"] == "system":
        opened[0]["content"] = f"{opened[0]['content']}\n{INSTRUCTIONS}"
    else:
        opened.insert(0, {"role": "system", "content": INSTRUCTIONS})
    return opened


def corpus_search(corpus_path: str | None, top_k: int) -> Search:
    """`search` over the corpus at `corpus_path` (BM25), or one that says there is none."""
    if not corpus_path:
        return lambda query: "Error: no document collection to search (AGENTR1_CORPUS is not set)."
    from agent_core.data.rows import row_to_document
    from agent_core.envs.search import Bm25Index
    from agent_core.io.tables import read_table

    index = Bm25Index([row_to_document(row) for row in read_table("corpus", corpus_path).to_pylist()])

    def search(query: str) -> str:
        documents = index.search(query, top_k)
        if not documents:
            return f"No results for {query!r}."
        return "\n".join(f"Doc {i} ({doc.title}): {doc.text}" for i, doc in enumerate(documents, start=1))

    return search


if __name__ == "__main__":
    sys.exit(main())
