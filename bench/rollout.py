"""Rollout throughput: tokens/s of the agent loop vs the raw engine generating the same tokens.

Loop: `agent_core.drivers.roll_out` (the rollout stage minus its Parquet I/O: BM25 index, search env,
chat encoding, the multi-step agent loop of agent_core/rollout/agent_loop.py) runs --prompts x
--group-size episodes of up to --max-steps steps on the built-in synthetic task with a tiny
random-init policy (it rarely answers, so episodes run to max_steps with full-length actions).
Loop tokens/s = generated tokens (sum of every step's response_ids) / wall time of `roll_out`.
The loop's time outside engine.generate (no call in flight) is broken down by what it was doing
(agent_loop.RolloutTimings): the search index build, starting the envs, decoding actions, waiting
for env steps (the straggler wait included), encoding observations; the rest is scheduling.

Raw: the SAME engine object is then called directly with the requests the loop made, recorded by a
thin proxy around the engine during the loop: the same contexts, in the same batches and order,
with the same SamplingParams (seed included). With the in-process `hf` engine that regenerates
exactly the loop's tokens (`same_tokens` in the details says whether it did), so both sides do
identical generation work and the ratio is the share of the loop's time that is generation.
An engine that takes concurrent calls (vLLM's server) is replayed with one call per turn (all
contexts of step k together, the best batch the engine could get), since the loop's concurrent
per-episode calls cannot be replayed one by one fairly; its sampled tokens may then differ, and
tokens/s (not seconds) keeps the comparison fair. Raw tokens/s = replayed tokens / replay time.

ratio = loop tokens/s / raw tokens/s (goal >= 0.90), per engine: a full run measures both, hf and
vllm, one after the other on the same policy and requests sizes (--engine picks one; --quick: hf
only). With --repeats N (default 3), loop and replay alternate N times and each side's median
round (by tokens/s; the lower middle one for an even N) is used. A warm-up rollout (one episode, one step) runs first. Where the goal is missed, why_missed
gives the measured parts: the seconds outside generate by kind, and generation inside the loop vs
the raw engine's time for as many tokens. vLLM needs `make vllm` and an engine registered as
"vllm"; where either is missing the measurement is recorded as skipped with the reason.
"""

from __future__ import annotations

import math
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agent_core.rollout.agent_loop import RolloutTimings
from agent_core.rollout.engine import concurrent_calls
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine, shutdown_engines
from bench.common import Goal, Measurement, Progress, base_parser, parse_args, skipped_measurement, write_result
from bench.workload import (
    POLICY_SIZES, rollout_config, save_policy_dir, synthetic_task, tiny_policy,
)
from agent_core.drivers import DataAccess, roll_out

NAME = "rollout"
TITLE = "Rollout: agent loop vs raw engine"
GOAL = Goal("agent loop tokens/s / raw engine tokens/s (same engine, same requests)", ">=", 0.90)
ENGINE_NAMES = ("hf", "vllm")
# the loop's time outside generate, by kind (RolloutTimings' fields), as why_missed names them
PARTS = {"index_seconds": "search index build", "start_seconds": "env start (reset, opening encoded)",
         "decode_seconds": "action decoding", "env_wait_seconds": "env steps (straggler wait included)",
         "encode_seconds": "observation encoding"}

QUICK = dict(prompts=2, group_size=2, max_steps=2, max_new_tokens=8, repeats=1, policy="quick", engine="hf")


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--engine", choices=[*ENGINE_NAMES, "all"], default="all",
                        help="engine(s) to measure (default: all, side by side; --quick: hf)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--max-steps", type=int, default=4, help="LLM calls per episode at most")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per action at most")
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences per engine forward pass")
    parser.add_argument("--repeats", type=int, default=3, help="alternating loop/replay measurements (median used)")
    parser.add_argument("--policy", choices=sorted(POLICY_SIZES), default="demo", help="policy size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task, the weights and the sampling")
    return parse_args(parser, argv, QUICK)


@dataclass(frozen=True)
class Call:
    prompts: list[list[int]]
    params: object
    started: float
    ended: float
    outputs: list[list[int]]  # generated token ids, one list per prompt


class RecordingEngine:
    """Forwards to an engine and records every generate call (contexts, params, times, outputs).

    Other attributes (max_concurrent_calls, close, ...) pass through, so the loop sees the engine.
    """

    def __init__(self, engine):
        self._engine = engine
        self._lock = threading.Lock()
        self.calls: list[Call] = []

    def generate(self, prompts, params, **routing):  # routing: the loop's `sessions` for engines that take them
        started = time.perf_counter()
        out = self._engine.generate(prompts, params, **routing)
        call = Call([list(p) for p in prompts], params, started, time.perf_counter(), [list(g.token_ids) for g in out])
        with self._lock:
            self.calls.append(call)
        return out

    def busy_seconds(self) -> float:
        """Time with at least one call in flight (the union of the calls' intervals)."""
        total, reach = 0.0, -math.inf
        for call in sorted(self.calls, key=lambda c: c.started):
            if call.ended > reach:
                total += call.ended - max(call.started, reach)
                reach = call.ended
        return total

    def __getattr__(self, name):
        return getattr(self._engine, name)


def replay_requests(engine, recorder: RecordingEngine, records) -> list[tuple[list[list[int]], object]]:
    """The raw engine's calls: the recorded ones, or one per turn for a concurrent engine (docstring)."""
    calls = sorted(recorder.calls, key=lambda c: c.started)
    if concurrent_calls(engine) == 1:
        return [(c.prompts, c.params) for c in calls]
    step_of = {tuple(r.prompt_ids): r.step_idx for r in records}
    turns: dict[int, tuple[list[list[int]], object]] = {}
    for call in calls:
        for prompt in call.prompts:
            turns.setdefault(step_of[tuple(prompt)], ([], call.params))[0].append(prompt)
    return [turns[k] for k in sorted(turns)]


def one_round(engine, tokenizer, task, cfg, args, progress: Progress) -> dict:
    """One timed rollout through the loop, then its requests replayed on the raw engine."""
    recorder = RecordingEngine(engine)
    prompts = task.prompts[: args.prompts]
    timings = RolloutTimings()
    started = time.perf_counter()
    records = roll_out(recorder, tokenizer, prompts, task.documents, cfg, seed=args.seed, policy_version=0,
                       episode_prefix="bench-", timings=timings, access=DataAccess())
    loop_seconds = time.perf_counter() - started
    loop_tokens = sum(len(r.response_ids) for r in records)
    generate_seconds = recorder.busy_seconds()
    parts = " ".join(f"{part.removesuffix('_seconds')} {getattr(timings, part):.3f}" for part in PARTS)
    progress(f"loop: {len(records)} steps, {loop_tokens} tokens in {loop_seconds:.2f}s "
             f"({loop_tokens / loop_seconds:.1f} tok/s); generate {generate_seconds:.2f}s; outside by kind (s): {parts}")
    requests = replay_requests(engine, recorder, records)
    started = time.perf_counter()
    outputs = [engine.generate(prompts_, params) for prompts_, params in requests]
    raw_seconds = time.perf_counter() - started
    raw_ids = sorted(tuple(g.token_ids) for out in outputs for g in out)
    raw_tokens = sum(len(ids) for ids in raw_ids)
    progress(f"raw: {len(requests)} calls, {raw_tokens} tokens in {raw_seconds:.2f}s "
             f"({raw_tokens / raw_seconds:.1f} tok/s)")
    loop_ids = sorted(tuple(ids) for call in recorder.calls for ids in call.outputs)
    return {
        "episodes": len(prompts) * cfg.group_size, "steps": len(records), "generate_calls": len(recorder.calls),
        "loop_seconds": loop_seconds, "loop_tokens": loop_tokens, "loop_tokens_per_s": loop_tokens / loop_seconds,
        "loop_generate_seconds": generate_seconds, **{part: getattr(timings, part) for part in PARTS},
        "raw_calls": len(requests), "raw_seconds": raw_seconds, "raw_tokens": raw_tokens,
        "raw_tokens_per_s": raw_tokens / raw_seconds, "same_tokens": raw_ids == loop_ids,
    }


def measure_engine(name: str, policy_dir: Path, tokenizer, task, args, progress: Progress) -> Measurement:
    if name not in ENGINES.names():
        valid = ", ".join(ENGINES.names())
        return skipped_measurement(name, GOAL, f"no engine registered as {name!r} (valid: {valid})")
    sizes = dict(max_new_tokens=args.max_new_tokens, engine=name, max_batch_size=args.max_batch_size)
    cfg = rollout_config(group_size=args.group_size, max_steps=args.max_steps, **sizes)
    progress(f"{name}: starting the engine")
    try:
        engine = ENGINES.get(name)(policy_dir, EngineOptions.from_rollout(cfg))
    except Exception as error:  # a missing venv / server that does not start: record why, do not crash
        hint = " (run `make vllm` first)" if "NotInstalled" in type(error).__name__ else ""
        return skipped_measurement(name, GOAL, f"could not start the {name} engine{hint}: "
                                               f"{type(error).__name__}: {error}"[:500])
    try:
        warm = rollout_config(group_size=1, max_steps=1, **sizes)
        roll_out(engine, tokenizer, task.prompts[:1], task.documents, warm, seed=args.seed, policy_version=0,
                 episode_prefix="warmup-", access=DataAccess())
        rounds = []
        for r in range(args.repeats):
            progress(f"{name}: round {r + 1}/{args.repeats}")
            rounds.append(one_round(engine, tokenizer, task, cfg, args, progress))
    finally:
        close_engine(engine)
    return _measurement(name, rounds)


def median_round(rounds: list[dict], key: str) -> dict:
    """The round with the median `key` (the lower middle one for an even count): a real round, not a mean."""
    return sorted(rounds, key=lambda r: r[key])[(len(rounds) - 1) // 2]


def _measurement(name: str, rounds: list[dict]) -> Measurement:
    loop, raw = median_round(rounds, "loop_tokens_per_s"), median_round(rounds, "raw_tokens_per_s")
    ratio = loop["loop_tokens_per_s"] / raw["raw_tokens_per_s"]
    outside = loop["loop_seconds"] - loop["loop_generate_seconds"]
    parts = {part: loop[part] for part in PARTS}
    details = {
        "episodes": loop["episodes"], "steps": loop["steps"], "generate_calls": loop["generate_calls"],
        "loop_tokens": loop["loop_tokens"], "loop_seconds": round(loop["loop_seconds"], 3),
        "loop_tokens_per_s": round(loop["loop_tokens_per_s"], 1),
        "loop_generate_seconds": round(loop["loop_generate_seconds"], 3),
        "loop_seconds_outside_generate": round(outside, 3),
        **{f"outside_{part}": round(seconds, 3) for part, seconds in parts.items()},
        "outside_other_seconds": round(outside - sum(parts.values()), 3),
        "raw_calls": raw["raw_calls"], "raw_tokens": raw["raw_tokens"], "raw_seconds": round(raw["raw_seconds"], 3),
        "raw_tokens_per_s": round(raw["raw_tokens_per_s"], 1),
        "same_tokens": all(r["same_tokens"] for r in rounds),
        "rounds": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rounds],
    }
    why = "" if GOAL.met(ratio) else why_missed(loop, raw["raw_tokens_per_s"])
    return Measurement(name, ratio, GOAL, details, why_missed=why)


def why_missed(loop: dict, raw_tokens_per_s: float) -> str:
    """Where the loop's time went beyond what the raw engine needs for its tokens, from the measured parts.

    loop seconds = time outside generate (by kind) + generation inside the loop; the raw engine
    would generate the loop's tokens in loop_tokens / raw tokens/s. The goal allows the loop
    raw seconds / goal in all.
    """
    seconds, generate = loop["loop_seconds"], loop["loop_generate_seconds"]
    raw_seconds = loop["loop_tokens"] / raw_tokens_per_s
    allowed = raw_seconds / GOAL.value
    outside = seconds - generate
    parts = {label: loop[part] for part, label in PARTS.items()}
    parts["scheduling and the rest"] = outside - sum(parts.values())
    listed = ", ".join(f"{label} {value:.2f}s" for label, value in sorted(parts.items(), key=lambda kv: -kv[1])
                       if abs(value) >= 0.005)
    slower = generate - raw_seconds
    return (f"the loop took {seconds:.2f}s where the goal allows {allowed:.2f}s (the raw engine needs {raw_seconds:.2f}s "
            f"for the loop's {loop['loop_tokens']} tokens): {outside:.2f}s with no generate call in flight "
            f"({listed or 'nothing measurable'}) and generation inside the loop {generate:.2f}s, "
            f"{slower:+.2f}s ({slower / raw_seconds:+.0%}) against the raw engine's rate over "
            f"{loop['generate_calls']} calls.")


def _summary(measurements: list[Measurement]) -> str:
    """The engines side by side: one line each."""
    lines = []
    for m in measurements:
        if m.skipped:
            lines.append(f"{m.key}: skipped ({m.skipped})")
            continue
        d = m.details
        lines.append(f"{m.key}: ratio {m.ratio:.3f} ({'met' if m.met else 'MISSED'}, goal >= {GOAL.value}); loop "
                     f"{d['loop_tokens_per_s']} tok/s vs raw {d['raw_tokens_per_s']} tok/s; outside generate "
                     f"{d['loop_seconds_outside_generate']}s of {d['loop_seconds']}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    task = synthetic_task(args.seed, small=args.quick)
    model, tokenizer = tiny_policy(task, POLICY_SIZES[args.policy], seed=args.seed)
    names = ENGINE_NAMES if args.engine == "all" else (args.engine,)
    measurements = []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        policy_dir = save_policy_dir(model, tokenizer, Path(tmp) / "policy")
        try:
            for name in names:
                measurements.append(measure_engine(name, policy_dir, tokenizer, task, args, progress))
        finally:
            shutdown_engines()
    progress("engines side by side:\n" + _summary(measurements))
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir",)}
    write_result(NAME, TITLE, measurements, seconds=progress.elapsed, config=config, results_dir=args.results_dir,
                 argv=argv, notes=f"engines {', '.join(names)}, each on the same policy and workload: policy "
                                  f"{args.policy}; {args.prompts} prompts x {args.group_size} episodes, max "
                                  f"{args.max_steps} steps x {args.max_new_tokens} tokens.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
