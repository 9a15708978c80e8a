"""Pipeline overhead: the share of a training iteration's wall time spent outside generation and
forward/backward/optimizer steps (Prefect, Parquet I/O, schema validation, checkpoints, MLflow).

Runs the real training flow (flows/train.py `train`) on a fresh temporary data root: the demo's
config (configs/demo.yaml; --quick: configs/tiny.yaml) with the warm start and dev evaluation off,
--iterations iterations of --prompts x --group-size episodes of up to --max-steps steps. Nothing
in the library is changed; this process wraps, for the duration of the run:

- `HFEngine.generate`: time generating (the rollout's engine calls);
- `agent_core.training.trainer._accumulate_and_step`: time in forward + backward + clip + optimizer
  step over an update's micro-batches (the trainer's compute; padding the batches is outside it);
- the stage tasks as `flows.train` calls them (prepare_data ... log_iteration): iteration k runs
  from the start of its prepare_data to the end of its log_iteration, and each stage's seconds
  (Prefect task overhead included) say where the rest goes.

Two of those stages are also reported as their own share of the iteration's wall time: the cost
ledger (`record_ledger`, tasks/ledger.py) and the behaviour audit (`audit_iteration`,
tasks/audit.py; goal <= 0.05, issue 33). Either, missing from flows.train, is reported as skipped.
An iteration ends where its last stage ends (the audit runs after log_iteration).

overhead share = 1 - (generate + train compute) / iteration wall time, over iterations 1..N-1
(iteration 0 also pays first-call costs: Prefect task registration, MLflow model registry,
imports); iteration 0's share is in the details. Goal <= 0.10. The share depends on the model
size: the bigger the policy, the more of the time is compute, so the tiny demo policy is the
hard case. Prefect's temporary API start (~7 s) and the run's setup (dataset, initial policy,
MLflow run) happen before iteration 0 and are reported as `setup_seconds`, not in the share.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

from bench.common import Goal, Measurement, Progress, base_parser, parse_args, skipped_measurement, write_result

NAME = "overhead"
TITLE = "Pipeline overhead per iteration"
GOAL = Goal("share of iteration wall time outside generation and forward/backward/step", "<=", 0.10)
REPO_ROOT = Path(__file__).resolve().parent.parent
STAGES = ("prepare_data", "rollout", "label_rewards", "compute_advantages", "train_policy", "log_iteration")
# Stages measured as their own share when flows.train has them: (measurement key, task name in flows.train, goal).
PARTS = (("ledger", "record_ledger", None),
         ("audit", "audit_iteration", Goal("share of iteration wall time in the behaviour audit", "<=", 0.05)))
QUICK = dict(config="configs/tiny.yaml", iterations=2, prompts=3, group_size=2, max_steps=3, max_new_tokens=12)


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--config", default="configs/demo.yaml", help="base config (relative to the repository)")
    parser.add_argument("--iterations", type=int, default=3, help="training iterations (the first is reported apart)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--max-steps", type=int, default=4, help="LLM calls per episode at most")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per action at most")
    parser.add_argument("--keep-data", action="store_true", help="keep the temporary data root (its path is printed)")
    return parse_args(parser, argv, QUICK)


class Timeline:
    """(kind, iteration or None, start, end) intervals recorded by the wrappers."""

    def __init__(self):
        self.intervals: list[tuple[str, int | None, float, float]] = []

    def wrap(self, kind: str, fn, iteration_arg: int | None = None):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                k = args[iteration_arg] if iteration_arg is not None and len(args) > iteration_arg else None
                self.intervals.append((kind, k, started, time.perf_counter()))
        return timed

    def within(self, kind: str, start: float, end: float) -> float:
        """Seconds of `kind` intervals inside [start, end] (clipped to it)."""
        return sum(max(0.0, min(e, end) - max(s, start)) for name, _, s, e in self.intervals if name == kind)

    def stage(self, name: str, k: int) -> tuple[float, float]:
        found = self.stage_or_none(name, k)
        if found is None:
            raise RuntimeError(f"no {name} stage recorded for iteration {k}: did flows/train.py change?")
        return found

    def stage_or_none(self, name: str, k: int) -> tuple[float, float] | None:
        found = [(s, e) for kind, it, s, e in self.intervals if kind == f"stage:{name}" and it == k]
        return found[0] if found else None


def measured_stages() -> tuple[str, ...]:
    """STAGES plus the PARTS' tasks that flows.train calls (an absent one is reported as skipped)."""
    import flows.train as train_flow

    return STAGES + tuple(task for _, task, _ in PARTS if hasattr(train_flow, task))


@contextmanager
def instrumented(timeline: Timeline):
    """Wrap the engine, the trainer's compute and the flow's stage calls for the run's duration."""
    import agent_core.training.trainer as trainer
    import flows.train as train_flow
    from agent_core.rollout.hf_engine import HFEngine

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(HFEngine, "generate", timeline.wrap("generate", HFEngine.generate)))
        stack.enter_context(mock.patch.object(trainer, "_accumulate_and_step",
                                              timeline.wrap("train_compute", trainer._accumulate_and_step)))
        for name in measured_stages():  # every stage task takes (run, iteration, ...)
            stack.enter_context(mock.patch.object(train_flow, name, timeline.wrap(f"stage:{name}",
                                                                                  getattr(train_flow, name), 1)))
        yield


def iteration_breakdown(timeline: Timeline, k: int) -> dict:
    start, _ = timeline.stage("prepare_data", k)
    spans = {name: span for name in measured_stages() if (span := timeline.stage_or_none(name, k)) is not None}
    missing = [name for name in STAGES if name not in spans]
    if missing:
        timeline.stage(missing[0], k)  # raises, naming it
    end = max(e for _, e in spans.values())
    wall = end - start
    generate, compute = timeline.within("generate", start, end), timeline.within("train_compute", start, end)
    stages = {name: e - s for name, (s, e) in spans.items()}
    parts = {  # where the overhead goes
        "rollout_outside_generate": stages["rollout"] - generate,
        "train_outside_compute": stages["train_policy"] - compute,
        **{name: seconds for name, seconds in stages.items() if name not in ("rollout", "train_policy")},
        "between_stages": wall - sum(stages.values()),
    }
    return {"iteration": k, "wall": wall, "generate": generate, "train_compute": compute,
            "overhead": wall - generate - compute, "share": (wall - generate - compute) / wall,
            "stages": stages, "overhead_parts": parts}


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 4) if isinstance(value, float) else value


def part_measurements(iterations: list[dict]) -> list[Measurement]:
    """The ledger's and the audit's share of the measured iterations' wall time (PARTS)."""
    measured = iterations[1:] or iterations
    wall = sum(it["wall"] for it in measured)
    found = []
    for key, task, goal in PARTS:
        if not all(task in it["stages"] for it in measured):
            found.append(skipped_measurement(key, goal, f"flows.train does not call {task}"))
            continue
        seconds = sum(it["stages"][task] for it in measured)
        share = seconds / wall
        details = {"seconds": round(seconds, 4), "wall_seconds": round(wall, 4),
                   "per_iteration_seconds": [round(it["stages"][task], 4) for it in measured],
                   "first_iteration_seconds": round(iterations[0]["stages"].get(task, float("nan")), 4)}
        why = "" if goal is None or goal.met(share) else (
            f"{task} took {seconds:.2f}s of {wall:.2f}s over the measured iterations; the per-iteration seconds are "
            "in the details (SQL over the run's tables, Parquet writes, MLflow logging).")
        found.append(Measurement(key, share, goal, details, why_missed=why))
    return found


def measurement(iterations: list[dict], setup_seconds: float) -> Measurement:
    measured = iterations[1:] or iterations
    wall = sum(it["wall"] for it in measured)
    overhead = sum(it["overhead"] for it in measured)
    share = overhead / wall
    parts: dict[str, float] = {}
    for it in measured:
        for name, seconds in it["overhead_parts"].items():
            parts[name] = parts.get(name, 0.0) + seconds
    details = {
        "iterations_measured": [it["iteration"] for it in measured],
        "wall_seconds": wall, "generate_seconds": sum(it["generate"] for it in measured),
        "train_compute_seconds": sum(it["train_compute"] for it in measured), "overhead_seconds": overhead,
        "overhead_parts_seconds": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
        "first_iteration_share": iterations[0]["share"], "setup_seconds": setup_seconds,
        "per_iteration": iterations,
    }
    why = ""
    if not GOAL.met(share):
        largest = list(details["overhead_parts_seconds"].items())[:3]
        top = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in largest)
        why = (f"{overhead:.2f}s of {wall:.2f}s over the measured iterations were outside generation and the trainer's "
               f"compute; the largest parts: {top}. With the tiny policy the compute is small, so fixed per-stage "
               "costs (loading/saving checkpoints, Parquet + schema validation, MLflow logging and model "
               "registration, Prefect task runs) weigh heavily; a bigger policy or more episodes lowers the share.")
    return Measurement("iteration", share, GOAL, _rounded(details), why_missed=why)


def run_flow(args, data_root: Path, progress: Progress):
    """The training flow on `data_root`, instrumented; returns (per-iteration breakdowns, setup seconds)."""
    from agent_core.validation import load_config
    from flows.train import train

    overrides = [f"data_root={data_root}", "run_id=bench-overhead", f"iterations={args.iterations}",
                 "warm_start.enabled=false", "dev_eval.every=0", f"data.prompts_per_iteration={args.prompts}",
                 f"rollout.group_size={args.group_size}", f"rollout.max_steps={args.max_steps}",
                 f"rollout.max_new_tokens={args.max_new_tokens}"]
    config = load_config(REPO_ROOT / args.config, overrides)
    timeline = Timeline()
    started = time.perf_counter()
    with instrumented(timeline):
        train(config)
    progress(f"flow finished in {time.perf_counter() - started:.1f}s")
    first_start, _ = timeline.stage("prepare_data", 0)
    iterations = [iteration_breakdown(timeline, k) for k in range(args.iterations)]
    for it in iterations:
        progress(f"iteration {it['iteration']}: wall {it['wall']:.2f}s, generate {it['generate']:.2f}s, "
                 f"train compute {it['train_compute']:.2f}s, overhead {it['overhead']:.2f}s ({it['share']:.1%})")
    return iterations, first_start - started


def _stop_prefect_server() -> None:
    """Stop Prefect's temporary API while the streams are open (its atexit hook logs to closed ones)."""
    server_module = sys.modules.get("prefect.server.api.server")
    if server_module is not None:
        for server in list(server_module.SubprocessASGIServer._instances.values()):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    data_root = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    # Prefect reads its settings at import: its state goes into the throwaway root, never a user's server
    os.environ["PREFECT_HOME"] = str(data_root / "prefect")
    os.environ.pop("PREFECT_API_URL", None)
    os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")
    from flows.environment import configure_environment

    configure_environment(data_root)
    progress(f"training flow in {data_root}: {args.iterations} iterations of {args.prompts} x {args.group_size} "
             f"episodes, max {args.max_steps} steps x {args.max_new_tokens} tokens ({args.config})")
    try:
        iterations, setup_seconds = run_flow(args, data_root, progress)
    finally:
        _stop_prefect_server()
        if args.keep_data:
            progress(f"data kept in {data_root}")
        else:
            shutil.rmtree(data_root, ignore_errors=True)
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir", "keep_data")}
    write_result(NAME, TITLE, [measurement(iterations, setup_seconds), *part_measurements(iterations)],
                 seconds=progress.elapsed, config=config,
                 results_dir=args.results_dir, argv=argv, data_root=data_root,
                 notes="Measured iterations: 1..N-1 (iteration 0 pays first-call costs; its share is in the details).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
