"""The benchmark suite's plumbing: a --quick training benchmark writes a well-formed result, and the
report turns results into the page (goals, misses, skips, the hand-written part kept).

No timing is asserted (timings belong in the benchmarks, as ratios; this only checks they run)."""

from __future__ import annotations

import json
import math

import pytest

from bench import report, training
from bench.common import Goal, Measurement, skipped_measurement, write_result


@pytest.fixture(scope="module")
def training_result(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    assert training.main(["--quick", "--results-dir", str(results)]) == 0
    return results, json.loads((results / "training.json").read_text())


def test_quick_training_benchmark_writes_both_ratios(training_result):
    _, result = training_result
    assert {"name", "title", "command", "machine", "finished_at", "wall_seconds", "config", "measurements",
            "notes"} <= set(result)
    assert result["name"] == "training" and "--quick" in result["command"]
    assert result["machine"]["cpus"] >= 1
    by_key = {m["key"]: m for m in result["measurements"]}
    assert set(by_key) == {"trainer", "packed_vs_step"}
    for m in by_key.values():
        assert math.isfinite(m["ratio"]) and m["ratio"] > 0
        assert m["goal"]["op"] in (">=", "<=") and m["met"] in (True, False)
        assert m["skipped"] == ""
    # both arms of the trainer ratio trained on the same tokens; step rows carry more of them
    details = by_key["trainer"]["details"]
    assert details["trainer"]["tokens_per_update"] == details["raw_loop"]["tokens_per_update"] > 0
    assert by_key["packed_vs_step"]["details"]["token_ratio"] > 1


def test_quick_gateway_benchmark_runs_both_sides_on_the_same_work(tmp_path):
    from bench import gateway, report

    assert "gateway" in report.BENCHMARKS  # `make bench` runs it (bench/run_all.py)
    assert gateway.main(["--quick", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gateway.json").read_text())
    assert result["name"] == "gateway" and "--quick" in result["command"]
    (m,) = result["measurements"]
    assert m["key"] == "hf" and math.isfinite(m["ratio"]) and m["ratio"] > 0 and m["met"] in (True, False)
    loop, through_gateway = m["details"]["in_process"], m["details"]["gateway"]
    # the same episodes under the same budgets (2 calls each at most), none failed
    assert loop["episodes"] == through_gateway["episodes"] == 4 and through_gateway["failed"] == 0
    assert 4 <= through_gateway["steps"] <= 8 and through_gateway["tokens"] > 0
    assert through_gateway["generate_calls"] <= through_gateway["steps"]


def test_report_lists_every_ratio_goal_and_miss_and_keeps_hand_written_text(training_result, tmp_path):
    results, result = training_result
    write_result("scaling", "Scaling title", [
        Measurement("episodes", 1.5, Goal("time ratio / size ratio", "<=", 1.2), {"points": [{"episodes": 2}]},
                    why_missed="grew faster than the work"),
        skipped_measurement("steps_per_episode", Goal("time ratio / size ratio", "<=", 1.2), "no engine here"),
    ], seconds=1.0, results_dir=results, argv=["--quick"])
    page = tmp_path / "benchmarks.md"
    page.write_text("old generated text\n" + report.MARKER + "\n## Analysis\nkept by hand\n")
    assert report.main(["--results-dir", str(results), "--output", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Benchmarks") and "old generated text" not in text
    assert text.endswith(report.MARKER + "\n## Analysis\nkept by hand\n")
    assert result["title"] in text and "Scaling title" in text
    for m in result["measurements"]:
        assert f"| {m['key']} | {report.fmt(m['ratio'])} |" in text
        assert ("met" if m["met"] else "**MISSED**") in text
    assert "| episodes | 1.5 | <= 1.2 | **MISSED** |" in text
    assert "grew faster than the work" in text
    assert "steps_per_episode** skipped: no engine here" in text
    assert "make bench" in text


def test_skipped_measurements_are_null_in_strict_json(tmp_path):
    path = write_result("x", "X", [skipped_measurement("vllm", None, "not installed")], seconds=0.0,
                        results_dir=tmp_path, argv=[])
    data = json.loads(path.read_text())  # strict JSON: no NaN
    assert data["measurements"][0]["ratio"] is None and data["measurements"][0]["met"] is None


# ---- the explanations of missed goals and the measuring helpers behind them (no benchmark is run) ----


def _ours(rollout=100.0, train=200.0, rest=10.0, generate=80.0, compute=150.0):
    return {"median_iteration_seconds": rollout + train + rest,
            "stage_seconds_per_iteration": {"prepare": rest / 2, "rollout": rollout, "rewards": rest / 2,
                                            "advantages": 0.0, "train": train, "tracking": 0.0, "other": 0.0},
            "probe_seconds_per_iteration": {"generate": generate, "train_compute": compute, "vllm_reload": 1.0,
                                            "vllm_server_start": 0.0},
            "median_generated_tokens": 3000}


def _trl(generate=120.0, train=280.0):
    return {"median_step_seconds": generate + train, "median_generate_seconds": generate,
            "median_score_seconds": 0.0, "median_train_seconds": train, "generated_tokens_per_step": [2900, 3000, 3100]}


def test_speed_explanation_is_computed_from_both_sides_parts():
    from bench.trl_compare import why_missed_speed

    text = why_missed_speed(2.0, _ours(), _trl())  # TRL 400 s -> budget 200 s; ours 310 s
    assert "leaves the pipeline 200.0 s per iteration" in text and "310.0 s (110.0 s over; ratio 1.29)" in text
    assert "rollout stage 100.0 s vs TRL's generate+score 120.0 s" in text
    assert "engine calls in flight 80.0 s" in text and "weight reload 1.0 s" in text
    assert "30 vs 25 generated tokens/s" in text  # 3000 / 100 s vs median(3000, 3100) / 120 s
    assert "forward/backward/optimizer 150.0 s" in text and "optimizer state 50.0 s" in text
    assert "training would have to take <= 90.0 s (2.2x faster" in text  # 200 - 100 - 10
    assert "generation would have to take" not in text  # 200 - 200 - 10 < 0: training alone is over
    assert "training and the rest alone (210.0 s) exceed the budget" in text
    assert "generation <= 60.0 s" in text and "training <= 140.0 s" in text


def test_speed_explanation_when_generation_alone_is_over_budget():
    from bench.trl_compare import why_missed_speed

    text = why_missed_speed(2.0, _ours(rollout=250.0, train=50.0), _trl())
    assert "Generation and the rest alone (260.0 s) exceed the budget" in text
    assert "generation would have to take <= 140.0 s (1.8x faster)" in text


def _iteration(seconds=400.0, start=60.0):
    return {"seconds": seconds, "vllm_server_start_seconds": start,
            "stage_seconds": {"prepare": 1.0, "rollout": start + 150.0, "rewards": 2.0, "advantages": 2.0,
                              "train": 240.0, "tracking": 5.0},
            "probe_seconds": {"generate": 120.0, "train_compute": 200.0, "vllm_server_start": start},
            "steps": {"episodes": 64, "agent_steps": 200, "steps_per_episode": 3.125, "generated_tokens": 9000,
                      "episode_tokens_total": 48000}}


def test_iteration_time_explanation_names_the_parts_and_what_each_must_take():
    from bench.memory import why_iteration_slow

    text = why_iteration_slow(300.0, _iteration())
    assert "took 400 s, 100 s over the 300 s goal" in text and "one-off start, 60 s, left out" in text
    assert "Rollout 150 s: 64 episodes, 200 agent steps (3.1 per episode), 9000 generated tokens (60 tokens/s" in text
    assert "engine calls in flight 120 s, the rest of the stage 30 s" in text
    assert "Train 240 s for 48000 episode tokens (200 tokens/s); forward/backward/optimizer steps 200 s" in text
    assert "Other stages and gaps (prepare, rewards, advantages, MLflow): 10 s." in text
    assert "the rollout would have to take <= 50 s (3.0x faster)" in text and "training <= 140 s (1.7x faster)" in text


def test_iteration_time_explanation_when_one_part_alone_is_over():
    from bench.memory import why_iteration_slow

    it = _iteration(seconds=500.0, start=0.0)
    it["stage_seconds"] = {"rollout": 150.0, "train": 340.0}
    text = why_iteration_slow(300.0, it)
    assert "Train and the rest alone (350 s) exceed the goal" in text
    assert "training <= 140 s" in text


def _peak(total, groups, pss=3.0, own=2.0):
    return {"peak_gib": total, "sampled_tree_peak_gib": total, "groups_at_peak_gib": groups, "phase_at_peak": "train",
            "own_process_peak_gib": own, "own_process_phase_at_peak": "train", "tree_pss_peak_gib": pss}


def test_memory_explanations_are_computed_from_the_groups_at_the_peak():
    from bench.memory import why_iteration_peak, why_peak_vs_trl

    text = why_iteration_peak(4.0, _peak(5.5, {"flow": 2.0, "vllm": 3.0, "prefect": 0.5}), 1)
    assert "peaked at 5.50 GiB during train: flow process 2.00 GiB, vLLM server processes 3.00 GiB (KV cache set " \
           "to 1 GiB of it), Prefect's server 0.50 GiB" in text
    assert "Summed PSS (shared pages once) peaked at 3.00 GiB" in text
    assert "would have held 2.50 GiB, under the goal" in text
    over = why_iteration_peak(2.0, _peak(5.5, {"flow": 2.0, "vllm": 3.0, "prefect": 0.5}), 1)
    assert "would have held 2.50 GiB, still 0.50 GiB over" in over
    trl = {**_peak(1.5, {"trl": 1.5}, own=1.5), "rss_gib_after_setup": 0.8}
    text = why_peak_vs_trl(_peak(2.5, {"flow": 2.0, "prefect": 0.5}), trl)
    assert "peaked at 2.50 GiB during train (flow process 2.00 GiB, Prefect's server 0.50 GiB" in text
    assert "vs TRL's 1.50 GiB" in text and "0.80 GiB once its trainer was built): 1.00 GiB more" in text
    assert "1.33x TRL's process" in text


def test_stage_clock_counts_overlapping_calls_once_and_clips_to_the_window():
    from bench.pipeline_clock import StageClock

    clock = StageClock()
    clock.events += [("generate", None, 10.0, 14.0), ("generate", None, 12.0, 16.0), ("generate", None, 18.0, 30.0),
                     ("generate", None, 1.0, 2.0), ("generate", None, 40.0, 41.0), ("train_compute", None, 11, 12)]
    assert clock.within("generate", 11.0, 20.0) == pytest.approx(5.0 + 2.0)  # [11, 16] and [18, 20]
    assert clock.within("generate", 3.0, 9.0) == 0.0  # calls before and after the window add nothing
    assert clock.within("missing", 0.0, 100.0) == 0.0
    clock.spans[0] = [10.0, 20.0, 0.0, 0.0]
    clock.probed = {"generate"}
    probes = clock.probes(0)
    assert probes["generate"] == pytest.approx(8.0) and probes["train_compute"] is None  # not installed: unknown


def test_tree_watch_peaks_and_phases():
    from bench.memory import GIB, TreeWatch, Watched, classify, phase_of, phase_peaks, tree_peak

    assert classify("/x/.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server") == "vllm"
    assert classify("VLLM::EngineCore") == "vllm" and classify("python -m uvicorn prefect.server") == "prefect"
    assert classify("python -m bench.memory --child spec.json") is None
    watch = TreeWatch(root=1, root_group="flow")
    watch.samples = [(1.0, {"flow": 1 * GIB}), (2.0, {"flow": 1 * GIB, "vllm": 3 * GIB}),
                     (3.0, {"flow": 2 * GIB, "vllm": 2 * GIB}), (4.0, {"flow": 2.5 * GIB})]
    phases = [["setup", 0.5, 1.5], ["rollout", 1.5, 2.5], ["train", 2.5, 3.5], ["wrap_up", 3.5, 4.5]]
    assert phase_of(3.0, phases) == "train" and phase_of(9.0, phases) == "?"
    peak = tree_peak(Watched(0, False, watch, 1.0), 2.6, phases)
    assert peak["sampled_tree_peak_gib"] == 4.0 and peak["phase_at_peak"] == "rollout"  # first of the equal sums
    assert peak["peak_gib"] == 4.0 and peak["own_process_peak_gib"] == 2.6
    assert peak["own_process_sampled_peak_gib"] == 2.5 and peak["own_process_phase_at_peak"] == "wrap_up"
    by_phase = phase_peaks(Watched(0, False, watch, 1.0), phases)
    assert by_phase["train"] == {"total_gib": 4.0, "flow_gib": 2.0, "vllm_gib": 2.0}
    assert by_phase["setup"] == {"total_gib": 1.0, "flow_gib": 1.0}
    assert tree_peak(Watched(0, False, watch, 1.0), 5.0, None)["peak_gib"] == 5.0  # the exact own peak is larger


def test_run_all_passes_extra_arguments_to_one_script():
    from bench import run_all

    args = run_all.arguments(["--quick", "--args", "trl_compare=--iterations 2", "--args", "memory=--only trl",
                              "--results-dir", "/tmp/x"])
    assert args.extra == {"trl_compare": ["--iterations", "2"], "memory": ["--only", "trl"]}
    with pytest.raises(SystemExit):
        run_all.arguments(["--args", "nonesuch=--x"])


# ---- bench/gpu.py: its --quick run on the CPU, and the bare-GPU-machine promise ---------------------

# What a lent GPU machine lacks and cannot be carried to it (docs/benchmarks.md §GPU): bench/gpu.py
# must never import these, also not lazily while it runs.
GPU_MACHINE_LACKS = ("prefect", "duckdb", "mlflow", "pandera", "vllm", "ray")
GPU_ROWS = ("trainer_default", "trainer_mfu", "trainer_default_vs_best", "trainer_vs_plain", "hf_vs_bare_generate",
            "iteration_seconds", "rollout_tokens_per_s", "scoring_vs_training", "iteration_24gib_seconds",
            "lora_24gib_seconds")


@pytest.mark.slow  # a whole --quick run in a fresh interpreter (~20-30 s)
def test_gpu_bench_quick_runs_every_row_without_the_modules_a_gpu_machine_lacks(tmp_path):
    """The whole --quick run in a fresh interpreter; afterwards none of the modules a bare GPU machine
    lacks was imported (a meta-path block would also trip over find_spec probes, e.g. accelerate's
    "is mlflow available", which a machine without mlflow answers with None)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "gpu.json"
    code = ("import json, sys\nfrom bench import gpu\n"
            f"assert gpu.main(['--quick', '--out', {str(out)!r}]) == 0\n"
            f"loaded = {{m.split('.')[0] for m in sys.modules}} & set({GPU_MACHINE_LACKS!r})\n"
            "print('LOADED', json.dumps(sorted(loaded)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.split("LOADED", 1)[1])
    assert loaded == [], f"bench/gpu.py imported {loaded}: a bare GPU machine has none of them"
    result = json.loads(out.read_text())
    rows = {m["key"]: m for m in result["measurements"]}
    assert tuple(rows) == GPU_ROWS
    for key, row in rows.items():
        assert not row["skipped"] and "error" not in row["details"], (key, row)
        if key == "trainer_mfu":  # the CPU has no bf16 peak in the table: not measured, said so
            assert row["ratio"] is None and row["why_missed"], row
            continue
        assert row["ratio"] is not None and row["ratio"] > 0, (key, row)
    generate = rows["hf_vs_bare_generate"]["details"]
    assert set(generate["vs_bare"]) == {"engine", "engine_static_cache", "engine_fp32_module"}
    assert generate["sampled_dtype"] == "float32" and not generate["static_cache_fell_back"]  # auto on the CPU
    iteration = rows["iteration_seconds"]["details"]
    assert set(iteration["stage_seconds"]) == {"rollout", "labelling", "advantages", "training"}
    assert iteration["episodes"] == 2 * 2 and iteration["updates"] >= 1 and iteration["generated_tokens"] > 0
    lora = rows["lora_24gib_seconds"]["details"]
    assert 0 < lora["trainable_parameters"] < lora["base_parameters"]  # only the adapter trained
    assert rows["iteration_24gib_seconds"]["details"]["limit_note"].startswith("no CUDA device")
    assert "| trainer_default |" in result["goals_table"] and result["machine"]["gpu"] is None


def test_gpu_bench_quick_results_never_default_into_the_committed_folder():
    import torch

    from bench import gpu

    # bench.common.parse_args sets torch's thread count (--quick: 1); put it back, or later tests
    # in this process (the kill test's in-process reference run) train with other float sums.
    threads = torch.get_num_threads()
    try:
        quick = gpu.result_path(gpu.arguments(["--quick"]), gpu.resolve_device("cpu"))
        full = gpu.result_path(gpu.arguments([]), gpu.resolve_device("cpu"))
        out = gpu.result_path(gpu.arguments(["--out", "x/y.json"]), gpu.resolve_device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert gpu.RESULTS_DIR not in quick.parents and quick.name == "cpu.json"
    assert full == gpu.RESULTS_DIR / "cpu.json"
    assert out.as_posix() == "x/y.json"
