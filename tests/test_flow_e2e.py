"""End to end: the real Prefect flow on a tiny config, then SQL, MLflow, and a rerun of one stage."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from agent_core.io.layout import RUN_TABLES, DataRoot
from agent_core.io.query import run_query
from agent_core.io.tables import read_table
from agent_core.validation import load_config
from flows.cli import main as cli_main
from agent_core.io.tombstones import read_tombstone
from flows.rerun import rerun_stage
from flows.train import train
from tasks.track import TrackingRef, log_iteration
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data_root = tmp_path_factory.mktemp("data")
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", [f"data_root={data_root}", "run_id=e2e"])
    result = train(config)
    return config, result, DataRoot(data_root)


def test_every_stage_wrote_its_table_for_every_iteration(trained):
    config, result, root = trained
    run = root.run("e2e")
    for k in range(config.iterations):
        for table in RUN_TABLES:
            assert Path(run.table_uri(k, table)).is_file(), (k, table)
    # retention's defaults (checkpoints.keep_last: 1; no dev EM above the others): only the newest
    # iteration keeps its checkpoint and optimizer state; the older ones leave tombstones
    newest = config.iterations - 1
    assert (run.checkpoint_dir(newest) / "model.safetensors").is_file() and run.optimizer_state_path(newest).is_file()
    for k in range(newest):
        assert not run.checkpoint_dir(k).exists() and not run.optimizer_state_path(k).exists(), k
        assert read_tombstone(run.checkpoint_dir(k)) is not None and read_tombstone(run.optimizer_state_path(k)), k
    steps = read_table("steps", run.table_uri(0, "steps"))
    episodes = set(steps.column("episode_id").to_pylist())
    assert len(episodes) == config.data.prompts_per_iteration * config.rollout.group_size
    assert [s.iteration for s in result.iterations] == list(range(config.iterations))


README_QUERY = ("select iteration, count(*) as episodes, avg(ret) as mean_reward from (select iteration, episode_id, "
                "sum(reward) as ret from rewards group by all) group by 1 order by 1")


def test_sql_over_all_tables_answers_the_readme_query(trained):
    config, result, root = trained
    assert README_QUERY in (REPO_ROOT / "README.md").read_text()
    table = run_query(root.path, README_QUERY)
    assert table.column("iteration").to_pylist() == list(range(config.iterations))
    # per episode, as the end-of-run summary and MLflow's mean_reward
    assert table.column("mean_reward").to_pylist() == pytest.approx([s.mean_reward for s in result.iterations])
    episodes = run_query(root.path, "select iteration, count(distinct episode_id) as n from steps group by 1 order by 1")
    assert table.column("episodes").to_pylist() == episodes.column("n").to_pylist()


def test_mlflow_has_the_run_metrics_and_one_model_version_per_iteration(trained):
    config, result, _ = trained
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.data.params["algorithm.estimator"] == "grpo"
    for metric in ("mean_reward", "em", "steps_per_episode", "loss", "kl", "rollout_tokens_per_s", "train_tokens_per_s"):
        history = client.get_metric_history(result.mlflow_run_id, metric)
        assert [m.step for m in history] == list(range(config.iterations)), metric
    versions = client.search_model_versions(f"name='{result.model_name}'")
    # one version per iteration was registered; retention (checkpoints.keep_last: 1) deleted the older ones
    assert sorted(int(v.version) for v in versions) == [config.iterations]
    assert [v.tags["iteration"] for v in versions] == [str(config.iterations - 1)]
    assert result.model_version == config.iterations


def test_the_run_report_is_written_logged_to_mlflow_and_published_to_prefect(trained):
    from prefect.client.orchestration import get_client

    from tasks.track import run_artifact_key

    config, result, root = trained
    report = root.run("e2e").report_dir
    curves = sorted(p.name for p in (report / "curves").glob("*.png"))
    assert curves == sorted(["reward.png", "em.png", "tool_calls.png", "turns.png", "kl.png", "entropy.png"])
    table = (report / "report.md").read_text()
    assert all(f"| {k} | {s.mean_reward:.3f} |" in table for k, s in enumerate(result.iterations))
    logged = {a.path for a in MlflowClient(result.tracking_uri).list_artifacts(result.mlflow_run_id, "report/curves")}
    assert {f"report/curves/{name}" for name in curves} == logged

    async def latest_artifact():
        async with get_client() as client:
            return await client.read_latest_artifacts()

    import asyncio
    published = {a.key: a for a in asyncio.run(latest_artifact())}
    assert published[run_artifact_key("e2e")].data == table


def test_relogging_an_iteration_adds_no_metric_point(trained):
    """A kill after the metrics were logged but before log_iteration's manifest: the rerun logs nothing twice;
    a metric that does not apply (GRPO has no critic, so no value loss) is never logged."""
    config, result, root = trained
    run = root.run("e2e")
    ref = TrackingRef(result.tracking_uri, root.mlflow_artifacts.resolve().as_uri(), config.tracking.experiment,
                      result.mlflow_run_id)
    for k in (0, config.iterations - 1):  # a pruned checkpoint (0) and the kept one
        run.manifest_path("log_iteration", k).unlink()
        log_iteration.fn(run, k, ref, str(run.checkpoint_dir(k)), result.model_name)
        assert run.manifest_path("log_iteration", k).is_file()
    client = MlflowClient(result.tracking_uri)
    for metric in ("mean_reward", "em", "loss", "dev_em"):
        assert [m.step for m in client.get_metric_history(result.mlflow_run_id, metric)] == list(
            range(config.iterations)), metric
    assert client.get_metric_history(result.mlflow_run_id, "value_loss") == []


def test_cli_runs_shows_the_finished_run(trained, capsys):
    config, result, root = trained
    assert cli_main(["runs", "--data-root", str(root.path)]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("e2e "))
    assert row[:3] == ["e2e", "finished", f"{config.iterations}/{config.iterations}"]
    assert float(row[3]) == pytest.approx(result.iterations[-1].dev_em, abs=5e-4) and row[5] == "grpo"
    assert row[4] == f"0/{sum(s.episodes for s in result.iterations)}"  # failed episodes / all


def test_rerun_one_stage_rewrites_only_its_table(trained):
    _, _, root = trained
    run = root.run("e2e")
    before = {t: Path(run.table_uri(0, t)).read_bytes() for t in RUN_TABLES}
    rerun_stage(str(root.path), "e2e", 0, "compute_advantages", ["algorithm.estimator=rloo"])
    after = {t: Path(run.table_uri(0, t)).read_bytes() for t in RUN_TABLES}
    assert {t for t in RUN_TABLES if before[t] != after[t]} == {"advantages"}
    estimators = read_table("advantages", run.table_uri(0, "advantages")).column("estimator").to_pylist()
    assert set(estimators) == {"rloo"}


def test_cli_query_prints_the_table_and_writes_csv(trained, capsys, tmp_path):
    _, _, root = trained
    sql = "select iteration, count(*) as steps from steps group by 1 order by 1"
    assert cli_main(["query", "--data-root", str(root.path), sql]) == 0
    printed = capsys.readouterr().out
    assert "iteration" in printed and "steps" in printed
    out = tmp_path / "result.csv"
    assert cli_main(["query", "--data-root", str(root.path), sql, "--output", str(out)]) == 0
    assert out.read_text().splitlines()[0].replace('"', "") == "iteration,steps"


def test_cli_reports_config_typos_without_a_traceback(capsys, tmp_path):
    code = cli_main(["train", "--data-root", str(tmp_path), "--set", "rollout.grup_size=2"])
    assert code == 2
    assert "grup_size" in capsys.readouterr().err


def test_rerun_rollout_in_the_hermes_format_with_a_context_window(trained):
    """Runs last: it rewrites iteration 0's steps. The env, format and context come from overrides."""
    _, _, root = trained
    run = root.run("e2e")
    rerun_stage(str(root.path), "e2e", 0, "rollout",
                ["rollout.env_kwargs={tool_format: hermes}", "rollout.tool_instructions=true",
                 "rollout.context_mode=last_k", "rollout.keep_last_turns=1",
                 "rollout.max_context_tokens=2048"])
    steps = read_table("steps", run.table_uri(0, "steps")).to_pylist()
    first = next(s for s in steps if s["step_idx"] == 0)
    opening = first["prompt_ids"]
    from agent_core.io.checkpoints import load_tokenizer

    text = load_tokenizer(run.initial_policy_dir).decode(opening)
    assert "<tool_call>" in text and '"name": "search"' in text  # hermes tool list in the system prompt
    assert all(s["truncated"] == (s["termination"] in ("max_steps", "max_context")) for s in steps if s["done"])


def test_cli_eval_of_one_iteration_runs_that_iterations_checkpoint(trained, capsys):
    config, result, root = trained
    run = root.run("e2e")
    argv = ["eval", "--run-id", "e2e", "--methods", "agent", "--seeds", "1", "--limit", "1", "--greedy",
            "--data-root", str(root.path), "--eval-id", "it0"]
    assert cli_main([*argv, "--iteration", "1"]) == 0
    table = read_table("eval", root.eval_table_uri("it0", "agent", 0))
    assert set(table.column("checkpoint").to_pylist()) == {str(run.checkpoint_dir(1))}
    capsys.readouterr()
    assert cli_main([*argv[:-1], "it0", "--iteration", "0"]) == 2  # retention pruned it once iteration 1 committed
    assert "pruned by checkpoint retention" in capsys.readouterr().err
    assert cli_main([*argv[:-1], "it9", "--iteration", "9"]) == 2
    assert "has no checkpoint of iteration 9" in capsys.readouterr().err
