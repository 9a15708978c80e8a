"""A scripted oracle agent for the built-in synthetic task: ideal episodes for a supervised warm start.

`oracle_actions(prompt, tool_format)` gives an ideal episode's action texts (one search per name of
`metadata["oracle_plan"]["queries"]`, then the answer); `OracleEngine` plays them through the real agent loop,
so its episodes are a true steps table in the policy's tokenizer. It keeps no per-episode state: it finds the
question and its own earlier actions in the context. `oracle_config_problems(config)` says why it cannot run;
`unread_copies` finds demonstrations that copy a name no result they read showed.
Design notes: docs/architecture.md §11 (agent_core/data/oracle.py).
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

from agent_core.config import PipelineConfig
from agent_core.config_errors import Problem
from agent_core.data.naive_rag import naive_rag_messages, question_text
from agent_core.envs.builtin_tools import SearchTool
from agent_core.envs.formats import ParsedCall, ToolCallFormat, build_format
from agent_core.envs.registry import check_env_spec, env_tool_names, env_traits
from agent_core.envs.search import Bm25Index
from agent_core.rollout.chat import encode_conversation, eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.rollout.records import EpisodeIdentity, StepRecord, one_step_episode
from agent_core.types import Document, Prompt

# The search tool's declaration as the formats need it (the real tool needs a corpus to exist).
_SEARCH_SPEC = {
    "type": "function",
    "function": {
        "name": SearchTool.name,
        "description": SearchTool.description,
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


ORACLE_TOOLS = (SearchTool.name,)  # the tools the oracle's episodes call
TASK_ENV = "search_qa"  # the env every prompt of the synthetic task names (agent_core/data/synthetic.py)
_OTHER_FIXES = ("turn the warm start off (--set warm_start.enabled=false), or imitate the episodes of an earlier "
                "run instead of the oracle's (--set warm_start.source=steps --set warm_start.steps_uri=<its steps.parquet>)")

_LEADING_SPACE = {"tag": " "}  # formats whose values are free text (JSON values in hermes are not)


@functools.lru_cache(maxsize=None)
def _format(tool_format: str) -> ToolCallFormat:
    return build_format(tool_format, [_SEARCH_SPEC])


def oracle_plan(prompt: Prompt) -> tuple[tuple[str, ...], str]:
    """(the queries, the answer) of the prompt's oracle plan; ValueError if it has none."""
    plan = prompt.metadata.get("oracle_plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("queries"), list) or not isinstance(plan.get("answer"), str):
        raise ValueError(
            f"prompt {prompt.prompt_id!r} has no metadata['oracle_plan'] with 'queries' (list) and 'answer' (str); "
            "only the built-in synthetic task's prompts have one"
        )
    return tuple(plan["queries"]), plan["answer"]


def oracle_actions(prompt: Prompt, tool_format: str = "tag", lazy: bool = False) -> list[str]:
    """The action texts of an ideal episode: one search per planned query, then the answer.

    lazy: stop after the first search and answer the entity the plan searches next (the bridge: the
    director of a film, a person's birth city), the classic multi-hop mistake of answering the
    intermediate entity. A prompt with no bridge (a one-query plan, a comparison) is played ideally.

    In the tag format each value starts with a space (`<search> Ann Lee</search>`, which the parser
    strips): with a byte-level BPE " Ann" and "Ann" are different tokens, and the space makes a name
    in an action the same tokens as in the question and the passages, so a policy learns to copy it.
    """
    queries, answer = oracle_plan(prompt)
    if lazy and len(queries) > 1 and prompt.metadata.get("type", "bridge") == "bridge":
        queries, answer = queries[:1], queries[1]
    writer = _format(tool_format)
    lead = _LEADING_SPACE.get(tool_format, "")
    searches = [writer.format_calls([ParsedCall(SearchTool.name, {"query": lead + query})]) for query in queries]
    return [*searches, writer.format_answer(lead + answer)]


def oracle_config_problems(config: PipelineConfig) -> list[Problem]:
    """Why the scripted oracle cannot warm-start a run of `config` ([] if it can, or is not used):
    its plans are the synthetic task's, and the rollout's env must have the tools its episodes call
    (ORACLE_TOOLS). An env given by name in `rollout.env` is checked; unset, each synthetic prompt
    runs in its own env, search_qa. Skipped while the env or its kwargs are invalid: `check_names`
    reports those, each mistake once."""
    warm_start, rollout = config.warm_start, config.rollout
    if not warm_start.enabled or warm_start.source != "oracle":
        return []
    if config.data.source != "synthetic":
        return [Problem("data.source", f"the warm start's scripted oracle solves only the built-in synthetic task "
                        f"(its plans come from the generated world), not {config.data.source!r}; {_OTHER_FIXES}")]
    env = rollout.env or TASK_ENV
    try:
        check_env_spec(env, rollout.env_kwargs)
    except ValueError:
        return []
    tools = env_tool_names(env, rollout.env_kwargs)
    if tools is None and env_traits(env).program_tools:
        return []  # the program declares its tools per request: oracle_episodes checks that its episodes solve
    needed = ", ".join(tool for tool in ORACLE_TOOLS if tools is None or tool not in tools)
    if not needed:
        return []
    if tools is None:
        return [Problem("rollout.env", f"the warm start's scripted oracle calls tool(s) {needed}, and env {env!r} does "
                        f"not say which tools it has (it takes no `tools` argument); use an env that has {needed} "
                        f"(e.g. rollout.env=tool_env with {needed} in rollout.env_kwargs.tools), or {_OTHER_FIXES}")]
    return [Problem("rollout.env_kwargs.tools", f"the warm start's scripted oracle calls tool(s) {needed}, which env "
                    f"{env!r} does not have (its tools: {', '.join(tools) or '(none)'}): the policy would learn calls "
                    f"the env cannot run. Add {needed} to rollout.env_kwargs.tools, or {_OTHER_FIXES}")]


def check_oracle_solved(solved: int, ideal_episodes: int, env: str, cut_actions: int = 0) -> None:
    """ValueError if the oracle played ideal episodes and solved none: its calls did not reach a tool
    that answers them (an agent program without a `search` tool taking `query`, or one that does
    not put the answer in `<answer>` tags), or its replies were cut (`cut_actions`: by the token
    limit), so the warm start would imitate calls that fail."""
    if ideal_episodes and not solved:
        cut = (f" {cut_actions} of its replies were cut by the token limit (the program's max_tokens, or "
               f"rollout.max_new_tokens): give them room for a call." if cut_actions else "")
        raise ValueError(
            f"the warm start's scripted oracle solved none of its {ideal_episodes} ideal episodes in env {env!r}: "
            f"its `search` calls (argument `query`) or its `<answer>` replies did not work there.{cut} An agent "
            f"program must offer that tool and return the text of the last <answer> tags; otherwise {_OTHER_FIXES}")


def unread_copies(records: Sequence[StepRecord], prompts: Sequence[Prompt]) -> list[tuple[str, str]]:
    """(episode id, entity) for each oracle step of a bridge question that copies an entity (the next
    query, or the answer) that no earlier observation of its episode shows: a demonstration the policy
    can only imitate as a guess (the env's or program's search did not read the run's corpus, or
    returned another passage). `records`: the oracle's episodes."""
    by_id = {p.prompt_id: p for p in prompts}
    unread, seen = [], {}
    for record in sorted(records, key=lambda r: (r.episode_id, r.step_idx)):
        prompt = by_id.get(record.prompt_id)
        if prompt is None or prompt.metadata.get("type", "bridge") != "bridge":
            continue
        queries, answer = oracle_plan(prompt)
        copied = (*queries[1:], answer)
        observed = seen.setdefault(record.episode_id, [])
        if 1 <= record.step_idx <= len(copied) and copied[record.step_idx - 1] not in "".join(observed):
            unread.append((record.episode_id, copied[record.step_idx - 1]))
        observed.append(record.observation_text)
    return unread


def question_of(prompt: Prompt) -> str:
    """The text by which the engine recognises the prompt's episodes: its last user message."""
    users = [m.content for m in prompt.messages if m.role == "user"]
    if not users or not users[-1]:
        raise ValueError(f"prompt {prompt.prompt_id!r} has no user message to recognise its episodes by")
    return users[-1]


class OracleEngine:
    """An Engine that plays `oracle_actions` for every episode of `prompts` (see the module docstring);
    the prompts whose ids are in `lazy_prompt_ids` are played lazily (`oracle_actions(lazy=True)`)."""

    def __init__(self, tokenizer, prompts: Sequence[Prompt], tool_format: str = "tag",
                 lazy_prompt_ids: frozenset[str] = frozenset()):
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        end_of_turn = eos_token_ids(tokenizer)[-1]  # <|im_end|> when distinct from eos: what ends a ChatML turn
        self._actions: dict[str, tuple[tuple[int, ...], ...]] = {}
        for prompt in prompts:
            actions = tuple(
                tuple(tokenizer.encode(text, add_special_tokens=False)) + (end_of_turn,)
                for text in oracle_actions(prompt, tool_format, lazy=prompt.prompt_id in lazy_prompt_ids)
            )
            question = question_of(prompt)
            if self._actions.setdefault(question, actions) != actions:
                raise ValueError(f"two prompts ask {question!r} with different oracle plans (one is {prompt.prompt_id!r})")
        if not self._actions:
            raise ValueError("OracleEngine needs at least one prompt")
        # longest first, so a question that is a prefix of another never shadows it
        alternatives = sorted(self._actions, key=len, reverse=True)
        self._question_pattern = re.compile("|".join(map(re.escape, alternatives)))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        return [self._next_action(list(context), params) for context in prompts]

    def _next_action(self, context: list[int], params: SamplingParams) -> Generation:
        actions = self._actions_for(context)
        done = _latest_action_in(context, actions)
        ids = list(actions[min(done + 1, len(actions) - 1)])
        reason = "stop"
        if len(ids) > params.max_new_tokens:
            ids, reason = ids[: params.max_new_tokens], "length"
        return Generation(ids, [0.0] * len(ids), reason)

    def _actions_for(self, context: list[int]) -> tuple[tuple[int, ...], ...]:
        text = self.tokenizer.decode(context, skip_special_tokens=False)
        found = self._question_pattern.search(text)
        if found is None:
            raise ValueError(
                f"OracleEngine: the context holds none of the {len(self._actions)} questions it was given "
                f"(context starts {text[:200]!r})"
            )
        return self._actions[found.group()]


def _latest_action_in(context: list[int], actions: Sequence[tuple[int, ...]]) -> int:
    """Index of the latest of `actions` found in `context` (as a contiguous run of ids), or -1."""
    for index in range(len(actions) - 1, -1, -1):
        if _contains(context, actions[index]):
            return index
    return -1


def _contains(haystack: list[int], needle: tuple[int, ...]) -> bool:
    first, size = needle[0], len(needle)
    start = 0
    while True:
        try:
            start = haystack.index(first, start)
        except ValueError:
            return False
        if tuple(haystack[start : start + size]) == needle:
            return True
        start += 1


def rag_demonstrations(tokenizer, prompts: Sequence[Prompt], documents: Sequence[Document], *, top_k: int,
                       episode_prefix: str) -> list[StepRecord]:
    """One-step episodes in the `naive_rag` method's format: the top-k passages BM25 finds for the
    question and the question in one user turn, answered with the gold answer.

    Why: the paper's Naive RAG baseline is an instruct model that can already answer from given
    passages; a policy warm-started on tool episodes only has never seen that prompt, and a RAG
    score of 0 would flatter the agents. The demonstrations teach the format and reading the
    passages; whether the passages hold the answer is up to retrieval, as in the baseline.
    """
    index = Bm25Index(documents)
    end_of_turn = eos_token_ids(tokenizer)[-1]
    records = []
    for prompt in prompts:
        _, answer = oracle_plan(prompt)
        context = encode_conversation(tokenizer, naive_rag_messages(prompt, index.search(question_text(prompt), top_k)))
        text = _format("tag").format_answer(_LEADING_SPACE["tag"] + answer)  # the method reads <answer> tags
        response = tokenizer.encode(text, add_special_tokens=False) + [end_of_turn]
        episode = f"{episode_prefix}{prompt.prompt_id}"
        records.append(one_step_episode(EpisodeIdentity(episode, episode, prompt.prompt_id, 0, 0), context,
                                        Generation(response, [0.0] * len(response), "stop"), text,
                                        termination="answered", info={"answer": answer}))
    return records
