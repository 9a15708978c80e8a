"""This pipeline vs TRL's GRPOTrainer: seconds per iteration of identical single-turn GRPO work.

What is measured: one GRPO iteration = P prompts x G samples x up to T new tokens (default 16 x 4
x 64), rewarded (exact match of an <answer>), group-normalized advantages, and ONE optimizer step
over all P*G completions (no KL term, fp32, temperature 1, top_p 1, no top_k, the same learning
rate, clip range and grad clipping). TRL generates with HF transformers `generate` on CPU; the
pipeline with the engine named by --engine: `hf` (the same `generate`: the like-for-like row,
keys `smollm2`, `tiny`) and `vllm` (the pipeline's vLLM CPU server: keys `smollm2-vllm`,
`tiny-vllm`); `--engine all` (the default) measures both, each against its own TRL run.

- This pipeline: the training flow (flows/train.py) run in this process on a temporary data root,
  with policy.source=path (the same model directory as TRL), rollout.max_steps=1 (single turn: the
  built-in search-QA prompts; an episode ends after its first action), group_size G,
  max_new_tokens T, GRPO, trainer.epochs=1 and mini_batches=1 (gradient accumulation over the
  trainer's default micro-batches: micro_batch_tokens, capped by micro_batch_logits to 1365 tokens
  for SmolLM2's 49k vocabulary; TRL: 4 micro-batches of P*G/4 completions), no warm start, no dev
  eval. Each stage task the flow calls is wrapped with a timer, so an iteration's wall time
  (prepare_data start to log_iteration end) splits into prepare / rollout / rewards / advantages /
  train / tracking; inside them the engine's generate calls, the vLLM server's start and weight
  reloads and the trainer's forward/backward/optimizer step are timed too
  (`probe_seconds_per_iteration`). Everything an iteration does counts: its Parquet tables,
  loading the policy for the rollout and for training, saving checkpoint and optimizer state,
  MLflow logging and registration, and with vllm the weight reload into the running server. The
  vLLM server starts in the first iteration, which the median leaves out.
- TRL: bench/trl_grpo_worker.py in .venv-trl (`make trl`), a separate process fed the very
  prompts the pipeline's prepare_data stage picks (iteration k's prompts are TRL's step k,
  unshuffled) as chat messages, so both sides render them with the model's chat template; the
  prompt token counts of both sides are compared (`prompt_tokens_match`). Seconds per step from
  TrainerCallback timestamps; generation and scoring are timed inside the step. TRL's side always
  uses HF generate: TRL 1.16's vLLM integration cannot run on this CPU machine. Its server mode
  syncs weights through vLLM's NCCL weight-transfer engine, and `VLLMClient.init_communicator`
  raises NotImplementedError for a non-CUDA device (trl/generation/vllm_client.py); its colocate
  mode builds `vllm.LLM` inside the trainer with the `external_launcher` executor and a
  `gpu_memory_utilization`, for the training GPUs (trl/generation/vllm_generation.py); and
  .venv-trl has no vLLM. On a GPU, TRL's `use_vllm=True` would be the fair opponent of `vllm`.

The two sides alternate: TRL step k, then pipeline iteration k (the worker waits on a pipe), so a
change in the machine's load hits both alike. Ratio = TRL median seconds per step / pipeline
median seconds per iteration, both over the iterations after the first (warm-up; the first ones
are reported too). Goal for SmolLM2-135M-Instruct, both engines: >= 2.0 (the pipeline at least
twice as fast). The tiny from-scratch model has no goal: there fixed per-iteration overheads
dominate, as the split shows. CPU seconds per iteration (all threads; the pipeline's include its
Prefect and vLLM server processes, not the TRL worker) are in the details too: less sensitive to
other work on the machine than wall time.

Precision (--precision, default all: fp32 then bf16): fp32 on both sides is the identical-work
row; bf16 (keys ending in -bf16) is our `trainer.precision: bf16` (bfloat16 autocast; with the
vllm engine also `rollout.vllm.dtype: bfloat16`, the hf engine generates in fp32) against TRL with
the Trainer's bf16 mixed precision (`bf16=True`, accelerate's autocast around the model's forward,
generation included), both on the CPU.

Cost of a full run (2 quiet cores, SmolLM2, measured 2026-11-26: TRL 47-65 s per step, the
pipeline 32-47 s per iteration): one iteration of both sides takes 1.5-2 minutes per engine and
precision (vllm's first also starts the server, ~25 s), so --model smollm2 with the default 3
iterations x 2 engines x 2 precisions takes about 22 minutes, the tiny model two more;
--iterations N (at least 2) scales it linearly, --engine or --precision halves it.

Threads: OMP_WAIT_POLICY=PASSIVE is set for both sides unless already set: with torch's default
(spinning) OpenMP threads, a 2-core machine shared with other work ran HF generate 5-15x slower
(measured here: 64x64 tokens on the tiny model 4-7 s passive or 1 thread, 30-73 s spinning).
Timings on a shared machine are noisy all the same.

    .venv/bin/python -m bench.trl_compare [--model smollm2|tiny|both] [--engine hf|vllm|all]
        [--precision fp32|bf16|all] [--iterations N] [--quick]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.common import Goal, Measurement, base_parser, parse_args, skipped_measurement, write_result
from bench.pipeline_clock import STAGES, StageClock, run_pipeline
from bench.pipeline_side import build_tiny_model, pipeline_config, pipeline_tokens, planned_prompts, smollm2_dir
from bench.trl_side import Setting, TrlWorker

NAME = "trl_compare"
GOAL = Goal("TRL seconds per iteration / this pipeline's seconds per iteration (SmolLM2-135M)", ">=", 2.0)
QUICK = dict(model="tiny", iterations=2, prompts=4, max_new_tokens=16, precision="fp32")


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


# ---- one comparison ---------------------------------------------------------------------------------


def _pipeline_details(clock: StageClock, generated: list[int]) -> dict:
    iterations = clock.iteration_seconds()
    measured = sorted(clock.seconds)[1:] or sorted(clock.seconds)
    split = {label: statistics.median(clock.seconds[k].get(label, 0.0) for k in measured) for label in STAGES.values()}
    split["other"] = median_after_first(iterations) - sum(split.values())
    probes = {k: clock.probes(k) for k in sorted(clock.spans)}
    labels = probes[measured[0]]
    probe_medians = {label: (None if labels[label] is None else statistics.median(probes[k][label] for k in measured))
                     for label in labels}
    return {"median_iteration_seconds": median_after_first(iterations), "first_iteration_seconds": iterations[0],
            "iteration_seconds": iterations, "iteration_cpu_seconds": clock.iteration_cpu_seconds(),
            "stage_seconds_per_iteration": split, "probe_seconds_per_iteration": probe_medians,
            "probe_seconds": [probes[k] for k in sorted(probes)], "generated_tokens_per_iteration": generated,
            "median_generated_tokens": median_after_first(generated)}


def why_missed_speed(goal: float, ours: dict, trl: dict) -> str:
    """Why this pipeline is not `goal` times faster than TRL, from the measured parts of both sides:
    the budget the goal leaves, each side's generation and training seconds, and what each part
    would have to take for the goal with the others as measured."""
    trl_step, mine = trl["median_step_seconds"], ours["median_iteration_seconds"]
    budget = trl_step / goal
    split, probes = ours["stage_seconds_per_iteration"], ours.get("probe_seconds_per_iteration") or {}
    rollout, train = split["rollout"], split["train"]
    rest = mine - rollout - train
    trl_generate = trl["median_generate_seconds"] + trl["median_score_seconds"]
    trl_train = trl["median_train_seconds"]
    tokens = ours.get("median_generated_tokens")
    trl_tokens = median_after_first(trl["generated_tokens_per_step"]) if trl.get("generated_tokens_per_step") else None
    lines = [f"{goal:g}x TRL's {trl_step:.1f} s/step leaves the pipeline {budget:.1f} s per iteration; it took "
             f"{mine:.1f} s ({mine - budget:.1f} s over; ratio {trl_step / mine:.2f})."]
    generation = f"Generation: rollout stage {rollout:.1f} s vs TRL's generate+score {trl_generate:.1f} s"
    if probes.get("generate") is not None:
        generation += f" (engine calls in flight {probes['generate']:.1f} s of it"
        if probes.get("vllm_reload"):
            generation += f", weight reload {probes['vllm_reload']:.1f} s"
        generation += ")"
    if tokens and trl_tokens and rollout > 0 and trl_generate > 0:
        generation += (f"; {tokens / rollout:.0f} vs {trl_tokens / trl_generate:.0f} generated tokens/s "
                       f"({tokens:.0f} vs {trl_tokens:.0f} tokens)")
    lines.append(generation + ".")
    training = f"Training: train stage {train:.1f} s vs TRL's {trl_train:.1f} s"
    if probes.get("train_compute") is not None:
        training += (f" (forward/backward/optimizer {probes['train_compute']:.1f} s of it, loading, batching and "
                     f"saving policy and optimizer state {train - probes['train_compute']:.1f} s)")
    lines.append(training + ".")
    lines.append(f"Everything else (prepare, rewards, advantages, MLflow): {rest:.1f} s.")
    need_train, need_rollout = budget - rollout - rest, budget - train - rest
    lines.append(
        (f"With generation and the rest as measured, training would have to take <= {need_train:.1f} s "
         f"({train / need_train:.1f}x faster than now); " if need_train > 0 else
         f"Generation and the rest alone ({rollout + rest:.1f} s) exceed the budget, so faster training cannot "
         "reach the goal alone; ")
        + (f"with training and the rest as measured, generation would have to take <= {need_rollout:.1f} s "
           f"({rollout / need_rollout:.1f}x faster)." if need_rollout > 0 else
           f"training and the rest alone ({train + rest:.1f} s) exceed the budget, so faster generation cannot "
           "reach it alone."))
    lines.append(f"Each part at {goal:g}x TRL's: generation <= {trl_generate / goal:.1f} s (now "
                 f"{rollout / max(trl_generate / goal, 1e-9):.1f}x that), training <= {trl_train / goal:.1f} s (now "
                 f"{train / max(trl_train / goal, 1e-9):.1f}x that).")
    return " ".join(lines)


def compare(model: str, setting: Setting, engine: str, root: Path) -> Measurement:
    """Run both sides on `model` (smollm2 or tiny) under `root`, alternating; the ratio and its details."""
    from agent_core.io.layout import new_run_id

    key = _key(model, engine, setting.precision)
    workdir = root / key
    workdir.mkdir(parents=True)
    model_dir = smollm2_dir() if model == "smollm2" else build_tiny_model(workdir / "tiny_model")
    config = pipeline_config(model_dir, root / "data", setting, engine, run_id=new_run_id())
    worker = TrlWorker(model_dir, planned_prompts(config), setting, workdir)
    clock = StageClock(before_iteration=worker.step)
    clock.exclude_pids.add(worker.process.pid)  # the pipeline's CPU seconds leave TRL's out
    print(f"bench: [{model}] {setting.iterations} x (TRL step, then pipeline iteration with the {engine} engine), "
          f"{setting.prompts} prompts x {setting.group_size} samples x {setting.max_new_tokens} tokens", flush=True)
    try:
        result, clock = run_pipeline(config, clock=clock)
    finally:
        worker.stop()
    trl = worker.result
    prompt_tokens, generated = pipeline_tokens(config, Path(result.run_dir))
    ours = _pipeline_details(clock, generated)
    ratio = trl["median_step_seconds"] / ours["median_iteration_seconds"]
    details = {
        "model": model, "model_dir": str(model_dir), "engine": engine, **asdict(setting),
        "prompt_tokens_match": trl["prompt_tokens"] == prompt_tokens,
        "prompt_tokens_total": {"pipeline": sum(prompt_tokens), "trl": sum(trl["prompt_tokens"])},
        "cpu_seconds_ratio": median_after_first(trl["step_cpu_seconds"]) / median_after_first(ours["iteration_cpu_seconds"]),
        "pipeline": ours, "trl": {k: v for k, v in trl.items() if k not in ("event", "prompt_tokens")},
    }
    if not details["prompt_tokens_match"]:
        print(f"bench: WARNING prompt token counts differ: pipeline {sum(prompt_tokens)}, TRL {sum(trl['prompt_tokens'])}")
    goal = _goal(model)
    measurement = Measurement(key=key, ratio=ratio, goal=goal, details=details)
    if goal is not None and not goal.met(ratio):
        measurement.why_missed = why_missed_speed(goal.value, ours, trl)
    print(f"bench: [{key}] TRL {trl['median_step_seconds']:.2f} s/step, pipeline "
          f"{ours['median_iteration_seconds']:.2f} s/iteration -> ratio {ratio:.2f}", flush=True)
    return measurement


def _key(model: str, engine: str, precision: str = "fp32") -> str:
    return (model if engine == "hf" else f"{model}-{engine}") + ("" if precision == "fp32" else f"-{precision}")


def _goal(model: str) -> Goal | None:
    return GOAL if model == "smollm2" else None


def measure_all(models: list[str], setting: Setting, engines: list[str], root: Path,
                precisions: tuple[str, ...] = ("fp32",)) -> list[Measurement]:
    """compare() each model with each engine (hf first) and precision; a missing or failing vLLM engine is
    recorded as skipped (hf must work)."""
    found = []
    for precision in precisions:
        found += _measure_engines(models, replace(setting, precision=precision), engines, root)
    return found


def _measure_engines(models: list[str], setting: Setting, engines: list[str], root: Path) -> list[Measurement]:
    from agent_core.rollout.engines import ENGINES

    measurements = []
    for engine in engines:
        if engine != "hf" and engine not in ENGINES.names():
            reason = f"no engine registered as {engine!r} (valid: {', '.join(ENGINES.names())})"
            measurements += [skipped_measurement(_key(m, engine, setting.precision), _goal(m), reason) for m in models]
            continue
        if engine == "vllm":
            from agent_core.config import VLLMConfig
            from agent_core.rollout.vllm_server import VLLMNotInstalledError, vllm_python

            try:
                vllm_python(VLLMConfig())
            except VLLMNotInstalledError as error:
                measurements += [skipped_measurement(_key(m, engine, setting.precision), _goal(m), str(error).split(". ")[0] +
                                                     " (`make vllm`)") for m in models]
                continue
        for model in models:
            try:
                measurements.append(compare(model, setting, engine, root))
            except Exception as error:  # noqa: BLE001 - only the optional engine may fail without failing the run
                if engine == "hf":
                    raise
                measurements.append(skipped_measurement(_key(model, engine, setting.precision), _goal(model),
                                                        f"{engine} failed: {error}"))
    return measurements


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--model", choices=("smollm2", "tiny", "both"), default="both",
                        help="smollm2: SmolLM2-135M-Instruct (needs `make smollm2`; has the goal); "
                             "tiny: a from-scratch 1M-parameter Llama (no goal); both (default)")
    parser.add_argument("--engine", choices=("hf", "vllm", "all"), default="all",
                        help="the pipeline's rollout engine; all (default): hf, then vllm, each its own measurement "
                             "(TRL always uses HF generate); vllm needs `make vllm`, else it is recorded as skipped")
    parser.add_argument("--iterations", type=int, default=3,
                        help="iterations (= TRL steps) per side and engine; the first is warm-up, the rest give the "
                             "median (SmolLM2: about 12 minutes per iteration with hf, both sides together)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "all"), default="all",
                        help="fp32 on both sides; bf16: our trainer.precision bf16 (and vLLM bfloat16 weights) vs TRL "
                             "with bf16 mixed precision, keys ending in -bf16; all (default): fp32, then bf16")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per sample at most")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data root (printed) for inspection")
    args = parse_args(parser, argv, QUICK)  # --quick: tiny model, 2 iterations of 4 x 4 x 16, both engines
    if args.iterations < 2:
        parser.error("--iterations must be at least 2 (the first is warm-up)")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (module docstring); inherited by TRL
    args = arguments(argv)
    setting = Setting(prompts=args.prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                      iterations=args.iterations, threads=args.threads)
    models = ["smollm2", "tiny"] if args.model == "both" else [args.model]
    engines = ["hf", "vllm"] if args.engine == "all" else [args.engine]
    if "smollm2" in models:
        smollm2_dir()  # fail before any work
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="agentr1-trl-compare-"))
    from flows.environment import configure_environment

    configure_environment(root / "data")  # Prefect reads its settings when first imported (tasks import it)
    try:
        precisions = ("fp32", "bf16") if args.precision == "all" else (args.precision,)
        measurements = measure_all(models, setting, engines, root, precisions)
    finally:
        if args.keep:
            print(f"bench: kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    write_result(NAME, "This pipeline vs TRL GRPOTrainer: seconds per single-turn GRPO iteration", measurements,
                 seconds=time.perf_counter() - started, results_dir=args.results_dir, argv=argv, data_root=root,
                 notes="Noisy: a shared 2-core CPU machine. The sides alternate (TRL step k, then pipeline "
                       "iteration k). The pipeline's iteration includes its Parquet tables, loading and saving "
                       "policy and optimizer state, and MLflow registration; TRL's step keeps all in memory. "
                       "With the vllm engine the pipeline's first iteration also starts the vLLM server (the "
                       "median leaves the first iteration out) and its CPU seconds include the server's.",
                 config={**asdict(setting), "models": models, "engines": engines,
                         "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
