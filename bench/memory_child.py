"""bench/memory.py's measured runs, inside their subprocess (`python -m bench.memory --child
spec.json`): the pipeline config a run's spec names, the flow run under bench/pipeline_clock.py's
clock, and the JSON report (timings by iteration and stage, setup and wrap-up, phases, the steps'
tokens, the process's own peak) the parent reads back. See bench/memory.py's docstring."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

LOW_MEMORY_KV_CACHE_GIB = 0.25  # run 1b's KV cache: ~11k tokens of SmolLM2 in bfloat16, 0.74 GiB less than 1
REPORT = "memory_report.json"


def iteration_config(spec: dict, data_root: Path):
    """The issue's iteration as a pipeline config: the named settings over the pipeline's defaults."""
    from agent_core.validation import build_config

    rollout = {"engine": spec["engine"], "group_size": spec["group_size"], "max_steps": spec["max_steps"],
               "max_new_tokens": spec["max_new_tokens"], "tool_instructions": spec["model"] == "smollm2"}
    rollout["vllm"] = {"kv_cache_gib": spec["kv_cache_gib"]} if spec.get("kv_cache_gib") else {}
    trainer = {"micro_batch_tokens": spec["micro_batch_tokens"]} if spec.get("micro_batch_tokens") else {}
    if spec.get("low_memory"):  # the server's memory back for training; a smaller KV cache; activations recomputed
        rollout["vllm"]["keep_server"] = False
        rollout["vllm"].setdefault("kv_cache_gib", LOW_MEMORY_KV_CACHE_GIB)
        trainer["activation_checkpointing"] = True
    if spec.get("precision") == "bf16":  # the fast setting: bf16 autocast training, bf16 vLLM weights
        trainer["precision"] = "bf16"
        rollout["vllm"]["dtype"] = "bfloat16"
    return build_config({
        "run_id": spec["run_id"], "data_root": str(data_root), "iterations": spec["iterations"], "seed": 0,
        "data": {"prompts_per_iteration": spec["prompts"]},
        "policy": {"source": "path", "path": spec["model_dir"]},
        "rollout": rollout, "algorithm": {"estimator": "grpo"}, "trainer": trainer,
        "warm_start": {"enabled": False}, "dev_eval": {"every": 0},
    }, source="bench.memory")


def single_turn_setting(spec: dict):
    from bench.trl_side import Setting

    return Setting(prompts=spec["prompts"], group_size=spec["group_size"], max_new_tokens=spec["max_new_tokens"],
                   iterations=1, micro_batch_tokens=spec.get("micro_batch_tokens"),
                   activation_checkpointing=spec.get("activation_checkpointing", False))


def steps_summary(config, run_dir: Path, k: int) -> dict:
    """What iteration k's rollout produced (its steps table): episodes, agent steps, tokens, contexts."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.tables import read_table

    run = DataRoot(Path(config.data_root)).run(run_dir.name)
    rows = read_table("steps", run.table_uri(k, "steps")).select(
        ["episode_id", "step_idx", "prompt_ids", "response_ids", "termination", "done"]).to_pylist()
    episodes: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        episodes[row["episode_id"]].append(row)
    contexts = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    last = [max(steps, key=lambda r: r["step_idx"]) for steps in episodes.values()]
    terminations: dict[str, int] = defaultdict(int)
    for row in last:
        terminations[str(row["termination"])] += 1
    return {"episodes": len(episodes), "agent_steps": len(rows),
            "steps_per_episode": len(rows) / max(1, len(episodes)),
            "generated_tokens": sum(len(r["response_ids"]) for r in rows),
            "first_prompt_tokens_mean": statistics.mean(len(r["prompt_ids"]) for r in rows if r["step_idx"] == 0),
            "largest_context_tokens": max(contexts),
            # an append-only episode trains as one sequence: its last step's context + action
            "episode_tokens_total": sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in last),
            "terminations": dict(terminations)}


def _report(config, result, clock, spec: dict, started: float) -> dict:
    """The child's JSON report: timings by iteration, setup and wrap-up, phases, tokens, own peak."""
    from bench.common import peak_rss_gib

    events = clock.events
    spans = {k: clock.spans[k] for k in sorted(clock.spans)}
    flow = clock.first("run:train")
    body = clock.first("run:_train")
    first_start, last_end = spans[min(spans)][0], spans[max(spans)][1]
    setup = {"flow_run_start": body[0] - flow[0]} if body else {}  # Prefect's temporary API server, checks
    for name in ("record_config", "prepare_dataset", "init_policy", "start_tracking"):
        found = clock.first(f"run:{name}")
        if found and found[1] <= first_start:
            setup[name] = found[1] - found[0]
    setup["other"] = first_start - flow[0] - sum(setup.values())
    iterations = []
    for k, (start, end, cpu_start, cpu_end) in spans.items():
        probes = clock.probes(k)
        iterations.append({"iteration": k, "wall_seconds": end - start, "cpu_seconds": cpu_end - cpu_start,
                           "stage_seconds": dict(clock.seconds[k]), "probe_seconds": probes,
                           "steps": steps_summary(config, Path(result.run_dir), k)})
    phases = [["startup", started, flow[0]], ["setup", flow[0], first_start]]
    phases += [[f"{name.split(':', 1)[1]}", s, e] for name, _, s, e in events if name.startswith("stage:")]
    phases += [["wrap_up", last_end, flow[1]], ["exit", flow[1], time.time() + 60]]
    return {"kind": spec["kind"], "run_seconds": time.time() - started, "flow_seconds": flow[1] - flow[0],
            "setup_seconds": setup, "wrap_up_seconds": flow[1] - last_end, "iterations": iterations,
            "phases": phases, "self_peak_rss_gib": peak_rss_gib(), "model_dir": spec["model_dir"]}


def child(spec_path: Path) -> int:
    """Inside the subprocess: run the flow as `spec` says, write the JSON report next to the spec."""
    started = time.time()
    spec = json.loads(spec_path.read_text())
    root = Path(spec["root"])
    from flows.environment import configure_environment

    configure_environment(root / "data")  # before anything imports prefect
    from bench.pipeline_clock import run_pipeline
    from bench.pipeline_side import pipeline_config, pipeline_tokens

    if spec["kind"] == "iteration":
        config = iteration_config(spec, root / "data")
    else:
        config = pipeline_config(Path(spec["model_dir"]), root / "data", single_turn_setting(spec), "hf",
                                 iterations=1, run_id=spec["run_id"])
    result, clock = run_pipeline(config)
    report = _report(config, result, clock, spec, started)
    report["prompt_tokens"] = pipeline_tokens(config, Path(result.run_dir))[0]
    spec_path.with_name(REPORT).write_text(json.dumps(report))
    return 0
