"""Gateway: an agent program through the OpenAI-compatible gateway vs the in-process agent loop, tokens/s on the same prompts, policy, engine (hf) and budgets.

In-process: `agent_core.drivers.roll_out` in the built-in search env (the agent loop, every episode's
request batched into one hf generate call per turn). Gateway: the same rollout driver with
`rollout.env: agent_program`, one run of bench/gateway_program.py per episode (standard library
only, so no client library's import is timed), all episodes' programs at once (`max_parallel` =
episodes), each talking HTTP to the gateway over the same engine object, which batches the
requests that are queued together (agent_core/gateway/batching.py). The program sends the same
opening conversation the loop's env renders (system instructions + question) and, after each
reply, the observation texts the loop's episode of the same prompt saw (sample 0's, from the
in-process run of the same round), until the gateway's call budget (max_steps) refuses; so both
sides generate under the same budgets from the same contexts' shape, though not the same tokens.

ratio = gateway tokens/s / in-process tokens/s (generated tokens / wall seconds of `roll_out`,
program start-up, HTTP and the gateway's bookkeeping included). With --repeats N (default 3) the
two alternate N times and each side's median round (by tokens/s) is used; a warm-up of each runs
first. details: both sides' generate calls and mean sequences per call, seconds with a generate
call in flight, prompt tokens per step (the contexts are alike, not identical).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from agent_core.config import RolloutConfig
from agent_core.data.rows import document_to_row
from agent_core.envs.registry import make_env
from agent_core.io.tables import write_table
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine
from bench.common import Goal, Measurement, Progress, base_parser, parse_args, write_result
from bench.rollout import RecordingEngine, median_round
from bench.workload import POLICY_SIZES, rollout_config, save_policy_dir, synthetic_task, tiny_policy
from agent_core.drivers import DataAccess, roll_out
from agent_core.rollout.spec import env_for, env_resources

NAME = "gateway"
TITLE = "Gateway: an agent program through the OpenAI-compatible gateway vs the in-process agent loop"
GOAL = Goal("gateway path tokens/s / in-process agent loop tokens/s (same prompts, policy, hf engine, budgets)",
            ">=", 0.5)
PROGRAM = Path(__file__).resolve().parent / "gateway_program.py"
QUICK = dict(prompts=2, group_size=2, max_steps=2, max_new_tokens=8, repeats=1, policy="quick")


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--max-steps", type=int, default=4, help="LLM calls per episode at most")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per action at most")
    parser.add_argument("--repeats", type=int, default=3, help="alternating in-process/gateway rounds (median used)")
    parser.add_argument("--policy", choices=sorted(POLICY_SIZES), default="demo", help="policy size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task, the weights and the sampling")
    return parse_args(parser, argv, QUICK)


def program_prompts(prompts, loop_records, cfg: RolloutConfig, documents, tokenizer) -> list:
    """The prompts as the program gets them: the loop env's opening conversation, and the
    observations sample 0 of the prompt saw in the loop (with the env's observation role)."""
    resources = env_resources(tokenizer, documents)  # as the loop driver builds them
    seen: dict[str, list[str]] = {}
    for record in loop_records:
        if record.sample_idx == 0 and not record.done:
            seen.setdefault(record.prompt_id, []).append(record.observation_text)
    out = []
    for prompt in prompts:
        env = make_env(*env_for(prompt, cfg), resources)
        opening = tuple(env.reset(prompt))
        role = "user" if env.observation_role == "tool" else env.observation_role  # no tool_call to answer
        observations = [[role, text] for text in seen.get(prompt.prompt_id, [])]
        out.append(replace(prompt, messages=opening, metadata={**prompt.metadata, "observations": observations}))
    return out


def gateway_config(args, episodes: int) -> RolloutConfig:
    return RolloutConfig(engine="hf", env="agent_program", group_size=args.group_size, max_steps=args.max_steps,
                         max_new_tokens=args.max_new_tokens, max_context_tokens=2048,
                         env_kwargs={"command": [sys.executable, str(PROGRAM)], "max_parallel": episodes,
                                     "timeout_s": 600})


def timed(engine, tokenizer, prompts, documents, cfg, args, prefix: str, corpus: str | None = None) -> dict:
    """One rollout through `roll_out`, timed, its engine calls recorded."""
    recorder = RecordingEngine(engine)
    started = time.perf_counter()
    records = roll_out(recorder, tokenizer, prompts, documents, cfg, seed=args.seed, policy_version=0,
                       episode_prefix=prefix, access=DataAccess(corpus))
    seconds = time.perf_counter() - started
    tokens = sum(len(r.response_ids) for r in records)
    return {"records": records, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "episodes": len({r.episode_id for r in records}), "steps": len(records),
            "generate_calls": len(recorder.calls), "generate_seconds": recorder.busy_seconds(),
            "sequences_per_call": statistics.mean(len(c.prompts) for c in recorder.calls) if recorder.calls else 0.0,
            "prompt_tokens_per_step": statistics.mean(len(r.prompt_ids) for r in records) if records else 0.0,
            "failed": sum(1 for r in records if r.termination == "error")}


def one_round(engine, tokenizer, task, loop_cfg, args, corpus: str, progress: Progress) -> dict:
    prompts = task.prompts[: args.prompts]
    loop = timed(engine, tokenizer, prompts, task.documents, loop_cfg, args, "loop-")
    gateway_prompts = program_prompts(prompts, loop["records"], loop_cfg, task.documents, tokenizer)
    gateway_cfg = gateway_config(args, len(prompts) * args.group_size)
    gateway = timed(engine, tokenizer, gateway_prompts, task.documents, gateway_cfg, args, "gw-", corpus)
    for side, result in (("in-process", loop), ("gateway", gateway)):
        progress(f"{side}: {result['steps']} steps, {result['tokens']} tokens in {result['seconds']:.2f}s "
                 f"({result['tokens_per_s']:.1f} tok/s); {result['generate_calls']} generate calls, "
                 f"{result['sequences_per_call']:.1f} sequences each, {result['generate_seconds']:.2f}s generating")
    strip = lambda r: {k: v for k, v in r.items() if k != "records"}  # noqa: E731
    return {"loop": strip(loop), "gateway": strip(gateway)}


def measure(args, progress: Progress) -> Measurement:
    task = synthetic_task(args.seed, small=args.quick)
    model, tokenizer = tiny_policy(task, POLICY_SIZES[args.policy], seed=args.seed)
    loop_cfg = rollout_config(group_size=args.group_size, max_steps=args.max_steps, max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        policy_dir = save_policy_dir(model, tokenizer, Path(tmp) / "policy")
        corpus = str(write_table("corpus", [document_to_row(d) for d in task.documents], Path(tmp) / "corpus.parquet"))
        engine = ENGINES.get("hf")(policy_dir, EngineOptions.from_rollout(loop_cfg))
        try:
            progress("warm-up: one episode of each")
            warm = argparse.Namespace(**{**vars(args), "prompts": 1, "group_size": 1, "max_steps": 1})
            one_round(engine, tokenizer, task, rollout_config(group_size=1, max_steps=1,
                                                              max_new_tokens=args.max_new_tokens),
                      warm, corpus, progress)
            rounds = []
            for r in range(args.repeats):
                progress(f"round {r + 1}/{args.repeats}")
                rounds.append(one_round(engine, tokenizer, task, loop_cfg, args, corpus, progress))
        finally:
            close_engine(engine)
    loop = median_round([r["loop"] for r in rounds], "tokens_per_s")
    gateway = median_round([r["gateway"] for r in rounds], "tokens_per_s")
    ratio = gateway["tokens_per_s"] / loop["tokens_per_s"]
    rounding = lambda d: {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}  # noqa: E731
    details = {"in_process": rounding(loop), "gateway": rounding(gateway),
               "episodes_per_s_ratio": round((gateway["episodes"] / gateway["seconds"])
                                             / (loop["episodes"] / loop["seconds"]), 3),
               "rounds": [{side: rounding(r[side]) for side in r} for r in rounds]}
    why = "" if GOAL.met(ratio) else why_missed(loop, gateway)
    return Measurement("hf", ratio, GOAL, details, why_missed=why)


def why_missed(loop: dict, gateway: dict) -> str:
    """Where the gateway path's time went beyond the loop's, from the measured parts."""
    outside = lambda d: d["seconds"] - d["generate_seconds"]  # noqa: E731
    return (f"the gateway path took {gateway['seconds']:.2f}s for {gateway['tokens']} tokens against the loop's "
            f"{loop['seconds']:.2f}s for {loop['tokens']}: generating {gateway['generate_seconds']:.2f}s in "
            f"{gateway['generate_calls']} calls of {gateway['sequences_per_call']:.1f} sequences (loop "
            f"{loop['generate_seconds']:.2f}s in {loop['generate_calls']} of {loop['sequences_per_call']:.1f}), "
            f"and {outside(gateway):.2f}s with no call in flight (loop {outside(loop):.2f}s): program start-up, "
            f"HTTP, rendering and the batching window.")


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    measurement = measure(args, progress)
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir",)}
    d = measurement.details
    write_result(NAME, TITLE, [measurement], seconds=progress.elapsed, config=config, results_dir=args.results_dir,
                 argv=argv, notes=f"hf engine, policy {args.policy}; {args.prompts} prompts x {args.group_size} "
                                  f"episodes, max {args.max_steps} steps x {args.max_new_tokens} tokens; gateway "
                                  f"{d['gateway']['tokens_per_s']} tok/s vs in-process {d['in_process']['tokens_per_s']}"
                                  f" tok/s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
