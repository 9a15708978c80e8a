"""One SmolLM2-135M RL iteration of this pipeline (16 prompts x 4 samples x up to 4 steps, vLLM
engine): its wall time and peak memory (RSS), and the pipeline's peak memory against TRL's
GRPOTrainer on the same single-turn work.

Four runs, one after the other, each in a fresh subprocess whose whole process tree is watched:

1. `iteration`: the training flow (flows/train.py) for ONE iteration of the issue's setting: 16
   prompts of the built-in search-QA task x 4 samples, multi-turn with up to 4 steps per episode
   (rollout.max_steps=4) of up to 64 new tokens each (--max-new-tokens), `rollout.engine: vllm`,
   the tool-call format in the system prompt (rollout.tool_instructions, as for any instruct
   model; off for the tiny model of --quick), GRPO, and otherwise the pipeline's defaults: the
   trainer's (TrainerConfig: 1 epoch of 2 optimizer steps, AdamW fp32, micro_batch_tokens capped
   by micro_batch_logits), max_context_tokens, temperature, and rollout.vllm (kv_cache_gib 1);
   then the checkpoint, optimizer state and MLflow registration. No warm start and no dev eval
   (neither is part of an RL iteration).
1b. `low_memory`: run 1 with `rollout.vllm.keep_server: false` (the server stops when its rollout
   ends, so training has its memory, and every rollout starts a fresh one: its start then counts
   in the iteration's seconds), `rollout.vllm.kv_cache_gib: 0.25` (--kv-cache-gib overrides it)
   and `trainer.activation_checkpointing: true`; keys end in `-low-memory`. The memory/time
   trade-off of the same iteration, side by side.
2. `ours`: bench/trl_compare.py's single-turn setting for one iteration: 16 x 4 x 64 tokens,
   rollout.max_steps=1, HF engine, one optimizer step (bench/pipeline_side.py `pipeline_config`).
2b. `ours` again with `trainer.activation_checkpointing: true` (key
   `peak_vs_trl-activation-checkpointing`; TRL keeps its defaults, where gradient_checkpointing is
   off: TRL has that option too).
3. `trl`: bench/trl_grpo_worker.py in .venv-trl (`make trl`): TRL's GRPOTrainer for one step of
   the very prompts run 2 picks, HF generate, the same setting as in trl_compare.

Measurements (goals for SmolLM2; the tiny model of --quick has none; with --engine hf the three
iteration keys end in `-hf`):

- `iteration_seconds` (goal <= 300): run 1's iteration, from its prepare_data stage's start to its
  log_iteration stage's end, less the vLLM server's start inside its rollout (a one-off: the
  server is pooled across iterations and takes each new checkpoint by an in-place reload; its
  seconds are reported as `vllm_server_start_seconds`). With --iterations N > 1: the median of
  iterations 1..N-1, which include that reload. The split: `stage_seconds` (prepare / rollout /
  rewards / advantages / train / tracking) and `probe_seconds` (engine generate calls in flight,
  server start and reloads, the trainer's forward/backward/optimizer step). One-off setup is
  reported apart: `setup_seconds` (Prefect's temporary API server and the flow run's start,
  recording the config, the dataset, copying the model into the run as its initial policy, the
  MLflow run) and `wrap_up_seconds` (run report, MLflow, stopping the vLLM server).
- `iteration_peak_gib` (goal <= 4): the largest summed RSS of run 1's process tree: the flow
  process, the vLLM server (API server and engine processes), Prefect's server; with the phase
  (stage) it happened in and each group's share then.
- `iteration_flow_peak_gib` (no goal): the flow process alone (getrusage's exact high-water mark).
- `peak_vs_trl` (goal <= 1.0): run 2's tree peak / run 3's tree peak (the flow process and its
  Prefect server vs TRL's one process). Both run in fresh processes of their own and are measured
  the same way; trl_compare runs the pipeline inside the benchmark's process, next to the
  benchmark's own state, so it is not used for memory.

How memory is measured: every 0.1 s the RSS of each process of the tree is read from /proc and
summed by group (the flow or TRL process itself; `vllm`, `prefect` or `other` by command line,
inherited by descendants); a process's own peak is also taken exactly (getrusage ru_maxrss,
reported by the process itself). A peak = the larger of the sampled tree sum and the exact own
peak. Pages shared between processes (the vLLM server's two processes map the same libraries)
count once per process in RSS; the summed PSS (shared pages divided among their processes),
sampled every second, is reported next to it (`tree_pss_peak_gib`).

The vLLM CPU server's KV cache: --kv-cache-memory-bytes, set by agent_core/rollout/vllm_server.py
from rollout.vllm.kv_cache_gib (default 1, fractions allowed; --kv-cache-gib here, run 1: the
pipeline's default, run 1b: 0.25). The details give the KV bytes per token (in the server's dtype)
and the tokens the cache holds, next to the contexts the rollout needed.

Cost (measured 2026-11-26 on 2 quiet cores): a full run took 9.3 minutes and needs `make vllm
trl smollm2`: run 1 and run 1b about 2.5 and 3.5 minutes (a rollout of ~256 agent steps, training
on ~29k episode tokens, setup), runs 2, 2b and 3 about 1 minute each. `--only iteration` (or
low_memory, trl) runs one part. --quick: the tiny model, 4 prompts x 2 samples x 2 steps x 16
tokens (2-3 minutes, most of it the vLLM server's start). A run whose tree passes --max-gib
(default 16) is killed, to spare the shared machine, and reported at that value.

    .venv/bin/python -m bench.memory [--quick] [--only iteration,low_memory,trl] [--engine vllm|hf]
        [--iterations N] [--kv-cache-gib N] [--micro-batch-tokens N] [--precision bf16|fp32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Goal, Measurement, base_parser, parse_args, skipped_measurement, write_result
from bench.memory_child import LOW_MEMORY_KV_CACHE_GIB, REPORT, child, single_turn_setting
from bench.memory_why import why_iteration_peak, why_iteration_slow, why_peak_vs_trl
from bench.process_tree import (  # noqa: F401 - TreeWatch, classify: part of this script's tested surface
    GIB, POLL_S, REPO, TreeWatch, Watched, classify, phase_of, phase_peaks, run_watched, tree_peak,
)

NAME = "memory"
TITLE = "One SmolLM2-135M RL iteration (16x4, up to 4 steps, vLLM): wall time, peak RSS; peak RSS vs TRL"
ITERATION_SECONDS_GOAL = Goal("wall seconds of one SmolLM2-135M RL iteration (16 prompts x 4 samples x up to 4 "
                              "steps, vllm engine; setup and the vLLM server's one-off start excluded)", "<=", 300.0)
ITERATION_PEAK_GOAL = Goal("peak RSS of that iteration, GiB: flow process + vLLM server + Prefect server", "<=", 4.0)
TRL_PEAK_GOAL = Goal("this pipeline's peak RSS / TRL GRPOTrainer's, same single-turn work (16x4x64, one step)",
                     "<=", 1.0)
QUICK = dict(model="tiny", prompts=4, group_size=2, max_steps=2, max_new_tokens=16)
PARTS = ("iteration", "low_memory", "trl")


def _child_command(spec: dict, root: Path) -> list[str]:
    path = root / f"spec-{spec['kind']}.json"
    path.write_text(json.dumps({**spec, "root": str(root)}))
    return [sys.executable, "-m", "bench.memory", "--child", str(path)]


# ---- the parts --------------------------------------------------------------------------------------


def _failure(name: str, watched: Watched, max_gib: float) -> str:
    if watched.killed:
        return f"{name}: killed when its process tree passed --max-gib {max_gib} GiB (peak above it)"
    return f"{name}: the run failed (exit {watched.returncode}); its output is in the log above"


def measure_iteration(args, model_dir: Path, root: Path, low_memory: bool = False) -> list[Measurement]:
    """Run 1 (or 1b, `low_memory`) and its three measurements."""
    from agent_core.config import RolloutConfig
    from agent_core.io.layout import new_run_id

    suffix = ("" if args.engine == "vllm" else f"-{args.engine}") + ("-low-memory" if low_memory else "")
    keys = tuple(f"{name}{suffix}" for name in ("iteration_seconds", "iteration_peak_gib", "iteration_flow_peak_gib"))
    goals = ((ITERATION_SECONDS_GOAL, ITERATION_PEAK_GOAL, None) if args.model == "smollm2" else (None,) * 3)
    if args.engine == "vllm":
        from agent_core.config import VLLMConfig
        from agent_core.rollout.vllm_server import VLLMNotInstalledError, vllm_python

        try:
            vllm_python(VLLMConfig())
        except VLLMNotInstalledError as error:
            reason = f"{str(error).split('. ')[0]} (`make vllm`)"
            return [skipped_measurement(k, g, reason) for k, g in zip(keys, goals)]
    spec = {"kind": "iteration", "model": args.model, "model_dir": str(model_dir), "engine": args.engine,
            "prompts": args.prompts, "group_size": args.group_size, "max_steps": args.max_steps,
            "max_new_tokens": args.max_new_tokens, "iterations": args.iterations, "kv_cache_gib": args.kv_cache_gib,
            "micro_batch_tokens": args.micro_batch_tokens, "precision": args.precision, "low_memory": low_memory, "run_id": new_run_id()}
    folder = root / ("iteration-low-memory" if low_memory else "iteration")
    folder.mkdir()
    print(f"bench: [iteration{' low-memory' if low_memory else ''}] {args.model}, {args.prompts} prompts x {args.group_size} samples x up to "
          f"{args.max_steps} steps x {args.max_new_tokens} tokens, {args.engine} engine, {args.iterations} "
          f"iteration(s), in a subprocess", flush=True)
    watched = run_watched(_child_command(spec, folder), "flow", args.max_gib, label="iteration")
    report_path = folder / REPORT
    if watched.returncode != 0 or not report_path.is_file():
        reason = _failure("iteration", watched, args.max_gib)
        partial = tree_peak(watched, None, None)
        measurements = [skipped_measurement(k, g, reason) for k, g in zip(keys, goals)]
        if watched.killed:  # the peak is known to be at least the limit
            measurements[1] = Measurement(keys[1], partial["peak_gib"], goals[1], partial,
                                          why_missed=reason)
        return measurements
    report = json.loads(report_path.read_text())
    phases = report["phases"]
    peak = tree_peak(watched, report["self_peak_rss_gib"], phases)
    iterations = report["iterations"]
    first = iterations[0]
    server_start = first["probe_seconds"].get("vllm_server_start") or 0.0
    if len(iterations) > 1:
        seconds = statistics.median(it["wall_seconds"] for it in iterations[1:])
        measured = iterations[len(iterations) // 2]  # the split shown: a measured (not the first) iteration
        measured_start = 0.0
    elif low_memory:  # the server is started by every rollout: part of every iteration
        seconds, measured, measured_start = first["wall_seconds"], first, 0.0
    else:
        seconds, measured, measured_start = first["wall_seconds"] - server_start, first, server_start
    kv_gib = args.kv_cache_gib or (LOW_MEMORY_KV_CACHE_GIB if low_memory else RolloutConfig().vllm.kv_cache_gib)
    kv = kv_cache_facts(model_dir, kv_gib, 2 if args.precision == "bf16" else 4)
    common = {"model": args.model, "engine": args.engine, "prompts": args.prompts, "group_size": args.group_size,
              "max_steps": args.max_steps, "max_new_tokens": args.max_new_tokens, "iterations": args.iterations}
    timing = {**common, "seconds": seconds, "vllm_server_start_seconds": server_start,
              "first_iteration_wall_seconds": first["wall_seconds"],
              "iteration_wall_seconds": [it["wall_seconds"] for it in iterations],
              "iteration_cpu_seconds": [it["cpu_seconds"] for it in iterations],
              "stage_seconds": measured["stage_seconds"], "probe_seconds": measured["probe_seconds"],
              "steps": measured["steps"], "setup_seconds": report["setup_seconds"],
              "wrap_up_seconds": report["wrap_up_seconds"], "flow_seconds": report["flow_seconds"],
              "subprocess_seconds": watched.seconds}
    memory = {**common, **peak, "peak_gb": peak["peak_gib"] * GIB / 1e9, "phase_peaks": phase_peaks(watched, phases),
              "kv_cache": kv, "largest_context_tokens": first["steps"]["largest_context_tokens"]}
    flow = {"own_process_peak_gib": peak["own_process_peak_gib"],
            "own_process_sampled_peak_gib": peak["own_process_sampled_peak_gib"],
            "phase_at_peak": peak["own_process_phase_at_peak"]}
    result = [Measurement(keys[0], seconds, goals[0], timing), Measurement(keys[1], peak["peak_gib"], goals[1], memory),
              Measurement(keys[2], peak["own_process_peak_gib"], goals[2], flow)]
    if goals[0] is not None and not goals[0].met(seconds):
        result[0].why_missed = why_iteration_slow(goals[0].value, {**timing, "stage_seconds": measured["stage_seconds"],
                                                                   "vllm_server_start_seconds": measured_start})
    if goals[1] is not None and not goals[1].met(peak["peak_gib"]):
        result[1].why_missed = why_iteration_peak(goals[1].value, peak, kv_gib)
    print(f"bench: [iteration{' low-memory' if low_memory else ''}] {seconds:.1f} s (server start {server_start:.1f} s "
          f"{'included' if low_memory else 'apart'}), peak "
          f"{peak['peak_gib']:.2f} GiB (flow process {peak['own_process_peak_gib']:.2f}, groups at the peak "
          f"{', '.join(f'{g} {v:.2f}' for g, v in peak['groups_at_peak_gib'].items())})", flush=True)
    return result


def kv_cache_facts(model_dir: Path, kv_gib: float, dtype_bytes: int) -> dict:
    """The KV cache's size and what it holds for this model (in the server's dtype: 2 bytes for bf16)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * dtype_bytes
    return {"kv_cache_gib": kv_gib, "set_by": "rollout.vllm.kv_cache_gib -> --kv-cache-memory-bytes",
            "bytes_per_token": per_token, "tokens_it_holds": int(kv_gib * GIB) // per_token}


def measure_vs_trl(args, model_dir: Path, root: Path) -> list[Measurement]:
    """Runs 2 and 3 (and 2b): the same single-turn work in this pipeline and in TRL; the peak ratios."""
    from agent_core.io.layout import new_run_id
    from bench.pipeline_side import pipeline_config, planned_prompts
    from bench.trl_side import TRL_PYTHON, trl_command, trl_events, trl_spec

    goal = TRL_PEAK_GOAL if args.model == "smollm2" else None
    keys = ("peak_vs_trl", "peak_vs_trl-activation-checkpointing")
    if not TRL_PYTHON.is_file():
        return [skipped_measurement(k, goal, f"{TRL_PYTHON.relative_to(REPO)} not found (`make trl`)") for k in keys]
    spec = {"kind": "single", "model": args.model, "model_dir": str(model_dir), "prompts": args.prompts,
            "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
            "micro_batch_tokens": args.micro_batch_tokens, "run_id": new_run_id()}
    setting = single_turn_setting(spec)
    # TRL's prompts: the ones the pipeline's prepare_data picks (deterministic in the seed), planned here on a
    # throwaway data root so that neither measured process does this work
    rows = planned_prompts(pipeline_config(model_dir, root / "plan", setting, "hf", iterations=1,
                                           run_id=spec["run_id"]))
    ours = {False: _run_ours(args, spec, root / "single")}
    trl_dir = root / "trl"
    trl_dir.mkdir()
    command, env = trl_command(trl_spec(model_dir, rows, setting, trl_dir, lockstep=False))
    print(f"bench: [trl] the same work in TRL's GRPOTrainer (one step), {TRL_PYTHON.relative_to(REPO)}", flush=True)
    with open(trl_dir / "stdout.txt", "w") as out:
        trl_run = run_watched(command, "trl", args.max_gib, env=env, cwd=trl_dir, stdout=out, label="trl")
    ours[True] = _run_ours(args, {**spec, "activation_checkpointing": True}, root / "single-checkpointed")
    events = trl_events((trl_dir / "stdout.txt").read_text().splitlines())
    if trl_run.returncode or "result" not in events:
        return [skipped_measurement(k, goal, _failure("trl", trl_run, args.max_gib)) for k in keys]
    trl_result = events["result"]
    trl = tree_peak(trl_run, trl_result["peak_rss_gib"], None)
    trl["rss_gib_after_setup"] = trl_result.get("rss_gib_after_setup")
    return [_vs_trl(key, goal, args, ours[checkpointed], trl, trl_result)
            for key, checkpointed in zip(keys, (False, True))]


def _run_ours(args, spec: dict, folder: Path) -> tuple:
    """Run 2 (2b with activation checkpointing) in a watched subprocess: (watched run, its report or None)."""
    folder.mkdir()
    print(f"bench: [ours] single-turn {args.prompts} x {args.group_size} x {args.max_new_tokens}, hf engine"
          f"{', activation checkpointing' if spec.get('activation_checkpointing') else ''}, in a subprocess", flush=True)
    run = run_watched(_child_command(spec, folder), "flow", args.max_gib, label="ours")
    ok = run.returncode == 0 and (folder / REPORT).is_file()
    return run, json.loads((folder / REPORT).read_text()) if ok else None


def _vs_trl(key: str, goal, args, ours_run: tuple, trl: dict, trl_result: dict) -> Measurement:
    run, report = ours_run
    if report is None:
        return skipped_measurement(key, goal, _failure("ours", run, args.max_gib))
    ours = tree_peak(run, report["self_peak_rss_gib"], report["phases"])
    ratio = ours["peak_gib"] / trl["peak_gib"]
    details = {"model": args.model, "setting": f"{args.prompts} prompts x {args.group_size} samples x "
               f"{args.max_new_tokens} tokens, single turn, one optimizer step (bench/trl_compare.py's)"
               + ("; ours with trainer.activation_checkpointing (TRL: its defaults)" if "checkpointing" in key else ""),
               "ours": {**ours, "phase_peaks": phase_peaks(run, report["phases"]),
                        "seconds": report["iterations"][0]["wall_seconds"],
                        "stage_seconds": report["iterations"][0]["stage_seconds"]},
               "trl": {**trl, "step_seconds": trl_result.get("step_seconds")},
               "flow_process_vs_trl_process": ours["own_process_peak_gib"] / trl["own_process_peak_gib"],
               "prompt_tokens_match": report["prompt_tokens"] == trl_result["prompt_tokens"]}
    measurement = Measurement(key, ratio, goal, details)
    if goal is not None and not goal.met(ratio):
        measurement.why_missed = why_peak_vs_trl(ours, trl)
    print(f"bench: [{key}] ours {ours['peak_gib']:.2f} GiB (flow process {ours['own_process_peak_gib']:.2f}) / "
          f"TRL {trl['peak_gib']:.2f} GiB = {ratio:.2f}", flush=True)
    return measurement


# ---- main -------------------------------------------------------------------------------------------


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="smollm2 (default; needs `make smollm2`) or tiny (a from-scratch 1M-parameter Llama)")
    parser.add_argument("--only", default=",".join(PARTS),
                        help="comma list of parts: iteration (run 1), trl (runs 2 and 3); default both")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm",
                        help="run 1's rollout engine (vllm: the issue's; hf: the old ~20-minute baseline, keys "
                             "iteration_*-hf)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration (all runs)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (all runs)")
    parser.add_argument("--max-steps", type=int, default=4, help="run 1: steps per episode at most")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per step at most (all runs)")
    parser.add_argument("--iterations", type=int, default=1,
                        help="run 1: iterations; above 1 the median of iterations 1..N-1 is measured")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="runs 1 and 1b: rollout.vllm.kv_cache_gib (default: the pipeline's, 1, for run 1; "
                             f"{LOW_MEMORY_KV_CACHE_GIB} for run 1b)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="override trainer.micro_batch_tokens in all runs (default: the pipeline's default for "
                             "run 1, trl_compare's for run 2; trainer.micro_batch_logits still caps it)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16",
                        help="run 1: bf16 = trainer.precision bf16 and rollout.vllm.dtype bfloat16 (the fast "
                        "setting, default); fp32 = the pipeline's defaults")
    parser.add_argument("--max-gib", type=float, default=16.0,
                        help="kill a run whose process tree passes this many GiB (the machine is shared)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (printed)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: the measured run's spec
    args = parse_args(parser, argv, QUICK)  # --quick: tiny model, 4 x 2 x 2 steps x 16 tokens (2-3 minutes)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--only takes a comma list of {', '.join(PARTS)}")
    args.parts = parts
    if args.iterations < 1:
        parser.error("--iterations must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.child:
        return child(args.child)
    from bench.pipeline_side import build_tiny_model, smollm2_dir

    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="agentr1-memory-"))
    from flows.environment import configure_environment

    configure_environment(root / "plan")  # this process's own Prefect settings, before anything imports prefect
    try:
        model_dir = smollm2_dir() if args.model == "smollm2" else build_tiny_model(root / "tiny_model")
        measurements = []
        if "iteration" in args.parts:
            measurements += measure_iteration(args, model_dir, root)
        if "low_memory" in args.parts:
            measurements += measure_iteration(args, model_dir, root, low_memory=True)
        if "trl" in args.parts:
            measurements += measure_vs_trl(args, model_dir, root)
    finally:
        if args.keep:
            print(f"bench: kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    write_result(NAME, TITLE, measurements, seconds=time.perf_counter() - started, results_dir=args.results_dir,
                 argv=argv, data_root=root,
                 notes="RSS = resident memory; GiB = 2^30 bytes (4 GiB = 4.29 GB). A peak = the larger of the "
                       f"process tree's summed RSS, sampled every {POLL_S} s (pages shared between processes "
                       "count once per process; tree_pss_peak_gib counts them once), and the root process's exact "
                       "getrusage peak. Runs one after the other, each in a fresh subprocess. A 2-core machine "
                       "shared with other work: wall seconds are noisy, memory is not.",
                 config={"model": args.model, "parts": args.parts, "engine": args.engine, "prompts": args.prompts,
                         "group_size": args.group_size, "max_steps": args.max_steps,
                         "max_new_tokens": args.max_new_tokens, "iterations": args.iterations,
                         "kv_cache_gib": args.kv_cache_gib, "micro_batch_tokens": args.micro_batch_tokens,
                         "precision": args.precision, "max_gib": args.max_gib})
    failed = [m for m in measurements if m.skipped and "failed" in m.skipped]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
