"""Evaluation: naive_rag prompts by hand, scoring with a rule-following engine double and with the
real tiny HF model, the eval table's schema, the report's mean ± std by hand, and (slow) the flow
and `agentr1 eval` end to end after a one-iteration training run."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pyarrow as pa
import pytest

import schemas
from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.eval.methods import (
    EVAL_METHODS,
    EvalSettings,
    naive_rag_episodes,
    naive_rag_messages,
    question_text,
    tool_agent_episodes,
)
from agent_core.eval.report import AVERAGE, eval_report
from agent_core.io.checkpoints import save_policy
from agent_core.io.layout import DataRoot
from agent_core.io.query import run_query
from agent_core.io.tables import read_table, rows_of, write_table
from agent_core.rollout.engine import Generation
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage, Document, Prompt

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def task():
    dataset = generate_synthetic_qa(seed=5, num_films=12, num_people=10, num_cities=5, num_countries=3)
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    return dataset, build_tokenizer(texts, vocab_size=400)


class RuleEngine:
    """Answers each context with `respond(context_text)`; records every context it received."""

    def __init__(self, tokenizer, respond):
        self.tokenizer, self.respond = tokenizer, respond
        self.received: list[str] = []

    def generate(self, prompts, params):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            self.received.append(text)
            action = self.tokenizer.encode(self.respond(text), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Generation(action, [-1.0] * len(action), "stop"))
        return out


# ---- naive_rag prompt ------------------------------------------------------------------------


def test_naive_rag_prompt_keeps_the_system_message_and_lists_passages_then_the_question():
    prompt = Prompt("p1", "synthetic", "test",
                    (ChatMessage("system", "Answer the question."), ChatMessage("user", "Question: Where was Kelmo born?")),
                    ("Tarport",), "search_qa")
    passages = [Document("d1", "Kelmo", "Kelmo was born in Tarport."), Document("d2", "Tarport", "Tarport is a city in Vesia.")]
    assert question_text(prompt) == "Where was Kelmo born?"
    assert naive_rag_messages(prompt, passages) == (
        ChatMessage("system", "Answer the question."),
        ChatMessage("user", "Passages:\n[1] Kelmo: Kelmo was born in Tarport.\n[2] Tarport: Tarport is a city in Vesia.\n\n"
                            "Question: Where was Kelmo born?\n\nAnswer with <answer>...</answer>."),
    )
    assert naive_rag_messages(prompt, [])[1].content.startswith("Passages:\n(none found)\n\nQuestion:")


def test_naive_rag_retrieves_once_generates_once_and_scores_the_answer_or_the_raw_text(task):
    dataset, tokenizer = task
    prompts = [p for p in dataset.prompts if p.split == "train"][:3]
    golds = {question_text(p): p.answers[0] for p in prompts}

    def respond(context: str) -> str:
        question = next(q for q in golds if q in context)
        if question == question_text(prompts[0]):
            return f"<answer>{golds[question]}</answer>"
        if question == question_text(prompts[1]):
            return f"  {golds[question]} \n"  # right, but without the tag
        return "<answer>nobody</answer>"

    engine = RuleEngine(tokenizer, respond)
    episodes = naive_rag_episodes(engine, tokenizer, prompts, dataset.documents, EvalSettings(top_k=3))
    assert len(engine.received) == 3  # one generation per prompt
    by_id = {p.prompt_id: p for p in prompts}
    for context, prompt in zip(engine.received, prompts):
        first_hop = next(d for d in dataset.documents if d.doc_id == prompt.metadata["supporting_doc_ids"][0])
        assert first_hop.text in context and "<search>" not in context  # retrieved; no tool instructions
    assert [(e.prediction, e.em, e.format_ok, e.termination) for e in episodes] == [
        (prompts[0].answers[0], 1.0, True, "answered"),
        (prompts[1].answers[0], 1.0, False, None),
        ("nobody", 0.0, True, "answered"),
    ]
    assert all(e.steps == 1 and e.tool_calls == 0 and e.data_source == by_id[e.prompt_id].data_source for e in episodes)


def test_tool_agent_scores_the_answered_step_and_counts_steps_and_calls(task):
    dataset, tokenizer = task
    prompts = [p for p in dataset.prompts if p.split == "train"][:3]
    solved, wrong, looping = prompts

    def respond(context: str) -> str:
        turns = context.count("<|im_start|>assistant") - 1  # earlier actions in the context
        if question_text(solved) in context:
            return "<search>anything</search>" if turns == 0 else f"<answer>{solved.answers[0]}</answer>"
        if question_text(wrong) in context:
            return "<answer>nobody at all</answer>"
        return "<search>again</search>"

    settings = EvalSettings(max_steps=3, max_new_tokens=24, max_context_tokens=4096)
    episodes = tool_agent_episodes(RuleEngine(tokenizer, respond), tokenizer, prompts, dataset.documents, settings)
    summary = [(e.prompt_id, e.prediction, e.em, e.f1, e.format_ok, e.steps, e.tool_calls, e.termination) for e in episodes]
    assert summary == [
        (solved.prompt_id, solved.answers[0], 1.0, 1.0, True, 2, 1, "answered"),
        (wrong.prompt_id, "nobody at all", 0.0, 0.0, True, 1, 0, "answered"),
        (looping.prompt_id, "", 0.0, 0.0, False, 3, 3, "max_steps"),
    ]


def test_sampled_settings_need_a_positive_temperature_and_greedy_means_temperature_zero(task):
    with pytest.raises(ValueError, match="temperature > 0"):
        EvalSettings(greedy=False, temperature=0.0)
    with pytest.raises(ValueError, match="max_steps"):
        EvalSettings(max_steps=0)
    assert EvalSettings(greedy=True, temperature=0.7).sampling(task[1]).temperature == 0.0
    sampled = EvalSettings(greedy=False, temperature=0.7, seed=4).sampling(task[1])
    assert (sampled.temperature, sampled.seed) == (0.7, 4)
    with pytest.raises(ValueError, match="valid eval method names: agent, base_tool_call, naive_rag"):
        EVAL_METHODS.get("rag")


# ---- the real tiny model -> a valid eval table -------------------------------------------------


def test_real_tiny_policy_fills_a_valid_eval_table_reproducibly(task, tmp_path):
    dataset, tokenizer = task
    policy_dir = save_policy(build_tiny_policy(tokenizer, hidden_size=32, num_layers=1, num_heads=2,
                                               intermediate_size=64), tokenizer, tmp_path / "policy")
    prompts = [p for p in dataset.prompts if p.split == "train"][:3]
    rows, predictions = [], {}
    for method in ("naive_rag", "agent"):
        for greedy, seed in ((True, 0), (True, 1), (False, 7), (False, 7)):
            settings = EvalSettings(seed=seed, greedy=greedy, max_new_tokens=8, max_steps=2, max_context_tokens=1024)
            episodes = EVAL_METHODS.get(method)(policy_dir, prompts, dataset.documents, settings)
            predictions.setdefault((method, greedy), []).append([e.prediction for e in episodes])
            if (greedy, seed) != (False, 7) or len(predictions[(method, greedy)]) == 1:
                rows += rows_of(episodes, eval_id="ev", method=method, checkpoint=str(policy_dir), split="train",
                                seed=seed if greedy else seed + 100)
    for (method, greedy), runs in predictions.items():
        assert runs[0] == runs[1], (method, greedy)  # greedy ignores the seed; a sampled seed replays
    uri = write_table("eval", rows, tmp_path / "eval.parquet")
    table = read_table("eval", uri)
    assert table.num_rows == 2 * 3 * 3
    assert set(table.column("method").to_pylist()) == {"naive_rag", "agent"}
    agent_rows = [r for r in table.to_pylist() if r["method"] == "agent"]
    assert all(1 <= r["steps"] <= 2 and r["termination"] in ("answered", "max_steps", "max_context", "error") for r in agent_rows)
    assert eval_report(table).cell("agent", AVERAGE).em.seeds == 3


# ---- schema ------------------------------------------------------------------------------------


def _row(**overrides) -> dict:
    row = {"eval_id": "ev", "method": "naive_rag", "checkpoint": "/p", "data_source": "synthetic", "split": "test",
           "seed": 0, "prompt_id": "q0", "prediction": "Paris", "em": 1.0, "f1": 1.0, "format_ok": True, "steps": 1,
           "tool_calls": 0, "termination": None}
    return {**row, **overrides}


def test_eval_schema_names_duplicate_keys_and_out_of_range_scores():
    schemas.validate("eval", schemas.table_from_rows("eval", [_row(), _row(seed=1), _row(method="agent")]))
    with pytest.raises(schemas.TableValidationError) as duplicate:
        schemas.validate("eval", schemas.table_from_rows("eval", [_row(), _row(prediction="x")]))
    assert duplicate.value.check == "unique per eval_id, method, seed" and duplicate.value.row_ids == ["ev/naive_rag/0/q0"]
    with pytest.raises(schemas.TableValidationError) as bad_f1:
        schemas.validate("eval", schemas.table_from_rows("eval", [_row(), _row(prompt_id="q1", f1=1.5, tool_calls=-1)]))
    assert {f.check for f in bad_f1.value.failures} == {"in [0, 1]", ">= 0"}
    assert bad_f1.value.row_ids == ["ev/naive_rag/0/q1"]


def test_eval_layout_paths_and_the_duckdb_view(tmp_path):
    root = DataRoot(tmp_path)
    uri = root.eval_table_uri("ev1", "agent", 2)
    assert uri == str(tmp_path / "evals" / "ev1" / "agent" / "seed=2" / "eval.parquet")
    assert root.eval_report_path("ev1") == tmp_path / "evals" / "ev1" / "report.md"
    with pytest.raises(ValueError, match="invalid eval id"):
        root.eval_dir("../x")
    assert run_query(tmp_path, "select count(*) as n from eval").to_pylist() == [{"n": 0}]  # a view before any file
    write_table("eval", [_row(method="agent", seed=2), _row(method="agent", seed=2, prompt_id="q1", em=0.0)], uri)
    assert run_query(tmp_path, "select method, avg(em) as em from eval group by 1").to_pylist() == [{"method": "agent", "em": 0.5}]


def test_last_checkpoint_is_the_highest_saved_iteration(tmp_path):
    from flows.eval import run_checkpoints

    run = DataRoot(tmp_path).run("r1")
    assert run.last_checkpoint_dir() is None
    for k in (0, 1, 2):
        run.iteration_dir(k).mkdir(parents=True)
    for k in (0, 1):
        run.checkpoint_dir(k).mkdir()
    assert run.last_checkpoint_dir() == run.checkpoint_dir(1)  # iteration 2 has no checkpoint yet
    chosen = run_checkpoints(run, ["naive_rag", "base_tool_call", "agent"])
    assert chosen == {"naive_rag": str(run.initial_policy_dir), "base_tool_call": str(run.initial_policy_dir),
                      "agent": str(run.checkpoint_dir(1))}
    run.warm_start_policy_dir.mkdir(parents=True)
    assert run_checkpoints(run, ["base_tool_call"])["base_tool_call"] == str(run.warm_start_policy_dir)
    with pytest.raises(ValueError, match="unknown eval method 'sft'"):
        run_checkpoints(run, ["sft"])


# ---- report ------------------------------------------------------------------------------------

# per (method, source): per-seed EM of each prompt; F1 = EM / 2 everywhere
_EM = {
    ("naive_rag", "a"): [[1, 0], [1, 1], [0, 0]],
    ("naive_rag", "b"): [[1, 1], [1, 1], [1, 0]],
    ("agent", "a"): [[1, 1], [1, 0], [1, 1]],
    ("agent", "b"): [[0], [1], [0]],  # one prompt: the average column weighs sources, not prompts
}


def _report_table() -> pa.Table:
    rows = [
        _row(method=method, data_source=source, seed=seed, prompt_id=f"{source}{i}", em=float(em), f1=em / 2)
        for (method, source), per_seed in _EM.items() for seed, ems in enumerate(per_seed) for i, em in enumerate(ems)
    ]
    return schemas.validate("eval", schemas.table_from_rows("eval", rows))


def test_report_is_mean_and_sample_std_over_per_seed_means_written_out_by_hand():
    report = eval_report(_report_table())
    # naive_rag/a seeds .5, 1, 0 -> .5 ± .5; naive_rag/b 1, 1, .5 -> .8333 ± .2887;
    # naive_rag avg per seed .75, 1, .25 -> .6667 ± .3819; agent/a 1, .5, 1 -> .8333 ± .2887;
    # agent/b 0, 1, 0 -> .3333 ± .5774; agent avg .5, .75, .5 -> .5833 ± .1443 (pooled rows would give .667 for seed 0)
    assert report.markdown() == (
        "### EM (mean ± std over seeds)\n\n"
        "| Method | Seeds | a | b | Avg |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| naive_rag | 3 | 0.500 ± 0.500 | 0.833 ± 0.289 | 0.667 ± 0.382 |\n"
        "| agent | 3 | 0.833 ± 0.289 | 0.333 ± 0.577 | 0.583 ± 0.144 |\n\n"
        "### F1 (mean ± std over seeds)\n\n"
        "| Method | Seeds | a | b | Avg |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| naive_rag | 3 | 0.250 ± 0.250 | 0.417 ± 0.144 | 0.333 ± 0.191 |\n"
        "| agent | 3 | 0.417 ± 0.144 | 0.167 ± 0.289 | 0.292 ± 0.072 |\n"
    )
    metrics = report.metrics()
    assert metrics["eval/agent/average/em"] == pytest.approx(7 / 12)
    assert metrics["eval/agent/b/em_std"] == pytest.approx(math.sqrt(1 / 3))
    assert metrics["eval/naive_rag/a/f1"] == pytest.approx(0.25)
    assert len(metrics) == 2 * 3 * 2 * 2  # methods x (sources + average) x metrics x (mean, std)


def test_one_seed_has_zero_std_and_a_missing_cell_is_a_dash():
    rows = [_row(method="agent", data_source="a", em=1.0, f1=1.0), _row(method="naive_rag", data_source="b", em=0.0, f1=0.5)]
    report = eval_report(schemas.table_from_rows("eval", rows))
    lines = report.markdown().splitlines()
    assert lines[4] == "| agent | 1 | 1.000 ± 0.000 | – | 1.000 ± 0.000 |"
    assert lines[5] == "| naive_rag | 1 | – | 0.000 ± 0.000 | 0.000 ± 0.000 |"
    with pytest.raises(ValueError, match="no rows"):
        eval_report(schemas.TABLES["eval"].arrow_schema.empty_table())


# ---- the flow and the command, end to end (slow) -----------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from agent_core.validation import load_config
    from flows.train import train

    data_root = tmp_path_factory.mktemp("eval-data")
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", [f"data_root={data_root}", "run_id=ev-run", "iterations=1"])
    train(config)
    return data_root


@pytest.mark.slow
def test_agentr1_eval_prints_the_table_and_writes_report_tables_mlflow_and_artifact(trained_run, capsys):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.cli import main as cli_main
    from tasks.evaluate import artifact_key

    root = DataRoot(trained_run)
    code = cli_main(["eval", "--data-root", str(trained_run), "--run-id", "ev-run", "--seeds", "3", "--limit", "2",
                     "--eval-id", "ev-cli"])
    printed = capsys.readouterr().out
    assert code == 0
    report = root.eval_report_path("ev-cli").read_text()
    assert report in printed and str(root.eval_report_path("ev-cli")) in printed
    for method in ("naive_rag", "base_tool_call", "agent"):
        assert re.search(rf"^\| {method} \| 3 \| \d\.\d{{3}} ± \d\.\d{{3}} \|", report, re.MULTILINE), method
    table = run_query(trained_run, "select method, seed, count(*) as n from eval group by 1, 2 order by 1, 2")
    assert table.to_pylist() == [{"method": m, "seed": s, "n": 2} for m in ("agent", "base_tool_call", "naive_rag") for s in range(3)]
    used = run_query(trained_run, "select distinct method, checkpoint from eval").to_pylist()
    checkpoints = {row["method"]: row["checkpoint"] for row in used}
    run = root.run("ev-run")
    assert checkpoints == {"agent": str(run.checkpoint_dir(0)), "base_tool_call": str(run.initial_policy_dir),
                           "naive_rag": str(run.initial_policy_dir)}

    client = MlflowClient(root.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name("agentr1-eval")
    (mlflow_run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`agentr1.run_id` = 'ev-cli'")
    metrics = mlflow_run.data.metrics
    assert {f"eval/{m}/average/em" for m in ("naive_rag", "base_tool_call", "agent")} <= set(metrics)
    assert 0.0 <= metrics["eval/agent/synthetic/f1"] <= 1.0
    assert mlflow_run.data.params["split"] == "test" and mlflow_run.data.params["seeds"] == "0,1,2"

    with get_client(sync_client=True) as prefect_client:
        key = artifact_key("ev-cli")
        artifacts = prefect_client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert artifacts and artifacts[0].type == "markdown" and artifacts[0].data == report


@pytest.mark.slow
def test_eval_flow_with_dataset_uris_resumes_finished_tables_and_refuses_bad_inputs(trained_run):
    from flows.eval import evaluate_methods
    from tasks.prepare_data import DatasetUris

    root = DataRoot(trained_run)
    dataset_dir = next((trained_run / "datasets").iterdir())
    dataset = DatasetUris(dataset_dir.name, str(dataset_dir / "prompts.parquet"), str(dataset_dir / "corpus.parquet"))
    checkpoints = {"naive_rag": str(root.run("ev-run").initial_policy_dir)}
    settings = EvalSettings(greedy=True, max_new_tokens=8, max_context_tokens=512)
    first = evaluate_methods(str(trained_run), checkpoints, dataset=dataset, seeds=[0, 1], settings=settings,
                             limit=2, eval_id="ev-flow")
    written = {uri: Path(uri).stat().st_mtime_ns for uri in first.table_uris}
    again = evaluate_methods(str(trained_run), checkpoints, dataset=dataset, seeds=[0, 1], settings=settings,
                             limit=2, eval_id="ev-flow")
    assert {uri: Path(uri).stat().st_mtime_ns for uri in again.table_uris} == written  # kept, not redone
    assert again.markdown == first.markdown and "| naive_rag | 2 | " in first.markdown
    with pytest.raises(ValueError, match="has no checkpoint"):
        evaluate_methods(str(trained_run), checkpoints, methods=["agent"], dataset=dataset)
