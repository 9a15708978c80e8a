"""Committed outputs name no machine paths: the experiment's results page (tasks/experiment_report.py)
and the benchmarks' JSON and page (bench/common.py, bench/report.py) write paths under the data root
as `<data root>/...` and paths in the checkout relative to it, the command line included."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agent_core.eval.experiment import ArmConfig, ArmCurve, ExperimentConfig
from agent_core.io.portable_paths import portable
from agent_core.io.tables import write_table
from bench import report
from bench.common import Measurement, write_result
from tasks.experiment_report import experiment_report

REPO_ROOT = Path(__file__).resolve().parent.parent
# an absolute path where one starts: at the start, after a space, quote, backtick, bracket or `=`
ABSOLUTE = re.compile(r"(?:^|[\s`'\"(\[=])(/[\w.~-]+)", re.MULTILINE)


def assert_no_machine_paths(text: str, *folders: Path) -> None:
    for folder in (*folders, REPO_ROOT):
        for form in {str(folder), str(folder.resolve())}:
            assert form not in text, f"{form} appears in:\n{text}"
    assert not ABSOLUTE.findall(text), f"absolute paths {ABSOLUTE.findall(text)} in:\n{text}"


def test_portable_rewrites_whole_path_components_by_the_deepest_folder():
    root = "/srv/scratch/root"
    text = (f"--data-root {root} --data-root={root}x --set policy.path={root}/runs/r/p "
            f"--config {REPO_ROOT}/configs/tiny.yaml file://{root}/mlflow {REPO_ROOT}")
    assert portable(text, {"data root": root}) == (
        "--data-root <data root> --data-root=/srv/scratch/rootx --set policy.path=<data root>/runs/r/p "
        "--config configs/tiny.yaml file://<data root>/mlflow .")
    inside = REPO_ROOT / "data"  # a data root inside the checkout: its own paths are still <data root>/...
    assert portable(f"{inside}/runs {REPO_ROOT}/data2", {"data root": inside}) == "<data root>/runs data2"
    value = {"a": [f"{root}/m", 1.5, None], "b": (str(REPO_ROOT / "data" / "models"),)}
    assert portable(value, {"data root": root}) == {"a": ["<data root>/m", 1.5, None], "b": ("data/models",)}
    assert portable("tokens/s / raw tokens/s, <data root>/x") == "tokens/s / raw tokens/s, <data root>/x"


def test_experiment_results_page_names_no_machine_path(tmp_path):
    data_root = tmp_path / "expdata"
    out = tmp_path / "checkout-elsewhere"
    exp = ExperimentConfig(base_configs=["base.yaml"], arms=[ArmConfig(name="grpo", title="GRPO")], eval_seeds=1,
                           report_path=str(out / "docs" / "results.md"), plots_dir=str(out / "plots"))
    rows = [{"eval_id": "ev", "method": method, "checkpoint": str(data_root / "runs" / "r" / "ckpt"),
             "data_source": "synthetic", "split": "test", "seed": 0, "prompt_id": "q0", "prediction": "x",
             "em": 1.0, "f1": 1.0, "format_ok": True, "steps": 1, "tool_calls": 0, "termination": None}
            for method in ("naive_rag", "base_tool_call", "grpo")]
    uri = write_table("eval", rows, data_root / "evals" / "ev" / "eval.parquet")
    curves = {"grpo": ArmCurve(dev_em=[(0, 0.1), (1, 0.2)], reward=[(0, 0.3)], seconds=5.0)}
    command = (f"agentr1 experiment --data-root {data_root} --experiment {REPO_ROOT}/configs/experiment.yaml "
               f"--set policy.path={data_root}/runs/r/warm_start_policy")
    setup = [f"warm start -> {data_root}/runs/r/warm_start_policy", f"config {REPO_ROOT / 'configs' / 'tiny.yaml'}"]

    page = Path(experiment_report.fn(exp, str(data_root), "exp-1", [uri], curves, command, 60.0, setup))

    text = page.read_text()
    assert_no_machine_paths(text, data_root, tmp_path)
    assert ("agentr1 experiment --data-root <data root> --experiment configs/experiment.yaml "
            "--set policy.path=<data root>/runs/r/warm_start_policy") in text
    assert "warm start -> <data root>/runs/r/warm_start_policy" in text and "config configs/tiny.yaml" in text
    assert "(../plots/dev_em.png)" in text  # a plot outside the page's folder: linked relative to it
    assert (page.parent / "../plots/dev_em.png").is_file()


def test_benchmark_json_and_page_name_no_machine_path(tmp_path):
    data_root, results = tmp_path / "agentr1-trl-compare-x", tmp_path / "vb"
    details = {"model_dir": str(data_root / "tiny" / "tiny_model"),
               "smollm2": str(REPO_ROOT / "data" / "models" / "smollm2-135m-instruct"), "points": [{"dir": str(data_root)}]}
    path = write_result("trl_compare", "T", [Measurement("tiny", 1.5, None, details)], seconds=1.0,
                        config={"config": str(REPO_ROOT / "configs" / "demo.yaml")}, results_dir=results,
                        argv=["--results-dir", str(results), "--quick"], data_root=data_root,
                        notes=f"kept in {data_root}")
    text = path.read_text()
    assert_no_machine_paths(text, data_root, results, tmp_path)
    result = json.loads(text)
    assert result["command"] == "python -m bench.trl_compare --results-dir <results dir> --quick"
    assert result["measurements"][0]["details"] == {
        "model_dir": "<data root>/tiny/tiny_model", "smollm2": "data/models/smollm2-135m-instruct",
        "points": [{"dir": "<data root>"}]}
    assert result["config"] == {"config": "configs/demo.yaml"} and result["notes"] == "kept in <data root>"

    # the page, also from a result written before the paths were made portable
    old = {**result, "name": "rollout", "command": f"python -m bench.rollout --results-dir {tmp_path}/vb",
           "measurements": [{**result["measurements"][0], "details": {"model_dir": str(REPO_ROOT / "data" / "m")}}]}
    (results / "rollout.json").write_text(json.dumps(old))
    page = tmp_path / "benchmarks.md"
    assert report.main(["--results-dir", str(results), "--output", str(page)]) == 0
    text = page.read_text()
    assert_no_machine_paths(text.split(report.MARKER)[0], data_root, results, tmp_path)
    assert "| model_dir | data/m |" in text and "| model_dir | <data root>/tiny/tiny_model |" in text
