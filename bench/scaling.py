"""Scaling: iteration time vs the number of episodes and vs steps per episode (should be ~linear).

One iteration here = the rollout (`agent_core.drivers.roll_out` with the hf engine: agent loop, search
env, BM25) + one PPO update on its steps (`train_iteration`, layout "auto" = packed episodes),
timed in-process with no Prefect/Parquet (bench/overhead.py measures those). Advantages are a
synthetic +-1 per episode (the update's cost does not depend on their values). The policy is a
tiny random-init one, which almost never answers: every episode runs to max_steps, so the steps
per episode are the --steps values (the details give the steps actually taken).

Two axes, each a series of fresh iterations from the same initial weights:
- episodes: --episodes E (comma list) at --base-steps steps per episode;
- steps:    --steps S (comma list) at --base-episodes episodes.

Linearity ratio of an axis = (time at its largest size / time at its smallest) / (agent steps at
the largest / agent steps at the smallest), agent steps = steps actually taken in the iteration
(episodes x steps per episode). 1.0 = exactly linear; < 1 = sub-linear (batching absorbs the
growth: more episodes fill the same engine and trainer batches); > 1 = super-linear (e.g.
contexts re-encoded per step, attention over longer contexts). Goal <= 1.2 on both axes. A
warm-up iteration of the smallest size runs first; then every point runs --repeats times, the
points taking turns (round r runs each point once), and each point's median seconds are used (one
iteration of the smallest point takes ~0.2 s: single runs are at the mercy of the machine). The
details also count the context tokens the engine prefilled (`prefill_tokens`: the prompt ids of
every step less those its kept KV caches held, `reused_tokens`): the engine is built as rollout.hf
configures it, with KV reuse across an episode's turns (`--no-kv-reuse`: every turn's whole context
is prefilled, and prefilling grows faster than the agent steps on the steps axis).
Default sizes take about 20 seconds on 2 cores.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import make_optimizer, train_iteration
from bench.common import Goal, Measurement, Progress, base_parser, parse_args, write_result
from bench.workload import POLICY_SIZES, fresh_copy, rollout_config, synthetic_task, tiny_policy
from agent_core.drivers import DataAccess, roll_out

NAME = "scaling"
TITLE = "Scaling: iteration time vs episodes and vs steps per episode"
GOAL = Goal("(time ratio largest/smallest) / (agent-step ratio largest/smallest)", "<=", 1.2)
QUICK = dict(episodes="2,4", steps="1,2", base_steps=2, base_episodes=2, group_size=2, max_new_tokens=4,
             policy="quick", repeats=1)


def _sizes(text: str) -> list[int]:
    sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    if len(sizes) < 2 or sizes[0] < 1:
        raise SystemExit(f"need at least two positive sizes, got {text!r}")
    return sizes


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--episodes", default="16,32,64", help="episode counts of the episodes axis (comma list)")
    parser.add_argument("--steps", default="1,2,4", help="steps per episode of the steps axis (comma list)")
    parser.add_argument("--base-steps", type=int, default=2, help="steps per episode on the episodes axis")
    parser.add_argument("--base-episodes", type=int, default=16, help="episodes on the steps axis")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per prompt (episode counts must divide)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per action at most")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="padded tokens per micro-batch")
    parser.add_argument("--policy", choices=sorted(POLICY_SIZES), default="demo", help="policy size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task, the weights and the sampling")
    parser.add_argument("--no-kv-reuse", action="store_true", help="the hf engine prefills every turn's whole "
                        "context (rollout.hf.kv_reuse: false), as before KV reuse")
    parser.add_argument("--repeats", type=int, default=5, help="iterations per point (taking turns); the median is used")
    args = parse_args(parser, argv, QUICK)
    args.episode_sizes, args.step_sizes = _sizes(args.episodes), _sizes(args.steps)
    for count in [*args.episode_sizes, args.base_episodes]:
        if count % args.group_size:
            raise SystemExit(f"episode count {count} is not a multiple of --group-size {args.group_size}")
    return args


def train_steps(records, seed: int) -> list[list[TrainStep]]:
    """The rollout's episodes as the trainer gets them, with one synthetic +-1 advantage per episode."""
    rng = random.Random(seed)
    episodes: dict[str, list] = {}
    for r in records:
        episodes.setdefault(r.episode_id, []).append(r)
    out = []
    for steps in episodes.values():
        advantage = rng.choice((-1.0, 1.0))
        out.append([TrainStep(r.prompt_ids, r.response_ids, r.response_logprobs, [advantage] * len(r.response_ids))
                    for r in sorted(steps, key=lambda s: s.step_idx)])
    return out


def one_iteration(base_model, tokenizer, task, args, episodes: int, steps: int) -> dict:
    """Rollout + one update from the initial weights; seconds of each part and the work done."""
    model = fresh_copy(base_model)
    cfg = rollout_config(group_size=args.group_size, max_steps=steps, max_new_tokens=args.max_new_tokens)
    cfg = cfg.model_copy(update={"hf": cfg.hf.model_copy(update={"kv_reuse": not args.no_kv_reuse})})
    engine = HFEngine.configured(model, tokenizer, cfg.hf, max_batch_size=64)  # as the engine factory builds it
    started = time.perf_counter()
    records = roll_out(engine, tokenizer, task.prompts[: episodes // args.group_size], task.documents, cfg,
                       seed=args.seed, policy_version=0, episode_prefix="bench-", access=DataAccess())
    rollout_seconds = time.perf_counter() - started
    reused = engine.sessions.reused_tokens if engine.sessions is not None else 0  # context tokens not prefilled
    rows = choose_layout(train_steps(records, args.seed), "auto")
    settings = PPOSettings(micro_batch_tokens=args.micro_batch_tokens)
    started = time.perf_counter()
    train_iteration(model, make_optimizer(model, lr=3e-4), rows, settings, pad_id=tokenizer.pad_token_id)
    train_seconds = time.perf_counter() - started
    return {"episodes": episodes, "max_steps": steps, "agent_steps": len(records),
            "generated_tokens": sum(len(r.response_ids) for r in records),
            "prefill_tokens": sum(len(r.prompt_ids) for r in records) - reused, "reused_tokens": reused,
            "train_rows": len(rows),
            "train_tokens": sum(len(r) for r in rows), "rollout_seconds": round(rollout_seconds, 3),
            "train_seconds": round(train_seconds, 3), "seconds": round(rollout_seconds + train_seconds, 3)}


def median_point(points: list[dict]) -> dict:
    """The point's work (the same every repeat: seeded) with the median of each part's seconds."""
    middle = lambda key: round(statistics.median(p[key] for p in points), 3)  # noqa: E731
    return {**points[0], "rollout_seconds": middle("rollout_seconds"), "train_seconds": middle("train_seconds"),
            "seconds": middle("seconds"), "repeat_seconds": [p["seconds"] for p in points]}


def axis_measurement(key: str, points: list[dict]) -> Measurement:
    small, large = points[0], points[-1]
    time_ratio = large["seconds"] / small["seconds"]
    size_ratio = large["agent_steps"] / small["agent_steps"]
    ratio = time_ratio / size_ratio
    details = {"time_ratio": round(time_ratio, 3), "agent_step_ratio": round(size_ratio, 3),
               "seconds_per_agent_step": [round(p["seconds"] / p["agent_steps"], 4) for p in points], "points": points}
    why = ""
    if not GOAL.met(ratio):
        rollout = large["rollout_seconds"] / small["rollout_seconds"] / size_ratio
        train = large["train_seconds"] / small["train_seconds"] / size_ratio
        why = (f"time grew {time_ratio:.2f}x for {size_ratio:.2f}x the agent steps; per part (same definition): "
               f"rollout {rollout:.2f}, training {train:.2f}. A part above 1 is where cost grows faster than the "
               f"work. The contexts the engine prefilled grew {large['prefill_tokens'] / small['prefill_tokens']:.2f}x "
               f"and the tokens trained {large['train_tokens'] / small['train_tokens']:.2f}x (generated: "
               f"{large['generated_tokens'] / small['generated_tokens']:.2f}x).")
    return Measurement(key, ratio, GOAL, details, why_missed=why)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    task = synthetic_task(args.seed, small=args.quick)
    needed = max([*args.episode_sizes, args.base_episodes]) // args.group_size
    if len(task.prompts) < needed:
        raise SystemExit(f"the task has {len(task.prompts)} training prompts, {needed} are needed")
    model, tokenizer = tiny_policy(task, POLICY_SIZES[args.policy], seed=args.seed)
    one_iteration(model, tokenizer, task, args, args.group_size, 1)  # warm-up
    progress("warm-up done")
    sizes = list(dict.fromkeys([*((e, args.base_steps) for e in args.episode_sizes),
                                *((args.base_episodes, s) for s in args.step_sizes)]))
    runs: dict[tuple[int, int], list[dict]] = {size: [] for size in sizes}
    for round_ in range(args.repeats):
        for episodes, steps in sizes:
            p = one_iteration(model, tokenizer, task, args, episodes, steps)
            runs[episodes, steps].append(p)
            progress(f"round {round_ + 1}/{args.repeats}: {episodes} episodes x {steps} steps: {p['agent_steps']} "
                     f"agent steps, rollout {p['rollout_seconds']:.2f}s + train {p['train_seconds']:.2f}s")
    done = {size: median_point(points) for size, points in runs.items()}
    by_episodes = [done[e, args.base_steps] for e in args.episode_sizes]
    by_steps = [done[args.base_episodes, s] for s in args.step_sizes]
    measurements = [axis_measurement("episodes", by_episodes), axis_measurement("steps_per_episode", by_steps)]
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir", "episode_sizes", "step_sizes")}
    write_result(NAME, TITLE, measurements, seconds=progress.elapsed, config=config, results_dir=args.results_dir,
                 argv=argv, notes=f"policy {args.policy}; each point the median of {args.repeats} iterations "
                                  "(the points taking turns); seconds, not work, differ between repeats.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
