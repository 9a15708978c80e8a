"""bench/scale_out.py's rollout part (see its docstring): the same seeded rollout run by a
ReplicaRouter over 1 and 2 hf replicas and by the in-process hf engine with 1 and 2 torch threads,
in alternating rounds (`alternate`, which the training part uses too)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from agent_core.config import RolloutConfig
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.rollout.agent_loop import run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engines import ENGINES, EngineOptions
from agent_core.rollout.spec import RolloutSpec
from bench.common import Measurement, Progress


def median(values: list[float]) -> float:
    return statistics.median(values)


def r3(value: float) -> float:
    return round(value, 3)


class Rollout:
    """The rollout workload of tests/test_cluster.py's `_rollout`, at the benchmark's sizes."""

    def __init__(self, task, tokenizer, args):
        self.task, self.tokenizer, self.args = task, tokenizer, args
        self.resources = EnvResources(search_index=Bm25Index(task.documents))
        # lock-step turns (straggler_wait_s .inf): every arm generates the same tokens
        self.spec = RolloutSpec.from_config(RolloutConfig(
            group_size=args.group_size, max_steps=args.max_steps, max_new_tokens=args.max_new_tokens,
            max_context_tokens=2048, temperature=1.0, straggler_wait_s=float("inf")))
        self.sampling = self.spec.sampling(args.seed, eos_token_ids(tokenizer))

    def run(self, engine, *, prompts: int, prefix: str = "bench-") -> dict:
        started = time.perf_counter()
        steps = run_episodes(engine, self.tokenizer, self.task.prompts[:prompts],
                             lambda p: make_env(p.env_name, p.env_kwargs, self.resources), self.sampling,
                             self.spec.loop(0, prefix))
        seconds = time.perf_counter() - started
        tokens = sum(len(s.response_ids) for s in steps)
        return {"seconds": seconds, "tokens": tokens, "steps": len(steps), "tokens_per_s": tokens / seconds,
                "served_by": sorted({s.served_by for s in steps if getattr(s, "served_by", None)}),
                "ids": [tuple(s.response_ids) for s in steps]}

    def timed(self, engine) -> dict:
        return self.run(engine, prompts=self.args.prompts)

    def warm_up(self, engine) -> None:
        """One untimed rollout of the timed size (allocator, kernels, the replicas' first calls)."""
        self.run(engine, prompts=self.args.prompts, prefix="warmup-")


class InProcess:
    """The in-process hf engine with `threads` torch threads while it generates."""

    def __init__(self, engine, threads: int):
        self.engine, self.threads = engine, threads

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, **routing):  # routing: the loop's `sessions` (KV reuse)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self.engine.generate(prompts, params, **routing)
        finally:
            torch.set_num_threads(before)


def alternate(arms: dict, rounds: int, run_arm, progress: Progress, what: str) -> dict[str, list[dict]]:
    """Every arm once per round, the order reversed every other round; arm name -> its rounds."""
    out: dict[str, list[dict]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            result = run_arm(arms[name])
            out[name].append(result)
            progress(f"{what} round {r + 1}/{rounds} {name}: {result['summary']}")
    return out


def rollout_part(policy_dir: Path, task, tokenizer, args, progress: Progress, pools: dict) -> tuple[list, dict]:
    """The four rollout arms; (measurements, pool of 2 replicas' start seconds)."""
    from agent_core.cluster.replicas import ReplicaPool, ReplicaSpec
    from agent_core.cluster.router import ReplicaRouter

    options = EngineOptions(max_batch_size=args.max_batch_size)
    rollout = Rollout(task, tokenizer, args)
    start_seconds = {}
    for count in (1, 2):
        progress(f"starting a pool of {count} hf replica(s)")
        started = time.perf_counter()
        spec = ReplicaSpec(engine="hf", options=options, count=count, cpus=1, threads=1, sync_timeout_s=300)
        pools[f"hf{count}"] = ReplicaPool(spec, str(policy_dir), 0)
        start_seconds[count] = time.perf_counter() - started
        progress(f"pool of {count} started in {start_seconds[count]:.1f}s")
    engine = ENGINES.get("hf")(policy_dir, options)
    arms = {
        "1 replica": ReplicaRouter(pools["hf1"], generate_timeout_s=300),
        "2 replicas": ReplicaRouter(pools["hf2"], generate_timeout_s=300),
        "in-process 1 thread": InProcess(engine, 1),
        "in-process 2 threads": InProcess(engine, 2),
    }
    for name, arm in arms.items():
        rollout.warm_up(arm)
    progress("rollout warm-ups done")

    def run_arm(arm) -> dict:
        result = rollout.timed(arm)
        result["summary"] = (f"{result['steps']} steps, {result['tokens']} tokens in {result['seconds']:.2f}s "
                             f"({result['tokens_per_s']:.1f} tok/s)")
        return result

    rounds = alternate(arms, args.repeats, run_arm, progress, "rollout")
    tps = {name: median([r["tokens_per_s"] for r in rs]) for name, rs in rounds.items()}
    reference = sorted(rounds["in-process 1 thread"][0]["ids"])
    same = all(sorted(r["ids"]) == reference for rs in rounds.values() for r in rs)
    first = rounds["1 replica"][0]
    common = {"episodes": args.prompts * args.group_size, "steps": first["steps"], "tokens": first["tokens"],
              "same_tokens": same}
    arm_details = {
        name: {"median_tokens_per_s": round(tps[name], 1),
               "median_seconds": r3(median([r["seconds"] for r in rs])),
               "tokens_per_s": [round(r["tokens_per_s"], 1) for r in rs],
               **({"served_by": rs[0]["served_by"]} if rs[0]["served_by"] else {})}
        for name, rs in rounds.items()}
    starts = {"pool_start_seconds_1_replica": r3(start_seconds[1]),
              "pool_start_seconds_2_replicas": r3(start_seconds[2])}
    one, two = tps["1 replica"], tps["2 replicas"]
    inproc1, inproc2 = tps["in-process 1 thread"], tps["in-process 2 threads"]
    measurements = [
        Measurement("rollout_replicas", two / one, None, {
            "ratio_is": "tokens/s with 2 hf replicas (1 thread each) / with 1 hf replica (1 thread), same rollout",
            **common, "1 replica": arm_details["1 replica"], "2 replicas": arm_details["2 replicas"], **starts}),
        Measurement("rollout_ray_overhead", one / inproc1, None, {
            "ratio_is": "tokens/s with 1 hf replica behind the router / in-process hf engine, both 1 thread",
            **common, "1 replica": arm_details["1 replica"],
            "in-process 1 thread": arm_details["in-process 1 thread"]}),
        Measurement("rollout_replicas_vs_threads", two / inproc2, None, {
            "ratio_is": "tokens/s with 2 hf replicas (1 thread each) / in-process hf engine with 2 threads",
            **common, "2 replicas": arm_details["2 replicas"],
            "in-process 2 threads": arm_details["in-process 2 threads"],
            "in-process 2 threads / 1 thread": r3(inproc2 / inproc1)}),
    ]
    return measurements, {"rollout_seconds_2_replicas": median([r["seconds"] for r in rounds["2 replicas"]]),
                          "start_seconds": start_seconds}
