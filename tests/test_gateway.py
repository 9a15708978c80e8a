"""The OpenAI-compatible gateway (agent_core/gateway) with the tiny policy, the hf engine and the real
`openai` client: what it records is what the engine produced, tool calls come back in OpenAI's
shape, and an episode packs where the agent appended and falls back to step rows where it rewrote."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

openai = pytest.importorskip("openai")

from agent_core.envs.tool_env import ChatCapabilities  # noqa: E402
from agent_core.gateway import Gateway, GatewayLimits  # noqa: E402
from agent_core.gateway.steps import EpisodeEnd, EpisodeIdentity, steps_from_calls  # noqa: E402
from agent_core.io.tables import rows_of, write_table, read_table  # noqa: E402
from agent_core.rollout.chat import encode_conversation, eos_token_ids  # noqa: E402
from agent_core.rollout.engine import Generation, SamplingParams  # noqa: E402
from agent_core.rollout.hf_engine import HFEngine  # noqa: E402
from agent_core.training.batches import TrainStep, choose_layout  # noqa: E402
from agent_core.training.model import build_tiny_policy, build_tokenizer  # noqa: E402
from agent_core.types import ChatMessage  # noqa: E402

TEXTS = ['Who directed Harbor? <tool_call>\n{"name": "search", "arguments": {"query": "Harbor"}}\n</tool_call>',
         "<tool_response>\nHarbor was directed by Ana.\n</tool_response>", "The answer is Ana."] * 20
TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the corpus",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=320)


@pytest.fixture(scope="module")
def engine(tokenizer):
    policy = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    with torch.no_grad():
        policy.lm_head.weight.mul_(20.0)  # sharp logits: greedy choices robust to padding noise
    return HFEngine(policy, tokenizer)


def _sampling(tokenizer, **changes) -> SamplingParams:
    return replace(SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, stop_token_ids=eos_token_ids(tokenizer)),
                   **changes)


def _client(gateway: Gateway, token: str):
    return openai.OpenAI(base_url=gateway.base_url, api_key=token, max_retries=0, timeout=30)


def test_recorded_ids_and_logprobs_are_the_engines_own_output(engine, tokenizer):
    sampling = _sampling(tokenizer)
    with Gateway(engine, tokenizer, sampling, GatewayLimits(max_calls=4, max_context_tokens=512)) as gateway:
        token = gateway.open_episode("ep-0")
        reply = _client(gateway, token).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Who directed Harbor?"}])
        calls = gateway.finish_episode(token)
    (call,) = calls.calls
    assert call.prompt_ids == encode_conversation(tokenizer, [ChatMessage("user", "Who directed Harbor?")])
    (own,) = engine.generate([call.prompt_ids], replace(sampling, seed=call.seed))
    assert call.response_ids == own.token_ids
    assert call.response_logprobs == pytest.approx(own.logprobs, abs=1e-6)
    assert call.finish_reason == own.finish_reason
    assert reply.choices[0].message.content == tokenizer.decode(own.token_ids, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(own.token_ids)


def test_appended_history_packs_and_rewritten_history_falls_back_to_step_rows(engine, tokenizer, tmp_path):
    with Gateway(engine, tokenizer, _sampling(tokenizer), GatewayLimits(max_calls=6, max_context_tokens=512)) as gateway:
        appended, rewritten = gateway.open_episode("appends"), gateway.open_episode("rewrites")
        for token, rewrite in ((appended, False), (rewritten, True)):
            client = _client(gateway, token)
            messages = [{"role": "user", "content": "Who directed Harbor?"}]
            for turn in range(3):
                message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
                if rewrite:  # an agent that summarises: its history is not what it was sent
                    messages = [{"role": "user", "content": f"Who directed Harbor? (attempt {turn + 2})"}]
                else:
                    messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        kept = {name: gateway.finish_episode(token) for name, token in (("appends", appended), ("rewrites", rewritten))}
    rows = {}
    for name, calls in kept.items():
        identity = EpisodeIdentity(name, "g", "p", 0 if name == "appends" else 1, 0)
        rows[name] = steps_from_calls(identity, calls, EpisodeEnd("Ana", None, {}), tokenizer)
    assert [r.history for r in rows["appends"]] == ["start", "appended", "appended"]
    assert [r.prefix_shared for r in rows["appends"]] == [True, True, False]
    assert [r.history for r in rows["rewrites"]] == ["start", "rewritten", "rewritten"]
    assert [r.prefix_shared for r in rows["rewrites"]] == [False, False, False]
    first, second = rows["appends"][:2]
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.response_ids)] == first.prompt_ids + first.response_ids
    assert "Go on." in first.observation_text
    done = rows["appends"][-1]
    assert done.done and done.termination == "answered" and json.loads(done.info)["answer"] == "Ana"
    # the steps table takes them (history checked), and the trainer's auto layout packs one and not the other
    uri = write_table("steps", rows_of(rows["appends"] + rows["rewrites"], run_id="r", iteration=0),
                      tmp_path / "steps.parquet")
    assert read_table("steps", uri).column("history").to_pylist() == ["start", "appended", "appended",
                                                                      "start", "rewritten", "rewritten"]
    assert len(choose_layout([_train_steps(rows["appends"])])) == 1
    assert len(choose_layout([_train_steps(rows["rewrites"])])) == 3


def _train_steps(records) -> list[TrainStep]:
    return [TrainStep(prompt_ids=r.prompt_ids, response_ids=r.response_ids, response_logprobs=r.response_logprobs,
                      advantages=[0.0] * len(r.response_ids)) for r in records]


class ScriptedEngine:
    """Answers every call with the ids of a fixed text (log-prob -0.5 each): a policy that calls a tool."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [eos_token_ids(tokenizer)[0]]
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        return [Generation(list(self.ids), [-0.5] * len(self.ids), "stop") for _ in prompts]


def test_hermes_tool_calls_come_back_in_openais_shape_and_the_tool_result_appends(tokenizer):
    engine = ScriptedEngine(tokenizer, 'Let me look. <tool_call>\n{"name": "search", "arguments": {"query": "Harbor"}}\n</tool_call>')
    with Gateway(engine, tokenizer, _sampling(tokenizer), GatewayLimits(max_calls=4, max_context_tokens=512),
                 ChatCapabilities()) as gateway:
        token = gateway.open_episode("tools")
        client = _client(gateway, token)
        messages = [{"role": "user", "content": "Who directed Harbor?"}]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "search" and json.loads(call.function.arguments) == {"query": "Harbor"}
        assert choice.message.content == "Let me look."
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Harbor was directed by Ana."}]
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        calls = gateway.finish_episode(token).calls
    # the template has no tools= support: the tool list is in the system message the policy saw
    assert "search the corpus" in tokenizer.decode(calls[0].prompt_ids)
    # the tool result the agent sent back answers the call: it succeeded (audit: tool_error_rate)
    assert json.loads(calls[0].tool_calls) == [{"name": "search", "arguments": {"query": "Harbor"}, "ok": True}]
    assert calls[1].appended and calls[1].prompt_ids[:len(calls[0].prompt_ids) + len(engine.ids)] == \
        calls[0].prompt_ids + engine.ids
    assert "<tool_response>" in tokenizer.decode(calls[1].prompt_ids[len(calls[0].prompt_ids) + len(engine.ids):])


def test_budgets_refuse_with_400_and_end_the_episode_as_a_truncation_unless_the_agent_answers(tokenizer):
    engine = ScriptedEngine(tokenizer, "Ana")
    with Gateway(engine, tokenizer, _sampling(tokenizer), GatewayLimits(max_calls=1, max_context_tokens=512)) as gateway:
        token = gateway.open_episode("budget")
        client = _client(gateway, token)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="calls"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])
        calls = gateway.finish_episode(token)
    identity = EpisodeIdentity("budget", "g", "p", 0, 0)
    (row,) = steps_from_calls(identity, calls, EpisodeEnd(None, None, {}))
    assert row.termination == "max_steps" and row.truncated and "answer" not in json.loads(row.info)
    # an answer printed after the refusal (answering with what it has) is the episode's answer, scored
    (row,) = steps_from_calls(identity, calls, EpisodeEnd("Ana", None, {}))
    assert row.termination == "answered" and not row.truncated
    assert json.loads(row.info)["answer"] == "Ana" and json.loads(row.info)["refused"] == "max_steps"
    assert calls.refusal == "this episode has used its 1 calls (rollout.max_steps)"


def test_several_choices_are_refused_with_a_clear_400(tokenizer):
    with Gateway(ScriptedEngine(tokenizer, "x"), tokenizer, _sampling(tokenizer),
                 GatewayLimits(max_calls=2, max_context_tokens=512)) as gateway:
        client = _client(gateway, gateway.open_episode("choices"))
        with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], n=2)
        assert [m.id for m in client.models.list().data] == ["policy"]


def test_a_stop_string_ends_the_reply_and_the_recorded_ids(tokenizer):
    engine = ScriptedEngine(tokenizer, "The answer is Ana. Then more text")
    with Gateway(engine, tokenizer, _sampling(tokenizer), GatewayLimits(max_calls=2, max_context_tokens=512)) as gateway:
        token = gateway.open_episode("stop")
        reply = _client(gateway, token).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], stop=["Ana"])
        (call,) = gateway.finish_episode(token).calls
    assert reply.choices[0].message.content == "The answer is "
    assert reply.choices[0].finish_reason == "stop"
    assert 0 < len(call.response_ids) < len(engine.ids) and call.response_ids == engine.ids[:len(call.response_ids)]
    assert "Ana" in tokenizer.decode(call.response_ids) and "Then" not in tokenizer.decode(call.response_ids)


def _step_row(step_idx: int, history: str | None, done: bool) -> dict:
    return {"run_id": "r", "iteration": 0, "episode_id": "e", "group_id": "g", "prompt_id": "q", "sample_idx": 0,
            "step_idx": step_idx, "policy_version": 0, "prompt_ids": [1], "response_ids": [2],
            "response_logprobs": [-0.5], "response_text": "x", "tool_calls": "[]", "parse_error": None,
            "observation_text": "", "env_reward": 0.0, "done": done, "termination": "answered" if done else None,
            "truncated": False, "finish_reason": "stop", "prefix_shared": False, "info": "{}", "served_by": None,
            "retries": 0, "generated_at": 1.0, "anchor": None, "history": history}


def test_the_history_column_is_checked_and_old_tables_read_it_as_null(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from schemas import TableValidationError, table_from_rows

    write_table("steps", [_step_row(0, "start", False), _step_row(1, "rewritten", True)], tmp_path / "ok.parquet")
    for rows in ([_step_row(0, "appended", True)], [_step_row(0, "start", False), _step_row(1, "start", True)],
                 [_step_row(0, "sideways", True)]):
        with pytest.raises(TableValidationError, match="history"):
            write_table("steps", rows, tmp_path / "bad.parquet")
    old = table_from_rows("steps", [_step_row(0, "start", True)]).drop_columns(["history"])
    pq.write_table(pa.Table.from_arrays(old.columns, names=old.column_names), tmp_path / "old.parquet")
    assert read_table("steps", tmp_path / "old.parquet").column("history").to_pylist() == [None]
