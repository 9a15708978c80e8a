"""Multi-hop question answering with a search tool, in the tag action format.

The Search-R1 / early Agent-R1 QA environment: the policy searches a BM25 index with
`<search>query</search>` (any number of times) and ends the episode with `<answer>text</answer>`.
The env only answers actions: budgets (max steps, context length) are the agent loop's job, and the
outcome reward (EM/F1 of the final answer) is labelled later by a scorer from `info["answer"]`, so
the only reward given here is the optional penalty for an unparseable action.

Differences from Search-R1: an invalid action does not end the episode; it is answered with a short
format reminder and may be penalised (`invalid_action_penalty`), so the policy can recover.
"""

from __future__ import annotations

from agent_core.envs.base import EnvStep, ToolCall
from agent_core.envs.search import Bm25Index
from agent_core.envs.tag_format import FORMAT_HINT, format_information, parse_action
from agent_core.types import ChatMessage, Document, Prompt


def render_passage(document: Document) -> str:
    """One retrieved document as a line of an `<information>` block."""
    return f"{document.title}: {document.text}"


class SearchQAEnv:
    """Answers `<search>` with the top-k passages and ends the episode on `<answer>`."""

    observation_role = "user"

    def __init__(self, index: Bm25Index, top_k: int = 3, invalid_action_penalty: float = 0.0):
        if top_k < 1:
            raise ValueError(f"search_qa: top_k must be >= 1, got {top_k}")
        if invalid_action_penalty < 0:
            raise ValueError(
                f"search_qa: invalid_action_penalty must be >= 0 (it is subtracted), got {invalid_action_penalty}"
            )
        self.index = index
        self.top_k = top_k
        self.invalid_action_penalty = float(invalid_action_penalty)

    def reset(self, prompt: Prompt) -> tuple[ChatMessage, ...]:
        return prompt.messages

    def step(self, action_text: str) -> EnvStep:
        action = parse_action(action_text)
        if action.kind == "answer":
            return EnvStep(
                observation="",
                reward=0.0,
                done=True,
                termination="answered",
                info={"answer": action.content, "format_ok": True},
            )
        if action.kind == "search":
            documents = self.index.search(action.content, self.top_k)
            return EnvStep(
                observation=format_information([render_passage(doc) for doc in documents]),
                reward=0.0,
                done=False,
                tool_calls=(ToolCall("search", {"query": action.content}),),
                info={"num_results": len(documents), "doc_ids": [doc.doc_id for doc in documents]},
            )
        return EnvStep(
            observation=f"Invalid action: {action.error}. {FORMAT_HINT}",
            reward=-self.invalid_action_penalty,
            done=False,
            parse_error=action.error,
            info={"format_ok": False},
        )
