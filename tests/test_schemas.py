"""Table schemas: exact Arrow schemas, every check rejecting one bad row by name, JSON checks
against a plain json.loads reference, and a 100k-row steps table."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import schemas
from schemas._base import JsonShape, _json_check_vectorised, json_check, json_number_map
from schemas.dataset import ENV, GROUND_TRUTH, MESSAGES

S, I32, I64, F32, F64, B = pa.string(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.bool_()
DATASET_COLUMNS = [("prompt_id", S, False), ("data_source", S, False), ("split", S, False), ("messages", S, False),
                   ("ground_truth", S, False), ("env", S, False), ("metadata", S, False)]
# The contract, written out independently of the models.
EXPECTED_SCHEMAS = {
    "dataset_prompts": DATASET_COLUMNS,
    "corpus": [("doc_id", S, False), ("title", S, False), ("text", S, False)],
    "prompts": [("run_id", S, False), ("iteration", I32, False), *DATASET_COLUMNS],
    "steps": [("run_id", S, False), ("iteration", I32, False), ("episode_id", S, False), ("group_id", S, False),
              ("prompt_id", S, False), ("sample_idx", I32, False), ("step_idx", I32, False),
              ("policy_version", I32, False), ("prompt_ids", pa.list_(I32), False),
              ("response_ids", pa.list_(I32), False), ("response_logprobs", pa.list_(F32), False),
              ("response_text", S, False), ("tool_calls", S, False), ("parse_error", S, True),
              ("observation_text", S, False), ("env_reward", F64, False), ("done", B, False),
              ("termination", S, True), ("truncated", B, False), ("finish_reason", S, False), ("prefix_shared", B, False), ("info", S, False),
              ("served_by", S, True), ("retries", I32, False), ("generated_at", F64, False), ("anchor", S, True),
              ("history", S, True), ("agent", S, True)],
    "rewards": [("run_id", S, False), ("iteration", I32, False), ("episode_id", S, False), ("group_id", S, False),
                ("prompt_id", S, False), ("sample_idx", I32, False), ("step_idx", I32, False),
                ("process_reward", F64, False), ("outcome_reward", F64, False), ("process_factor", F64, False),
                ("reward", F64, False),
                ("em", F64, True), ("f1", F64, True), ("format_score", F64, True), ("components", S, False),
                ("scorer", S, False)],
    "advantages": [("run_id", S, False), ("iteration", I32, False), ("episode_id", S, False), ("step_idx", I32, False),
                   ("advantages", pa.list_(F32), False), ("returns", pa.list_(F32), False),
                   ("values", pa.list_(F32), True), ("ref_logprobs", pa.list_(F32), True),
                   ("obs_advantages", pa.list_(F32), True), ("obs_returns", pa.list_(F32), True),
                   ("obs_values", pa.list_(F32), True), ("estimator", S, False)],
    "train_metrics": [("run_id", S, False), ("iteration", I32, False), ("update_idx", I32, False), ("loss", F64, False),
                      ("pg_loss", F64, False), ("vf_loss", F64, True), ("entropy", F64, False), ("kl", F64, False),
                      ("clipfrac", F64, False), ("grad_norm", F64, False), ("lr", F64, False), ("tokens", I64, False),
                      ("tokens_per_s", F64, False), ("seconds", F64, False), ("skipped", B, False), ("skip_reason", S, True),
                      ("started_at", F64, False), ("finished_at", F64, False), ("oom_splits", I32, False)],
    "eval": [("eval_id", S, False), ("method", S, False), ("checkpoint", S, False), ("data_source", S, False),
             ("split", S, False), ("seed", I32, False), ("prompt_id", S, False), ("prediction", S, False),
             ("em", F64, False), ("f1", F64, False), ("format_ok", B, False), ("steps", I32, False),
             ("tool_calls", I32, False), ("termination", S, True)],
    "ledger": [("run_id", S, False), ("iteration", I32, False), ("stage", S, False), ("algorithm", S, False),
               ("device", S, False), ("device_count", I32, False), ("wall_seconds", F64, False),
               ("device_seconds", F64, False), ("price_per_hour", F64, True), ("currency", S, False)],
    "health": [("run_id", S, False), ("iteration", I32, False), ("check_name", S, False), ("source", S, False),
               ("status", S, False), ("value", F64, True), ("baseline", F64, True), ("ratio", F64, True),
               ("rule", S, False), ("detail", S, True)],
}


# ---- valid samples: 2 episodes x 3 steps (ids ep-0/0 .. ep-1/2) -------------------------------

def dataset_rows() -> list[dict]:
    return [
        {"prompt_id": f"q{i}", "data_source": "synthetic", "split": "train",
         "messages": json.dumps([{"role": "system", "content": "Use [search]."}, {"role": "user", "content": f"Q{i}?"}]),
         "ground_truth": json.dumps({"answers": ["Paris", "paris"]}),
         "env": json.dumps({"name": "search_qa", "kwargs": {"top_k": 3, "nested": {"a": [1, "b"]}}}),
         "metadata": json.dumps({"hops": 2})}
        for i in range(3)
    ]


def prompts_rows() -> list[dict]:
    return [{"run_id": "r1", "iteration": 0, **row} for row in dataset_rows()]


def corpus_rows() -> list[dict]:
    return [{"doc_id": f"d{i}", "title": f"T{i}", "text": "text"} for i in range(3)]


def steps_rows() -> list[dict]:
    rows = []
    for episode in range(2):
        for step in range(3):
            done = step == 2
            rows.append({
                "run_id": "r1", "iteration": 0, "episode_id": f"ep-{episode}", "group_id": "g0", "prompt_id": "q0",
                "sample_idx": episode, "step_idx": step, "policy_version": 0, "prompt_ids": [1, 2, 3],
                "response_ids": [4, 5], "response_logprobs": [-0.5, 0.0], "response_text": "<search>x</search>",
                "tool_calls": "[]" if done else json.dumps([{"name": "search", "arguments": {"query": "a, [b]"}}]),
                "parse_error": None, "observation_text": "" if done else "<result>...</result>", "env_reward": 0.0,
                "done": done, "termination": "answered" if done else None, "truncated": False, "finish_reason": "stop",
                "prefix_shared": not done, "info": json.dumps({"doc_ids": ["d1"], "note": "x\ny"}),
                "served_by": None, "retries": 0, "generated_at": 1.7e9 + step,
            })
    return rows


def rewards_rows() -> list[dict]:
    return [
        {"run_id": "r1", "iteration": 0, "episode_id": f"ep-{e}", "group_id": "g0", "prompt_id": "q0", "sample_idx": e,
         "step_idx": s, "process_reward": -0.1, "outcome_reward": 1.0 if s == 2 else 0.0,
         "process_factor": 1.0, "reward": 0.9 if s == 2 else -0.1, "em": 1.0 if s == 2 else None, "f1": None, "format_score": 0.5,
         "components": json.dumps({"em": 1.0, "format": 5e-1, "tool_fail": -1}), "scorer": "qa_em"}
        for e in range(2) for s in range(3)
    ]


def advantages_rows() -> list[dict]:
    return [
        {"run_id": "r1", "iteration": 0, "episode_id": f"ep-{e}", "step_idx": s, "advantages": [0.5, -0.5],
         "returns": [1.0, 1.0], "values": None if e else [0.2, 0.3], "ref_logprobs": None,
         "obs_advantages": [0.1, 0.2, 0.3] if e else None, "obs_returns": [1.0, 1.0, 1.0] if e else None,
         "obs_values": None, "estimator": "grpo"}
        for e in range(2) for s in range(3)
    ]


def train_metrics_rows() -> list[dict]:
    base = {"run_id": "r1", "iteration": 0, "loss": 0.5, "pg_loss": 0.4, "vf_loss": None, "entropy": 1.2, "kl": 0.01,
            "clipfrac": 0.1, "grad_norm": 0.7, "lr": 1e-5, "tokens": 100, "tokens_per_s": 40.0, "seconds": 2.5, "skipped": False,
            "skip_reason": None, "started_at": 1.7e9, "finished_at": 1.7e9 + 3}
    skipped = {**base, "update_idx": 1, "loss": math.nan, "pg_loss": math.nan, "grad_norm": math.nan,
               "skipped": True, "skip_reason": "no gradient signal"}
    return [{**base, "update_idx": 0}, skipped]


SAMPLES = {"dataset_prompts": dataset_rows, "corpus": corpus_rows, "prompts": prompts_rows, "steps": steps_rows,
           "rewards": rewards_rows, "advantages": advantages_rows, "train_metrics": train_metrics_rows}


def table(name: str, rows: list[dict]) -> pa.Table:
    return schemas.table_from_rows(name, rows)


# ---- schemas --------------------------------------------------------------------------------

def test_tables_are_the_eight_named_ones():
    assert set(schemas.TABLES) == set(EXPECTED_SCHEMAS)
    for name, spec in schemas.TABLES.items():
        assert spec.name == name


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEMAS))
def test_arrow_schema_is_the_contract(name):
    expected = pa.schema([pa.field(n, t, nullable=nullable) for n, t, nullable in EXPECTED_SCHEMAS[name]])
    assert schemas.TABLES[name].arrow_schema.equals(expected)
    assert set(schemas.TABLES[name].row_id_columns) <= set(expected.names)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_valid_sample_passes_and_comes_back_in_the_exact_schema(name):
    result = schemas.validate(name, table(name, SAMPLES[name]()))
    assert result.schema.equals(schemas.TABLES[name].arrow_schema)
    assert result.num_rows == len(SAMPLES[name]())


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_empty_table_is_valid(name):
    assert schemas.validate(name, schemas.TABLES[name].arrow_schema.empty_table()).num_rows == 0


# ---- one bad row per check --------------------------------------------------------------------

def _set(**values):
    return lambda rows, i: rows[i].update(values)


STEPS_CASES = [
    # (change, row index, column, check, row id)
    (_set(iteration=-1), 0, "iteration", ">= 0", "ep-0/0"),
    (_set(sample_idx=-1), 1, "sample_idx", ">= 0", "ep-0/1"),
    (_set(policy_version=-2), 4, "policy_version", ">= 0", "ep-1/1"),
    (_set(policy_version=1), 4, "policy_version", "<= iteration (no step comes from a newer policy)", "ep-1/1"),
    (_set(retries=-1), 1, "retries", ">= 0", "ep-0/1"),
    (_set(generated_at=math.nan), 2, "generated_at", "finite", "ep-0/2"),
    (_set(prompt_ids=[]), 0, "prompt_ids", "non-empty", "ep-0/0"),
    (_set(prompt_ids=[1, -3]), 3, "prompt_ids", "token ids >= 0", "ep-1/0"),
    (_set(prompt_ids=[1, None]), 3, "prompt_ids", "token ids >= 0", "ep-1/0"),
    (_set(response_ids=[4, -1]), 1, "response_ids", "token ids >= 0", "ep-0/1"),
    (_set(response_ids=[], response_logprobs=[]), 1, "response_ids",
     "non-empty unless the step records a failure (termination error)", "ep-0/1"),
    (_set(response_ids=[], response_logprobs=[], finish_reason="none"), 2, "response_ids",
     "non-empty unless the step records a failure (termination error)", "ep-0/2"),
    (_set(response_ids=[], response_logprobs=[]), 2, "finish_reason", "'none' iff response_ids is empty", "ep-0/2"),
    (_set(finish_reason="none"), 1, "finish_reason", "'none' iff response_ids is empty", "ep-0/1"),
    (_set(response_logprobs=[-0.5]), 1, "response_logprobs", "same length as response_ids", "ep-0/1"),
    (_set(response_logprobs=[-0.5, math.nan]), 2, "response_logprobs", "finite and <= 0.0001", "ep-0/2"),
    (_set(response_logprobs=[-math.inf, 0.0]), 2, "response_logprobs", "finite and <= 0.0001", "ep-0/2"),
    (_set(response_logprobs=[-0.5, 0.01]), 5, "response_logprobs", "finite and <= 0.0001", "ep-1/2"),
    (_set(tool_calls="{}"), 0, "tool_calls", "JSON list", "ep-0/0"),
    (_set(tool_calls="[1, 2"), 0, "tool_calls", "JSON list", "ep-0/0"),
    (_set(tool_calls='[], "k": 1'), 0, "tool_calls", "JSON list", "ep-0/0"),
    (_set(tool_calls="[] []"), 0, "tool_calls", "JSON list", "ep-0/0"),
    (_set(info="[]"), 4, "info", "JSON object", "ep-1/1"),
    (_set(info="null"), 4, "info", "JSON object", "ep-1/1"),
    (_set(info="{'a': 1}"), 4, "info", "JSON object", "ep-1/1"),
    (_set(info="{} {}"), 4, "info", "JSON object", "ep-1/1"),
    (_set(env_reward=math.inf), 3, "env_reward", "finite", "ep-1/0"),
    (_set(finish_reason="eos"), 3, "finish_reason", "one of stop, length, none", "ep-1/0"),
    (_set(termination="timeout"), 2, "termination", "one of answered, max_steps, max_context, error", "ep-0/2"),
    (_set(termination=None), 2, "termination", "set iff done", "ep-0/2"),
    (_set(termination="error"), 1, "termination", "set iff done", "ep-0/1"),
    (_set(prefix_shared=True), 5, "prefix_shared", "False on the done row", "ep-1/2"),
    (_set(termination="max_steps"), 5, "truncated", "True iff termination is one of max_steps, max_context", "ep-1/2"),
    (_set(truncated=True), 2, "truncated", "True iff termination is one of max_steps, max_context", "ep-0/2"),
    (_set(truncated=True), 1, "truncated", "True iff termination is one of max_steps, max_context", "ep-0/1"),
    (_set(done=False, termination=None), 5, "done", "exactly one done row per episode, on its last step", "ep-1/2"),
    (_set(done=True, termination="error", prefix_shared=False), 3, "done",
     "exactly one done row per episode, on its last step", "ep-1/0"),
    (_set(step_idx=1), 2, "step_idx", "unique per episode_id", "ep-0/1"),
    (_set(step_idx=4), 2, "step_idx", "contiguous from 0 within each episode", "ep-0/4"),
    (_set(step_idx=-1), 0, "step_idx", ">= 0", "ep-0/-1"),
    (_set(response_text=None), 1, "response_text", "not null", "ep-0/1"),
    (_set(done=None), 1, "done", "not null", "ep-0/1"),
]
REWARDS_CASES = [
    (_set(reward=1.0), 2, "reward", "equals outcome_reward + process_factor * process_reward (to 1e-06)", "ep-0/2"),
    (_set(process_factor=0.5), 0, "reward", "equals outcome_reward + process_factor * process_reward (to 1e-06)",
     "ep-0/0"),
    (_set(process_reward=math.nan), 0, "process_reward", "finite", "ep-0/0"),
    (_set(outcome_reward=-math.inf), 0, "outcome_reward", "finite", "ep-0/0"),
    (_set(em=1.5), 3, "em", "in [0, 1]", "ep-1/0"),
    (_set(f1=-0.1), 3, "f1", "in [0, 1]", "ep-1/0"),
    (_set(format_score=math.nan), 3, "format_score", "in [0, 1]", "ep-1/0"),
    (_set(components='{"em": "1"}'), 1, "components", "JSON object of name -> number", "ep-0/1"),
    (_set(components='{"em": true}'), 1, "components", "JSON object of name -> number", "ep-0/1"),
    (_set(components='{"em": NaN}'), 1, "components", "JSON object of name -> number", "ep-0/1"),
    (_set(components='{"em": {"x": 1}}'), 1, "components", "JSON object of name -> number", "ep-0/1"),
    (_set(components="[1]"), 1, "components", "JSON object of name -> number", "ep-0/1"),
    (_set(step_idx=0), 1, "step_idx", "unique per episode_id", "ep-0/0"),
    (_set(scorer=None), 1, "scorer", "not null", "ep-0/1"),
]
ADVANTAGES_CASES = [
    (_set(advantages=[], returns=[]), 0, "advantages", "non-empty", "ep-0/0"),
    (_set(advantages=[0.1, math.nan]), 0, "advantages", "finite", "ep-0/0"),
    (_set(returns=[1.0]), 4, "returns", "same length as advantages", "ep-1/1"),
    (_set(returns=[1.0, math.inf]), 4, "returns", "finite", "ep-1/1"),
    (_set(values=[0.1]), 1, "values", "same length as advantages", "ep-0/1"),
    (_set(ref_logprobs=[-1.0, -1.0, -1.0]), 1, "ref_logprobs", "same length as advantages", "ep-0/1"),
    (_set(step_idx=2), 0, "step_idx", "unique per episode_id", "ep-0/2"),
    (_set(values=[0.1, math.nan]), 0, "values", "finite", "ep-0/0"),
    (_set(obs_advantages=[0.1, math.inf, 0.0]), 3, "obs_advantages", "finite", "ep-1/0"),
    (_set(obs_returns=[1.0]), 3, "obs_returns", "same length as obs_advantages", "ep-1/0"),
    (_set(obs_values=[1.0]), 4, "obs_values", "same length as obs_advantages", "ep-1/1"),
    (_set(obs_returns=[1.0, 1.0, math.nan]), 3, "obs_returns", "finite", "ep-1/0"),
    (_set(obs_values=[0.0, -math.inf, 0.0]), 4, "obs_values", "finite", "ep-1/1"),
]
TRAIN_METRICS_CASES = [
    (_set(loss=math.nan), 0, "loss", "finite unless skipped", "r1/0/0"),
    (_set(pg_loss=math.inf), 0, "pg_loss", "finite unless skipped", "r1/0/0"),
    (_set(grad_norm=math.nan), 0, "grad_norm", "finite unless skipped", "r1/0/0"),
    (_set(skip_reason="why"), 0, "skip_reason", "set iff skipped", "r1/0/0"),
    (_set(skip_reason=None), 1, "skip_reason", "set iff skipped", "r1/0/1"),
    (_set(tokens=-1), 0, "tokens", ">= 0", "r1/0/0"),
    (_set(seconds=-0.5), 0, "seconds", ">= 0", "r1/0/0"),
    (_set(update_idx=-1), 0, "update_idx", ">= 0", "r1/0/-1"),
    (_set(iteration=-1), 0, "iteration", ">= 0", "r1/-1/0"),
]
MESSAGES_CHECK, GROUND_TRUTH_CHECK, ENV_CHECK = MESSAGES.description, GROUND_TRUTH.description, ENV.description
DATASET_CASES = [
    (_set(prompt_id="q0"), 1, "prompt_id", "unique", "q0"),
    (_set(split="val"), 1, "split", "one of train, dev, test", "q1"),
    (_set(messages="[]"), 1, "messages", MESSAGES_CHECK, "q1"),
    (_set(messages='[{"role": "user"}]'), 1, "messages", MESSAGES_CHECK, "q1"),
    (_set(messages='[{"role": 1, "content": "x"}]'), 1, "messages", MESSAGES_CHECK, "q1"),
    (_set(messages='[{"role": "user", "content": "x"}, null]'), 1, "messages", MESSAGES_CHECK, "q1"),
    (_set(messages='{"role": "user", "content": "x"}'), 1, "messages", MESSAGES_CHECK, "q1"),
    (_set(ground_truth='{"answers": []}'), 2, "ground_truth", GROUND_TRUTH_CHECK, "q2"),
    (_set(ground_truth='{"answers": ["a", 1]}'), 2, "ground_truth", GROUND_TRUTH_CHECK, "q2"),
    (_set(ground_truth='{"answer": ["a"]}'), 2, "ground_truth", GROUND_TRUTH_CHECK, "q2"),
    (_set(ground_truth='["a"]'), 2, "ground_truth", GROUND_TRUTH_CHECK, "q2"),
    (_set(env='{"name": "x"}'), 0, "env", ENV_CHECK, "q0"),
    (_set(env='{"name": "x", "kwargs": []}'), 0, "env", ENV_CHECK, "q0"),
    (_set(env='{"name": null, "kwargs": {}}'), 0, "env", ENV_CHECK, "q0"),
    (_set(metadata="[]"), 0, "metadata", "JSON object", "q0"),
    (_set(metadata=""), 0, "metadata", "JSON object", "q0"),
    (_set(data_source=None), 0, "data_source", "not null", "q0"),
]
PROMPTS_CASES = [
    (_set(prompt_id="q0"), 1, "prompt_id", "unique within (run_id, iteration)", "r1/0/q0"),
    (_set(iteration=-1), 1, "iteration", ">= 0", "r1/-1/q1"),
    (_set(split="validation"), 1, "split", "one of train, dev, test", "r1/0/q1"),
    (_set(messages="not json"), 2, "messages", MESSAGES_CHECK, "r1/0/q2"),
    (_set(env="{}"), 2, "env", ENV_CHECK, "r1/0/q2"),
]
CORPUS_CASES = [
    (_set(doc_id="d0"), 2, "doc_id", "unique", "d0"),
    (_set(title=None), 1, "title", "not null", "d1"),
]
CASES = [("steps", *c) for c in STEPS_CASES] + [("rewards", *c) for c in REWARDS_CASES] + [
    ("advantages", *c) for c in ADVANTAGES_CASES] + [("train_metrics", *c) for c in TRAIN_METRICS_CASES] + [
    ("dataset_prompts", *c) for c in DATASET_CASES] + [("prompts", *c) for c in PROMPTS_CASES] + [
    ("corpus", *c) for c in CORPUS_CASES]


@pytest.mark.parametrize("name, change, index, column, check, row_id", CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_one_bad_row_is_named(name, change, index, column, check, row_id):
    rows = SAMPLES[name]()
    change(rows, index)
    with pytest.raises(schemas.TableValidationError) as caught:
        schemas.validate(name, table(name, rows))
    error = caught.value
    assert error.table == name and str(error).startswith(f"{name}: ")
    matching = [f for f in error.failures if (f.column, f.check) == (column, check)]
    assert matching, f"no failure ({column!r}, {check!r}) in: {error}"
    assert row_id in matching[0].row_ids
    assert f"column '{column}' failed check '{check}' at rows [" in str(error)


def test_a_failed_episode_may_end_on_a_step_with_no_action():
    rows = [r for r in steps_rows() if r["episode_id"] == "ep-0"][:1]
    rows[0].update(done=True, termination="error", prefix_shared=False, response_ids=[], response_logprobs=[],
                   response_text="", finish_reason="none", info='{"error": "exit code 3"}')
    schemas.validate("steps", table("steps", rows))


def test_prefix_shared_may_be_false_before_the_end():
    rows = steps_rows()
    rows[0]["prefix_shared"] = False  # context management may rewrite the next context
    schemas.validate("steps", table("steps", rows))


def test_same_prompt_id_in_another_iteration_is_fine():
    rows = prompts_rows()
    rows[1].update(prompt_id="q0", iteration=1)
    schemas.validate("prompts", table("prompts", rows))


def test_message_names_table_column_check_and_rows_like_the_contract():
    rows = steps_rows()
    rows[1]["response_logprobs"] = [-0.1]
    rows[4]["response_logprobs"] = [-0.1, -0.2, -0.3]
    with pytest.raises(schemas.TableValidationError) as caught:
        schemas.validate("steps", table("steps", rows))
    assert str(caught.value) == (
        "steps: column 'response_logprobs' failed check 'same length as response_ids' at rows [ep-0/1, ep-1/1] (2 rows)"
    )
    assert (caught.value.column, caught.value.row_ids, caught.value.row_count) == (
        "response_logprobs", ["ep-0/1", "ep-1/1"], 2)


def test_many_bad_rows_show_ten_and_the_count():
    rows = [{**corpus_rows()[0], "doc_id": f"d{i}", "title": None} for i in range(25)]
    with pytest.raises(schemas.TableValidationError) as caught:
        schemas.validate("corpus", table("corpus", rows))
    message = str(caught.value)
    assert message.endswith("at rows [d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, ...] (25 rows)")
    assert len(caught.value.row_ids) == 25


def test_several_failures_are_all_reported():
    rows = steps_rows()
    rows[0]["finish_reason"] = "eos"
    rows[3]["env_reward"] = math.nan
    with pytest.raises(schemas.TableValidationError) as caught:
        schemas.validate("steps", table("steps", rows))
    assert {(f.column, f.row_ids) for f in caught.value.failures} == {
        ("env_reward", ("ep-1/0",)), ("finish_reason", ("ep-0/0",))}
    assert "also column" in str(caught.value)


# ---- conforming to the schema -------------------------------------------------------------------

def test_columns_are_reordered_and_safely_cast():
    valid = table("steps", steps_rows())
    loose = pa.table({name: valid[name] for name in reversed(valid.column_names)})
    loose = loose.set_column(loose.schema.get_field_index("step_idx"), "step_idx", pc.cast(valid["step_idx"], pa.int64()))
    index = loose.schema.get_field_index("response_logprobs")
    loose = loose.set_column(index, "response_logprobs", pc.cast(valid["response_logprobs"], pa.list_(pa.float64())))
    result = schemas.validate("steps", loose)
    assert result.schema.equals(schemas.TABLES["steps"].arrow_schema)
    assert result.column("step_idx").to_pylist() == valid.column("step_idx").to_pylist()


def test_missing_column_is_named():
    with pytest.raises(schemas.TableValidationError, match="column 'done' failed check 'present'") as caught:
        schemas.validate("steps", table("steps", steps_rows()).drop_columns(["done"]))
    assert caught.value.column == "done"


def test_unexpected_column_is_named():
    extra = table("corpus", corpus_rows()).append_column("score", pa.array([1.0, 2.0, 3.0]))
    with pytest.raises(schemas.TableValidationError, match="column 'score' failed check 'known column'"):
        schemas.validate("corpus", extra)


def test_uncastable_column_is_named():
    valid = table("steps", steps_rows())
    bad = valid.set_column(valid.schema.get_field_index("step_idx"), "step_idx", pa.array(["a"] * valid.num_rows))
    with pytest.raises(schemas.TableValidationError, match="column 'step_idx' failed check 'type int32'"):
        schemas.validate("steps", bad)


def test_overflowing_cast_is_refused():
    valid = table("train_metrics", train_metrics_rows())
    big = valid.set_column(valid.schema.get_field_index("update_idx"), "update_idx", pa.array([0, 2**40]))
    with pytest.raises(schemas.TableValidationError, match="update_idx"):
        schemas.validate("train_metrics", big)


def test_rows_with_a_wrong_value_type_name_the_column():
    rows = steps_rows()
    rows[2]["prompt_ids"] = [1, "two"]
    with pytest.raises(schemas.TableValidationError, match="column 'prompt_ids' failed check 'type list<item: int32>'"):
        table("steps", rows)


def test_unknown_table_lists_the_valid_names():
    with pytest.raises(schemas.UnknownTableError) as caught:
        schemas.validate("step", pa.table({}))
    assert "unknown table 'step'" in str(caught.value)
    assert all(name in str(caught.value) for name in schemas.TABLES)


# ---- JSON checks against a json.loads reference -------------------------------------------------

def _reference(text, accepts):
    try:
        return bool(accepts(json.loads(text)))
    except ValueError:
        return False


JSON_CELLS = [
    "[]", "{}", " [1, 2] ", "\n[\n  1\n]\n", '{"a": "x\\ny"}', '["a", "b]", "c"]', '[{"q": "], \\"k\\": ["}]',
    '[[1], [2, [3]], {"a": [4]}]', '[], "k": 1', '[1], [2]', '{}, "k": 1', '{"a": 1}, {"b": 2}', "[1,]", "[1",
    "null", "1", '"[]"', "", " ", "[] x", '{"a": NaN}', '[{"role": "user", "content": "hi"}]',
    '[{"role": "user", "content": "hi", "name": "n"}, {"role": "tool", "content": ""}]',
    '[{"role": "user", "content": 5}]', '[{"role": "user"}]', '[null]', '{"answers": ["a"]}',
    '{"answers": ["a"], "aliases": 3}', '{"answers": "a"}', '{"answers": [null]}', '{"answers": []}',
    '{"name": "e", "kwargs": {"k": [1, {"x": null}]}}', '{"name": "e", "kwargs": null}', '{"name": 1, "kwargs": {}}',
    '{"a": "\\u00e9\\ud83d\\ude00"}', '{"a": 1, "a": 2}', '[{"role": "u", "content": "c"}] , "k": {}',
]
SHAPES = [
    JsonShape("list", "list", lambda v: isinstance(v, list)),
    JsonShape("object", "object", lambda v: isinstance(v, dict)),
    MESSAGES, GROUND_TRUTH, ENV,
]


@pytest.mark.parametrize("shape", SHAPES, ids=[s.description for s in SHAPES])
def test_json_check_agrees_with_the_reference_cell_by_cell(shape):
    expected = [_reference(cell, shape.accepts) for cell in JSON_CELLS]
    for cell, want in zip(JSON_CELLS, expected):
        one = json_check("c", shape)(pa.table({"c": [cell]}))
        assert one.to_pylist() == [want], cell
    mixed = json_check("c", shape)(pa.table({"c": JSON_CELLS}))  # some cells break the fast path
    assert mixed.to_pylist() == expected


@pytest.mark.parametrize("shape", SHAPES, ids=[s.description for s in SHAPES])
def test_vectorised_json_path_handles_whole_valid_columns(shape):
    parseable = [c for c in JSON_CELLS if _reference(c, lambda v: isinstance(v, (list, dict)))]
    cells = [c for c in parseable if _reference(c, lambda v: isinstance(v, list if shape.kind == "list" else dict))]
    good = [c for c in cells if _reference(c, shape.accepts)]
    verdict = _json_check_vectorised(pa.array(good * 3), shape)
    assert verdict is not None and verdict.to_pylist() == [True] * (3 * len(good))
    if shape.kind == "list":  # the escape guard, on cells that parse fine inside the wrapper
        escaped = ['[], "k": 1', '[{"role": "u", "content": "c"}] , "k": {}']
        verdict = _json_check_vectorised(pa.array(good + escaped), JsonShape("list", "list", shape.accepts))
        assert verdict is not None and verdict.to_pylist() == [True] * len(good) + [False] * 2


def test_json_check_leaves_nulls_to_the_nullability_rule():
    assert json_check("c", SHAPES[1])(pa.table({"c": ["{}", None, "x"]})).to_pylist() == [True, None, False]


def _is_number_map(text):
    try:
        value = json.loads(text, parse_constant=lambda _: None)
    except ValueError:
        return False
    return isinstance(value, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value.values())


def test_number_map_regex_agrees_with_the_reference():
    cells = ["{}", '{"em": 1}', '{"em": -0.5, "f1": 1e-3, "x": 2E+2}', ' { "a" : 0 } ', '{"a\\"b": 1}',
             '{"a": 01}', '{"a": .5}', '{"a": 1.}', '{"a": "1"}', '{"a": true}', '{"a": null}', '{"a": NaN}',
             '{"a": Infinity}', '{"a": [1]}', '{"a": 1,}', '{"a": 1} x', '[1]', "", '{"\\u00e9": 3}', '{"a": -}',
             '{"a": 1, "b": 2}\n']
    got = json_number_map("c")(pa.table({"c": cells})).to_pylist()
    assert got == [_is_number_map(c) for c in cells]


# ---- size -----------------------------------------------------------------------------------------

def _big_steps_table(episodes: int, steps_per_episode: int) -> pa.Table:
    n = episodes * steps_per_episode
    step = [i % steps_per_episode for i in range(n)]
    done = [s == steps_per_episode - 1 for s in step]

    def lists(length, value_type, value):
        offsets = pa.array(range(0, (n + 1) * length, length), pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array([value] * (n * length), value_type))

    columns = {
        "run_id": pa.array(["r1"] * n), "iteration": pa.array([3] * n, pa.int32()),
        "episode_id": pa.array([f"ep-{i // steps_per_episode}" for i in range(n)]),
        "group_id": pa.array([f"g{i // (8 * steps_per_episode)}" for i in range(n)]),
        "prompt_id": pa.array([f"q{i // (8 * steps_per_episode)}" for i in range(n)]),
        "sample_idx": pa.array([(i // steps_per_episode) % 8 for i in range(n)], pa.int32()),
        "step_idx": pa.array(step, pa.int32()), "policy_version": pa.array([3] * n, pa.int32()),
        "prompt_ids": lists(16, pa.int32(), 7), "response_ids": lists(8, pa.int32(), 9),
        "response_logprobs": lists(8, pa.float32(), -0.25), "response_text": pa.array(["<search>q</search>"] * n),
        "tool_calls": pa.array(["[]" if d else f'[{{"name": "search", "arguments": {{"query": "q{i}"}}}}]'
                                for i, d in enumerate(done)]),
        "parse_error": pa.nulls(n, pa.string()), "observation_text": pa.array(["obs"] * n),
        "env_reward": pa.array([0.0] * n), "done": pa.array(done),
        "termination": pa.array(["answered" if d else None for d in done], pa.string()),
        "truncated": pa.array([False] * n),
        "finish_reason": pa.array(["stop"] * n), "prefix_shared": pa.array([not d for d in done]),
        "info": pa.array([f'{{"doc_ids": ["d{i}"], "n": {i}}}' for i in range(n)]),
        "served_by": pa.array(["replica-0"] * n), "retries": pa.array([0] * n, pa.int32()),
        "generated_at": pa.array([1.7e9] * n),
    }
    return pa.table(columns)


def test_hundred_thousand_steps_rows_validate():
    big = _big_steps_table(episodes=25_000, steps_per_episode=4)
    assert big.num_rows == 100_000
    assert schemas.validate("steps", big).num_rows == 100_000
    broken = big.set_column(big.schema.get_field_index("done"), "done", pc.invert(big["done"]))
    with pytest.raises(schemas.TableValidationError) as caught:
        schemas.validate("steps", broken)
    assert caught.value.failures[0].row_count > 0
