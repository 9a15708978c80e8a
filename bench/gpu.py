"""One GPU, first class (issues 30 and 38): the library's trainer, engine and whole RL iteration on one card.

Random weights, no download: a Llama of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV
heads, FFN 4864, vocabulary 151,936, tied embeddings; 494M parameters) and a fast tokenizer of the
same vocabulary built offline (bench/gpu_workload.py). Rows, each printed next to its goal (issue 38's)
and beside the same row of the first GPU run (bench/results-gpu/baseline-nvidia-h200-2026-11-27.json):

- ``trainer_default``: `train_iteration` with the shipped settings (`PPOSettings.from_config` of
  the config defaults: precision auto = bf16 autocast on CUDA, the micro-batch budget the library
  picks from the device's memory), tokens/s on 32 packed episodes x 4 steps (bench/training.py's
  workload, ~43k tokens per update); details: what the budget was chosen from (free and pending bytes).
- ``trainer_mfu``: its model FLOP utilisation (6 x parameters x tokens/s over the card's dense bf16
  peak, from a table by card name). Goal >= 0.30.
- ``trainer_default_vs_best``: that over the best of the same trainer at 4k, 8k, 16k and 32k-token
  micro-batches (the logit cap lifted; an arm that runs out of memory is reported so). Goal >= 0.9.
- ``trainer_vs_plain``: the trainer at 4,096-token micro-batches over a plain PPO loop at the same
  micro-batches (bench/training.raw_update: full-vocabulary logits, log_softmax, gather, clipped
  loss; same autocast). Goal >= 1.5.
- ``hf_vs_bare_generate``: `HFEngine` as rollout.hf's defaults build it (on CUDA sampling from a bf16
  copy of the trainer's module) vs bare `model.generate` on a bf16 copy, batch 256, 128 new tokens
  from 128-token random prompts, seeded sampling at temperature 1; tokens/s of the median of
  alternating repeats (details: the static cache, and the engine on the fp32 module). Goal >= 0.95.
- ``iteration_seconds``: one whole RL iteration through the library (bench/gpu_iteration.py):
  rollout of 64 prompts x 4 samples of the built-in task, up to 4 turns; labelling; advantages
  with reference log-probs; training. Seconds per stage and peak GPU memory. Goal <= 10 s.
- ``rollout_tokens_per_s`` and ``scoring_vs_training``: from that iteration's stages, tokens/s
  generated (goal >= 11,000, 3x the baseline) and the advantages stage's tokens/s (each step's
  prompt + response scored) over the training stage's (goal >= 2).
- ``iteration_24gib_seconds``: the same with `torch.cuda.set_per_process_memory_fraction` at 24
  GiB's share of the card (as on a 24 GB card). Goal <= 12 s.
- ``lora_24gib_seconds``: the same iteration with LoRA (agent_core/training/lora.py, `policy.lora`
  defaults) on Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, FFN 8960),
  within the 24 GiB limit. Goal <= 30 s.
- ``trl_vs_ours``: TRL's GRPOTrainer (plain `generate`, no vLLM; its own interpreter, bench/gpu_trl.py)
  and the library on the same single-turn GRPO work as bench/trl_compare.py (--prompts x
  --group-size x --new-tokens, one optimizer step, no KL), 1 + --updates iterations each: TRL's
  median seconds per iteration over ours. Goal >= 3. Skipped, with the reason, where TRL does not
  import; `--quick` runs it only when named (`--only trl`). Not yet run on a GPU (estimated 1-2
  minutes there, TRL's start included).

Runs in about 3-4 minutes on an H100. Needs torch, transformers, peft and pydantic (no Prefect,
DuckDB, MLflow or pandera: nothing here imports them; tests/test_bench.py checks). Results:
<out>/<card name>.json (default bench/results-gpu/), in bench/common's format.
`--quick`: tiny sizes on whatever device there is (the CPU in CI), every row but trl, in seconds.

    python -m bench.gpu [--quick] [--out bench/results-gpu | path.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from agent_core.config import RolloutConfig
from agent_core.devices import resolve_device
from agent_core.io.portable_paths import CHECKOUT, portable
from bench.common import Goal, Measurement, Progress, json_safe, machine_info, parse_args, skipped_measurement
from bench.gpu_iteration import free_memory, lora_settings, memory_limit, rl_iteration, with_lora
from bench.gpu_speed import GOALS as SPEED_GOALS
from bench.gpu_speed import generation_row, out_of_memory, trainer_arms, trainer_measurements
from bench.gpu_trl import GOAL as TRL_GOAL
from bench.gpu_trl import trl_row
from bench.gpu_trl import words as trl_words
from bench.gpu_workload import QWEN_05B, QWEN_15B, TINY, TINY_LORA, shaped_model, shaped_tokenizer
from bench.workload import synthetic_task

NAME = "gpu"
TITLE = "One GPU: trainer, hf engine and a whole RL iteration (Qwen2.5 shapes, random weights)"
RESULTS_DIR = Path(__file__).resolve().parent / "results-gpu"
GOALS = {  # issue 38's, for an H100 or H200
    **SPEED_GOALS,
    "iteration_seconds": Goal("seconds of one RL iteration, 64 x 4 x up to 4 turns", "<=", 10),
    "rollout_tokens_per_s": Goal("tokens/s generated in the iteration's rollout (3x the H200 baseline)", ">=", 11_000),
    "scoring_vs_training": Goal("advantages stage tokens/s (reference log-probs) / training stage tokens/s", ">=", 2),
    "iteration_24gib_seconds": Goal("the same, process limited to 24 GiB", "<=", 12),
    "lora_24gib_seconds": Goal("LoRA iteration, Qwen2.5-1.5B shape, limited to 24 GiB (seconds)", "<=", 30),
    "trl_vs_ours": TRL_GOAL,
}
BASELINE = RESULTS_DIR / "baseline-nvidia-h200-2026-11-27.json"  # the first GPU run (main at 9ed575b)
# rows of that run's first, full log only (baseline-...-run1.log): the engine 7.4k vs bare 14.2k tokens/s
BASELINE_LOG_ROWS = {"hf_vs_bare_generate": 0.52}
ROW_GROUPS = ("trainer", "generate", "iteration", "lora", "trl")
# --threads 1: tiny ops on a shared CPU run 10x slower with torch's threads waiting for each other
QUICK = dict(episodes=4, steps=2, prompt_len=24, response_len=8, obs_len=8, sizes="64,256", plain_tokens=64, threads=1,
             updates=1, gen_batch=4, gen_new_tokens=8, gen_prompt_len=8, repeats=1, prompts=2, group_size=2,
             max_steps=2, new_tokens=8, engine_batch=8)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="tiny sizes, every row (the CPU in CI): seconds, numbers meaningless")
    add("--out", default=None, help="a folder (<card name>.json goes there) or a .json path; default "
        "bench/results-gpu, with --quick a temporary folder")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N (agent_core/devices.py)")
    add("--episodes", type=int, default=32, help="trainer rows: episodes per update")
    add("--steps", type=int, default=4, help="trainer rows: steps per episode")
    add("--prompt-len", type=int, default=224, help="trainer rows: opening prompt tokens (max)")
    add("--response-len", type=int, default=48, help="trainer rows: tokens per action (max)")
    add("--obs-len", type=int, default=88, help="trainer rows: tokens per observation (max)")
    add("--sizes", default="4096,8192,16384,32768", help="micro-batch sizes (tokens) the default is compared to")
    add("--plain-tokens", type=int, default=4096, help="micro-batch size of the trainer vs plain loop row")
    add("--updates", type=int, default=2, help="timed updates per trainer arm (median), after one warm-up")
    add("--gen-batch", type=int, default=256, help="generation row: prompts per call")
    add("--gen-new-tokens", type=int, default=128, help="generation row: new tokens per prompt")
    add("--gen-prompt-len", type=int, default=128, help="generation row: prompt tokens")
    add("--repeats", type=int, default=2, help="generation row: alternating repeats (median)")
    add("--prompts", type=int, default=64, help="iteration rows: prompts per rollout")
    add("--group-size", type=int, default=4, help="iteration rows: samples per prompt")
    add("--max-steps", type=int, default=4, help="iteration rows: turns per episode at most")
    add("--new-tokens", type=int, default=64, help="iteration rows: tokens per action at most")
    add("--engine-batch", type=int, default=128, help="iteration rows: rollout.max_batch_size")
    add("--context", type=int, default=2048, help="iteration rows: rollout.max_context_tokens")
    add("--kl-coef", type=float, default=0.001,
        help="iteration rows: KL-to-reference loss weight (needs reference log-probs)")
    add("--limit-gib", type=float, default=24.0, help="the memory limit of the *_24gib rows")
    add("--only", default=None, help="comma list of row groups to run: trainer, generate, iteration, lora, trl")
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=None, help="torch intra-op CPU threads (default torch's; --quick: 1)")
    args = parse_args(parser, argv, QUICK)
    unknown = set((args.only or ",".join(ROW_GROUPS)).split(",")) - set(ROW_GROUPS)
    if unknown:
        parser.error(f"--only {args.only}: unknown row group(s) {', '.join(sorted(unknown))}; "
                     f"valid: {', '.join(ROW_GROUPS)}")
    return args


# ---- (c, d) whole RL iterations ------------------------------------------------------------------------


def iteration_row(key: str, build, tokenizer, task, args, device, progress, *, limit_gib: float | None = None,
                  lora: bool = False) -> Measurement:
    """One RL iteration of the model `build()` returns (built inside the memory limit, if any)."""
    cfg = RolloutConfig(group_size=args.group_size, max_steps=args.max_steps, max_new_tokens=args.new_tokens,
                        max_context_tokens=args.context, max_batch_size=args.engine_batch)
    limited = limit_gib if device.type == "cuda" else None
    error = None
    started = time.perf_counter()
    try:
        with memory_limit(device, limited):
            model = build()
            result = rl_iteration(model, tokenizer, task, prompts=args.prompts, rollout_cfg=cfg, kl_coef=args.kl_coef,
                                  seed=args.seed, lora=lora)
            del model
    except (torch.OutOfMemoryError, RuntimeError) as caught:
        if not out_of_memory(caught):
            raise
        stage = "; ".join(getattr(caught, "__notes__", [])) or "building the model"
        message = " ".join(str(caught).split())[:300]
        error = f"out of memory ({stage}) after {time.perf_counter() - started:.1f}s: {message}"
    free_memory(device)
    note = {"limit_gib": limited, "limit_note": None if limit_gib is None or limited is not None else
            f"no CUDA device: the {limit_gib:g} GiB limit was not applied"}
    if error is not None:
        progress(f"{key}: {error}")
        return Measurement(key, math.nan, GOALS[key], {"error": error, **note}, why_missed=error)
    progress(f"{key}: {result['seconds']:.1f}s, stages {result['stage_seconds']}, peak {result['peak_gib']} GiB")
    m = Measurement(key, result["seconds"], GOALS[key], {**result, **note})
    if not GOALS[key].met(result["seconds"]):
        slowest = max(result["stage_seconds"], key=result["stage_seconds"].get)
        m.why_missed = (f"stages (s): {result['stage_seconds']}; the slowest is {slowest}; "
                        f"{result['generated_tokens']} tokens generated, {result['train_tokens']} trained")
    return m


def lora_row(shape, tokenizer, task, args, device, progress) -> Measurement:
    key = "lora_24gib_seconds"
    settings = lora_settings()
    if settings is None:
        return skipped_measurement(key, GOALS[key], "not built: agent_core/training/lora.py is not in this checkout")
    build = lambda: with_lora(shaped_model(shape, tokenizer, device, args.seed), settings)  # noqa: E731
    m = iteration_row(key, build, tokenizer, task, args, device, progress, limit_gib=args.limit_gib, lora=True)
    m.details.update(shape=shape.name, base_parameters=shape.parameters(), lora=settings.model_dump(mode="json"))
    return m


# ---- output -------------------------------------------------------------------------------------------


def iteration_rates(details: dict) -> dict[str, float]:
    """The rows derived from an iteration's stages: rollout tokens/s, and scoring over training tokens/s
    (scoring reads each step's prompt and response; training the packed rows)."""
    seconds = details.get("stage_seconds") or {}
    rates = {}
    if seconds.get("rollout"):
        rates["rollout_tokens_per_s"] = details["generated_tokens"] / seconds["rollout"]
    scored = details.get("scored_tokens")  # the baseline's run did not count them: no ratio for it
    if scored and seconds.get("advantages") and seconds.get("training"):
        rates["scoring_vs_training"] = (scored / seconds["advantages"]) / (details["train_tokens"] / seconds["training"])
    return rates


def derived_rows(iteration: Measurement) -> list[Measurement]:
    """rollout_tokens_per_s and scoring_vs_training of a measured iteration row (none for one that failed)."""
    if "error" in iteration.details or not math.isfinite(iteration.ratio):
        return []
    rates = iteration_rates(iteration.details)
    return [Measurement(key, value, GOALS[key], {"from": iteration.key}) for key, value in rates.items()]


def baseline_values(path: Path = BASELINE) -> dict[str, float]:
    """Each row's value in the baseline run (derived rows computed from its iteration's stages)."""
    if not path.is_file():
        return {}
    found = json.loads(path.read_text())["measurements"]
    values = {**BASELINE_LOG_ROWS, **{m["key"]: m["ratio"] for m in found if m.get("ratio") is not None}}
    for m in found:
        if m["key"] == "iteration_seconds" and "stage_seconds" in m.get("details", {}):
            values.update(iteration_rates(m["details"]))
        if m["key"] == "trainer_default":
            values["trainer_mfu"] = (m["details"].get("mfu") or {}).get("default")
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def card_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def result_path(args, device: torch.device) -> Path:
    """--out as a .json file, else <folder>/<card name>.json (folder: --out, bench/results-gpu, or a
    temporary one with --quick, so a smoke run never lands among the committed results)."""
    if args.out and args.out.endswith(".json"):
        return Path(args.out)
    folder = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "bench-gpu-quick" if args.quick else RESULTS_DIR)
    return folder / f"{re.sub(r'[^a-z0-9]+', '-', card_name(device).lower()).strip('-')}.json"


def measured(m: Measurement) -> str:
    """A row's value in words, for the goals table."""
    if m.skipped:
        return m.skipped
    if "error" in m.details:
        return m.details["error"][:120]
    if m.key == "trainer_default":
        default = m.details["arms"]["default"]
        if "error" in default:
            return default["error"][:120]
        return f"{default['tokens_per_s']:,.0f} tokens/s (MFU {m.details['mfu'].get('default')})"
    if not math.isfinite(m.ratio):
        return f"not measured: {m.why_missed[:120]}"
    if m.key == "trl_vs_ours":
        return trl_words(m)
    if m.key.endswith("seconds"):
        return f"{m.ratio:.1f} s (stages {m.details['stage_seconds']}; peak {m.details['peak_gib']} GiB)"
    return f"{m.ratio:.3f}"


def goals_table(measurements: list[Measurement], baseline: dict[str, float] | None = None) -> str:
    """One line per row: goal, measured, met, and the baseline run's value of the same row (H200, 2026-11-27)."""
    baseline = baseline_values() if baseline is None else baseline
    lines = ["| row | goal | measured | met | baseline (H200, 2026-11-27) |", "|---|---|---|---|---|"]
    for m in measurements:
        met = {True: "met", False: "MISSED", None: "-"}[m.met if "error" not in m.details else False]
        goal = f"{m.goal.metric} {m.goal.op} {m.goal.value:,g}" if m.goal else ""
        before = baseline.get(m.key)
        lines.append(f"| {m.key} | {goal} | {measured(m)} | {met} | {'-' if before is None else f'{before:,.3g}'} |")
    return "\n".join(lines)


def write(path: Path, measurements: list[Measurement], args, argv, seconds: float, notes: str) -> Path:
    """bench/common.write_result's format, at `path` (named by the card, not the script)."""
    from dataclasses import asdict

    payload = {
        "name": NAME, "title": TITLE, "command": " ".join(["python", "-m", "bench.gpu", *(sys.argv[1:] if argv is None
                                                                                         else argv)]),
        "machine": machine_info(), "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_seconds": round(seconds, 2), "config": {k: v for k, v in vars(args).items() if k != "out"},
        "measurements": [{**asdict(m), "met": m.met} for m in measurements], "notes": notes,
        "goals_table": goals_table(measurements),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    outside = not path.parent.resolve().is_relative_to(CHECKOUT)
    payload = portable(payload, {"results dir": path.parent if outside else None})
    path.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    device = resolve_device(args.device)
    groups = set(args.only.split(",")) if args.only else set(ROW_GROUPS) - ({"trl"} if args.quick else set())
    shape, lora_shape = (TINY, TINY_LORA) if args.quick else (QWEN_05B, QWEN_15B)
    task = synthetic_task(args.seed, small=args.quick)
    tokenizer = shaped_tokenizer(task, shape.vocab)
    model = shaped_model(shape, tokenizer, device, args.seed)
    progress(f"{card_name(device)}: {shape.name} shape, {shape.parameters() / 1e6:.1f}M parameters, "
             f"vocabulary {len(tokenizer)}")
    found: list[Measurement] = []
    if "trainer" in groups:
        found += trainer_measurements(trainer_arms(model, tokenizer, args, device, progress), args,
                                      shape.parameters(), device)
    if "generate" in groups:
        found.append(generation_row(model, tokenizer, args, device, progress))
    if "iteration" in groups:
        for key, limit in (("iteration_seconds", None), ("iteration_24gib_seconds", args.limit_gib)):
            found.append(iteration_row(key, lambda: model, tokenizer, task, args, device, progress, limit_gib=limit))
            if limit is None:
                found += derived_rows(found[-1])
    del model
    free_memory(device)
    if "lora" in groups:
        found.append(lora_row(lora_shape, tokenizer, task, args, device, progress))
    if "trl" in groups:
        found.append(trl_row(shape, tokenizer, task, args, device, progress))
    path = write(result_path(args, device), found, args, argv, progress.elapsed, notes=(
        f"{card_name(device)}; {shape.name} and {lora_shape.name} shapes, random weights; torch {torch.__version__}. "
        "Goals are issue 38's, for an H100 or H200; with --quick the numbers mean nothing."))
    print(goals_table(found))
    progress(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
