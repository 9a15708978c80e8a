"""Fuzzing the agent loop's parse/step path with random model outputs (issue 7, "Done when").

A policy early in training writes anything: half tags, broken JSON, made-up tools, arguments of the
wrong type, calls longer than any limit, stray special tokens. Each such action must become data,
never an exception: one escaping exception would end a whole rollout (every episode of an
iteration) over one bad sample. So a seeded engine double writes >= 10,000 random actions, valid and broken, in every
tool-call format, through the real `run_episodes` with the real envs, tokenizer and chat template,
and the steps are written as a schema-validated `steps` table that DuckDB then checks row by row
against what the double says it wrote.

Each output gets a label, which is what its construction guarantees:
- "answer": a well-formed `<answer>` read before anything else: the episode ends "answered";
- "clean": 1..4 well-formed calls of known tools with valid arguments: no parse error, every call
  runs (only the episode's tool-call budget may refuse one, recorded as "over_budget");
- "malformed": begins with something that cannot be read or run (or ends in a cut-off call tag):
  a parse error or a failed call must be recorded;
- "noise": random token ids or fragments in random order: anything may happen except a crash.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import duckdb
import pyarrow as pa
import pytest

from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.tables import write_table
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.context import ContextPolicy
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.rollout.spec import chat_capabilities
from agent_core.training.model import build_tokenizer

MIN_OUTPUTS = 10_000
MAX_NEW_TOKENS = 6144  # room for the over-long calls (> 4096 characters) without cutting them
WORDS = ("Quill", "Paris", "film", "born", "director", "the", "of", "Lulmark", "Biton", "who", "x", "42", "ünïcödé")
UNICODE = ("é", "ß", "中文", "日本語", "😀", "👩‍👩‍👧", "\u200b", "\u202e", "e\u0301", "\x00", "\x07", "\t", "\r\n", "ﷺ", "𝔘")
CALCULATOR_ERRORS = ("1/0", "9**9**9", "((((", "7" * 600)
SPECIAL_TEXT = ("<|im_start|>", "<|pad|>")  # non-stop special tokens, dropped by decode(skip_special_tokens)


def _prose(rng: random.Random) -> str:
    """Text with no tag in it (a '<' would risk writing one by accident)."""
    pieces = [rng.choice(WORDS + UNICODE) for _ in range(rng.randint(0, 8))]
    return " ".join(pieces).replace("<", "(")


def _unicode_value(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS + UNICODE) for _ in range(rng.randint(1, 6))).replace("<", "(").strip() or "q"


class Writer:
    """Writes valid and broken actions for one format and tool set (search, maybe calculator)."""

    def __init__(self, fmt: str, tools: tuple[str, ...]):
        self.fmt, self.tools = fmt, tools

    # -- well-formed --
    def _arguments(self, rng: random.Random, tool: str) -> dict:
        if tool == "calculator":
            return {"expression": f"{rng.randint(0, 99)} {rng.choice('+-*/')} {rng.randint(1, 99)}"}
        arguments = {"query": _unicode_value(rng)}
        if self.fmt == "hermes" and rng.random() < 0.3:
            arguments["top_k"] = rng.randint(1, 10)
        if rng.random() < 0.02:
            arguments["query"] = "Quill " * 500  # a huge but valid query (3000 characters)
        return arguments

    def call(self, tool: str, arguments, *, as_string: bool = False) -> str:
        if self.fmt == "tag":
            return f"<{tool}>{arguments[next(iter(arguments))]}</{tool}>"
        payload = json.dumps(arguments) if as_string else arguments
        return f"<tool_call>{json.dumps({'name': tool, 'arguments': payload})}</tool_call>"

    def valid_call(self, rng: random.Random) -> str:
        tool = rng.choice(self.tools)
        return self.call(tool, self._arguments(rng, tool), as_string=rng.random() < 0.2)

    @staticmethod
    def answer(rng: random.Random) -> str:
        return f"<answer>{_unicode_value(rng)}</answer>"

    # -- broken: read first, each of these is an error whatever follows --
    def bad_first(self, rng: random.Random) -> str:
        long_body = "y" * rng.randint(4097, 4400)
        common = ["<answer> \n </answer>", self.result_tag() + "<answer>a</answer>"]
        if self.fmt == "tag":
            tool = rng.choice(self.tools)
            bad = [f"<{tool}>   </{tool}>", f"<{tool}>{long_body}</{tool}>"]
            if "calculator" in self.tools:
                bad += [f"<calculator>{e}</calculator>" for e in CALCULATOR_ERRORS + ("__import__('os')",)]
            return rng.choice(bad + common)
        bad = [
            '<tool_call>{"name": "search", "arguments": {"query": "x"}</tool_call>',
            "<tool_call>{name: search}</tool_call>", "<tool_call>[1, 2]</tool_call>", '<tool_call>"search"</tool_call>',
            "<tool_call>" + "[" * 3000 + "</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"name": ""}</tool_call>', '<tool_call>{"name": 7}</tool_call>', "<tool_call>  </tool_call>",
            '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "search", "arguments": "not json"}</tool_call>', f"<tool_call>{long_body}</tool_call>",
            self.call("browse", {"url": "http://x"}), self.call("\ud800", {}), self.call("search", {"query": 5}),
            self.call("search", {"query": "a", "top_k": "three"}), self.call("search", {"query": "a", "top_k": 0}),
            self.call("search", {"query": "a", "top_k": 11}), self.call("search", {"query": "a", "extra": True}),
            self.call("search", {}), self.call("search", {"query": ""}),
            '<tool_call>{"name": "search", "arguments": {"query": "a", "top_k": NaN}}</tool_call>',
            '<tool_call>{"name": "search", "arguments": {"query": ' + "[" * 900 + "]" * 900 + "}}</tool_call>",
            '<tool_call>{"\\ud800": 1}</tool_call>', '<tool_call>{"name": "\\udfff\\u0000"}</tool_call>',
        ]
        if "calculator" in self.tools:
            bad += [self.call("calculator", {"expression": e}) for e in CALCULATOR_ERRORS + (["1"],)]
        return rng.choice(bad + common)

    def cut_off_call(self, rng: random.Random) -> str:
        """A call tag the model did not close (it ran out of tokens): an error even after good calls."""
        tool = rng.choice(self.tools)
        whole = self.call(tool, self._arguments(rng, tool))
        return whole[: rng.randint(len(whole.split(">")[0]) + 1, len(whole) - 2)]

    def result_tag(self) -> str:
        return "<information>" if self.fmt == "tag" else "<tool_response>"

    def any_fragment(self, rng: random.Random) -> str:
        makers = [self.valid_call, self.answer, self.bad_first, self.cut_off_call, _prose, _unicode_value,
                  lambda r: r.choice(SPECIAL_TEXT), lambda r: self.result_tag(), lambda r: "<answer>unclosed",
                  lambda r: r.choice(["</answer>", "</search>", "</tool_call>", "<sear", "<tool_", "<answer"])]
        return rng.choice(makers)(rng)


class FuzzEngine:
    """A seeded `Engine` double: every output is a random action (see the module docstring).

    The rng of a call is seeded from the call's sampling seed, so a lock-step run repeats exactly.
    `labels` maps each output's token ids to its label (an output is regenerated rather than given
    two labels), `counts` counts outputs per label and `calls_written` the calls of "clean" ones.
    """

    def __init__(self, tokenizer, writer: Writer, seed: int, labels: dict, calls_written: dict):
        self.tokenizer, self.writer, self.seed = tokenizer, writer, seed
        self.stops = eos_token_ids(tokenizer)
        self.labels: dict[tuple[int, ...], str] = labels  # shared by the engines of one test
        self.calls_written: dict[tuple[int, ...], int] = calls_written
        self.counts: Counter[str] = Counter()

    def generate(self, prompts, params: SamplingParams) -> list[Generation]:
        rng = random.Random(f"{self.seed}-{params.seed}")
        return [self._one(rng, params) for _ in prompts]

    def _one(self, rng: random.Random, params: SamplingParams) -> Generation:
        while True:
            label, text, calls = self._action(rng)
            if label == "noise" and rng.random() < 0.3:  # raw token ids, specials included
                ids = [rng.randrange(len(self.tokenizer)) for _ in range(rng.randint(1, 40))]
            else:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            if rng.random() < 0.85 or not ids:  # stopped on an end-of-turn token; else cut by length
                ids.append(rng.choice(params.stop_token_ids or self.stops))
            if len(ids) > params.max_new_tokens:  # a real engine cuts here; the label no longer holds
                ids, label = ids[: params.max_new_tokens], "noise"
            key = tuple(ids)
            if self.labels.setdefault(key, label) == label:
                break
        self.counts[label] += 1
        if label == "clean":
            self.calls_written[key] = calls
        finish = "stop" if ids[-1] in params.stop_token_ids else "length"
        return Generation(ids, [-rng.random() for _ in ids], finish)

    def _action(self, rng: random.Random) -> tuple[str, str, int]:
        w, roll = self.writer, rng.random()
        if roll < 0.12:
            return "answer", _prose(rng) + w.answer(rng) + self._tail(rng), 0
        if roll < 0.40:
            calls = rng.randint(1, 4)
            body = "".join(_prose(rng) + w.valid_call(rng) for _ in range(calls))
            ending = rng.choice(["", w.answer(rng), w.result_tag() + w.valid_call(rng) + w.answer(rng)])
            return "clean", body + _prose(rng) + ending, calls
        if roll < 0.55:
            return "malformed", "".join(w.valid_call(rng) for _ in range(rng.randint(0, 3))) + w.cut_off_call(rng), 0
        if roll < 0.60:
            return "malformed", "".join(w.valid_call(rng) for _ in range(rng.randint(5, 7))), 0  # too many calls
        if roll < 0.63:
            return "malformed", rng.choice(["", _prose(rng)]), 0  # no tag at all, or empty: no action
        if roll < 0.85:
            return "malformed", w.bad_first(rng) + self._tail(rng), 0
        return "noise", "".join(w.any_fragment(rng) for _ in range(rng.randint(0, 6))), 0

    def _tail(self, rng: random.Random) -> str:
        """Anything at all after the part that decides the label."""
        return "".join(self.writer.any_fragment(rng) for _ in range(rng.randint(0, 3)))


# A clean call must never fail, so no timeout a busy machine could hit (a 10 s default was, once,
# with two test suites sharing 2 cores): timeouts have their own tests (test_tool_containment.py).
_NO_TIMEOUT = {"tool_timeout_s": 600.0}
# (name, env, env kwargs, tools the writer uses, context policy, group size, prompts, max steps)
CONFIGS = [
    ("tag_search", "search_qa", {"tool_format": "tag", **_NO_TIMEOUT}, ("search",), ContextPolicy(), 16, 40, 6),
    ("hermes_search", "search_qa", {"tool_format": "hermes", **_NO_TIMEOUT}, ("search",), ContextPolicy("last_k", 2),
     16, 40, 6),
    ("hermes_tools", "tool_env", {"tools": ["calculator", "search"], "tool_format": "hermes", **_NO_TIMEOUT},
     ("calculator", "search"), ContextPolicy(max_observation_tokens=48), 16, 40, 6),
    ("tag_tools", "tool_env", {"tools": ["calculator", "search"], "tool_format": "tag", "max_result_chars": 300,
                               **_NO_TIMEOUT}, ("calculator", "search"), ContextPolicy("last_k", 1), 16, 40, 6),
]


@pytest.fixture(scope="module")
def task():
    dataset = generate_synthetic_qa(seed=5, num_films=20, num_people=16, num_cities=6, num_countries=4)
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    tokenizer = build_tokenizer(texts, vocab_size=400)
    chat = chat_capabilities(tokenizer)
    return dataset, tokenizer, EnvResources(search_index=Bm25Index(dataset.documents), chat=chat)


def _roll_out(task, config, seed: int, labels: dict, calls_written: dict) -> tuple[FuzzEngine, list[dict]]:
    """One config's rollout, the way the agent_loop driver (agent_core/drivers/loop.py) drives the loop."""
    dataset, tokenizer, resources = task
    name, env_name, env_kwargs, tools, context, group_size, n_prompts, max_steps = config
    engine = FuzzEngine(tokenizer, Writer(env_kwargs["tool_format"], tools), seed, labels, calls_written)
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, seed=seed * 1000, stop_token_ids=eos_token_ids(tokenizer))
    settings = LoopSettings(group_size=group_size, max_steps=max_steps, max_context_tokens=4 * MAX_NEW_TOKENS,
                            policy_version=0, episode_prefix=f"{name}-", context=context, straggler_wait_s=float("inf"))
    prompts = dataset.prompts[:n_prompts]
    records = run_episodes(engine, tokenizer, prompts, lambda p: make_env(env_name, env_kwargs, resources),
                           sampling, settings)
    # vars(), not dataclasses.asdict: asdict deep-copies every token id of every context (tens of seconds here)
    return engine, [{"run_id": "fuzz", "iteration": 0, **vars(r)} for r in records]


def test_random_model_outputs_never_escape_and_every_error_is_recorded(task, tmp_path):
    engines, rows, labels, calls_written = [], [], {}, {}
    for seed, config in enumerate(CONFIGS, start=1):
        engine, config_rows = _roll_out(task, config, seed, labels, calls_written)
        engines.append(engine)
        rows += config_rows
    produced = sum((engine.counts for engine in engines), Counter())
    assert sum(produced.values()) >= MIN_OUTPUTS and min(produced.values()) > 100, produced
    uri = write_table("steps", rows, tmp_path / "steps.parquet")  # schema-validated

    con = duckdb.connect()
    con.register("labels", pa.table({
        "response_ids": pa.array([list(key) for key in labels], pa.list_(pa.int32())),
        "label": list(labels.values()),
        "calls_written": [calls_written.get(key) for key in labels],
    }))
    con.execute(f"""create view s as
        select s.*, l.label, l.calls_written,
               coalesce(list_count(list_filter(json_extract(tool_calls, '$[*].ok')::BOOLEAN[], lambda x: not x)), 0)
                   as failed_calls,
               json_array_length(tool_calls) as num_calls,
               list_filter(json_extract_string(tool_calls, '$[*].error_kind'), lambda x: x is not null) as error_kinds
        from read_parquet('{uri}') s join labels l using (response_ids)""")
    rows_by_label = dict(con.execute("select label, count(*) from s group by label").fetchall())
    assert rows_by_label == dict(produced) and con.execute("select count(*) from s").fetchone()[0] == len(rows)

    def count(where: str) -> int:
        return con.execute(f"select count(*) from s where {where}").fetchone()[0]

    # every malformed output has its error recorded: a parse error or a failed call
    assert count("label = 'malformed' and parse_error is null and failed_calls = 0") == 0
    assert count("label = 'answer' and termination is distinct from 'answered'") == 0
    clean_with_errors = ("label = 'clean' and (parse_error is not null or num_calls != calls_written "
                         "or len(list_filter(error_kinds, lambda x: x != 'over_budget')) > 0)")
    assert count(clean_with_errors) == 0, con.execute(
        f"select response_text, parse_error, tool_calls, observation_text from s where {clean_with_errors} "
        "limit 3").fetchall()  # the observation carries the tool's error message
    # whatever the output: no env crash, and a step that neither answered nor ran a call says why
    assert count("termination = 'error'") == 0
    assert count("termination is distinct from 'answered' and parse_error is null and num_calls = 0") == 0
    assert count("parse_error is not null and json_extract(info, '$.format_ok')::BOOLEAN") == 0
    assert count("failed_calls != len(error_kinds)") == 0  # every failed call says which way it failed
    kinds = {kind for (kind,) in con.execute("select distinct unnest(error_kinds) from s").fetchall()}
    assert {"unknown_tool", "bad_arguments", "exception"} <= kinds
