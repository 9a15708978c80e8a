"""`python -m flows.seeds`: one recipe over several training seeds, a table of held-out EM before and after RL.

A learning claim needs several seeds (mean ± std; a difference counts only beyond the seed noise).
For each seed: one base run warm-starts the policy (when the recipe has a warm start), then every
arm trains RL from that same policy, so the arms of a seed are paired. Each arm's run measures the
greedy dev EM of the policy it starts from and after its last iteration (`dev_eval`). The table
(markdown) and the numbers (JSON) go where `--out` says; `make smollm2-recipe` runs the SmolLM2
recipe this way (docs/results.md, "A pretrained policy"). Run ids are fixed by `--name`, so the same
command again resumes: finished runs are skipped, and each run's time is what its stages recorded
when they ran (the cost ledger's seconds), not the seconds a skip took.

    python -m flows.seeds --config smollm2 --arm algos/grpo.yaml --arm algos/gigpo.yaml --seeds 0 1 2 \\
        --out docs/results/smollm2 [--data-root DIR] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow

from agent_core.io.layout import DataRoot
from agent_core.io.ledger import recorded_seconds
from agent_core.validation import load_config
from flows.configs_lookup import resolve_config
from flows.train import start_policy, train


@dataclass(frozen=True)
class SeedRun:
    """One arm trained from one seed's start policy: greedy dev EM at the start and after RL."""

    arm: str
    seed: int
    run_id: str
    start_dev_em: float
    final_dev_em: float
    seconds: float  # what this arm's run took: its stages' recorded seconds (RL iterations and dev evals)


def _arm_name(config_file: str) -> str:
    return Path(config_file).stem


@flow(name="agentr1-seeds", log_prints=True)
def seeds_flow(config_files: list[str], arm_files: list[str], seeds: list[int], data_root: str, name: str,
               overrides: list[str]) -> tuple[list[SeedRun], dict[int, float]]:
    """Train every arm from every seed's start policy; the runs and each seed's warm-start seconds."""
    runs, warm_seconds = [], {}
    root = DataRoot(Path(data_root))
    for seed in seeds:
        common = [*overrides, f"data_root={data_root}", f"seed={seed}"]
        base = load_config(config_files, [*common, f"run_id={name}-s{seed}-base"])
        base_run = root.run(base.run_id)
        _, start = start_policy(base_run, base)
        warm_seconds[seed] = recorded_seconds(base_run, 1)  # its init_policy, oracle episodes and warm start
        for arm_file in arm_files:
            arm = _arm_name(arm_file)
            config = load_config([*config_files, arm_file],
                                 [*common, "warm_start.enabled=false", "policy.source=path", f"policy.path={start}",
                                  f"run_id={name}-s{seed}-{arm}"])
            print(f"agentr1 seeds: seed {seed}, arm {arm} ({config.algorithm.estimator}), run {config.run_id}")
            result = train(config)
            final = next((s.dev_em for s in reversed(result.iterations) if s.dev_em == s.dev_em), float("nan"))
            seconds = recorded_seconds(root.run(config.run_id), config.iterations)
            runs.append(SeedRun(arm, seed, config.run_id, result.start_dev_em, final, seconds))
    return runs, warm_seconds


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "-"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def seeds_table(runs: list[SeedRun]) -> str:
    """Markdown: per arm, dev EM at the start and after RL and the gain (mean ± std over seeds),
    then every run."""
    arms = list(dict.fromkeys(run.arm for run in runs))
    lines = ["| Arm | Seeds | Dev EM at start | Dev EM after RL | Gain | Gain - 1 std | Time per run |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm in arms:
        mine = [run for run in runs if run.arm == arm]
        gains = [run.final_dev_em - run.start_dev_em for run in mine]
        margin = (statistics.mean(gains) - statistics.stdev(gains)) if len(gains) > 1 else float("nan")
        lines.append(f"| {arm} | {len(mine)} | {_mean_std([r.start_dev_em for r in mine])} | "
                     f"{_mean_std([r.final_dev_em for r in mine])} | {_mean_std(gains)} | {margin:+.3f} | "
                     f"{statistics.mean(r.seconds for r in mine) / 60:.1f} min |")
    lines += ["", "| Run | Seed | Start | After RL | Gain | Time |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.run_id} | {r.seed} | {r.start_dev_em:.3f} | {r.final_dev_em:.3f} | "
              f"{r.final_dev_em - r.start_dev_em:+.3f} | {r.seconds / 60:.1f} min |" for r in runs]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.seeds", description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", required=True, help="recipe config(s), layered in order")
    parser.add_argument("--arm", action="append", required=True, help="an arm's config layered over the recipe")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--name", default="seeds", help="run ids are <name>-s<seed>-<arm>")
    parser.add_argument("--out", required=True, help="writes OUT.md (the table) and OUT.json (the numbers)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        configs = [str(resolve_config(name)) for name in args.config]
        arms = [str(resolve_config(name)) for name in args.arm]
    except (FileNotFoundError, ValueError) as error:
        print(f"agentr1 seeds: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    runs, warm = seeds_flow(configs, arms, args.seeds, args.data_root, args.name, args.overrides)
    wall = time.perf_counter() - started
    table = seeds_table(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(
        table + f"\nTime per run: the run's stage seconds as recorded when they ran (the cost ledger's). "
        f"Warm starts: {sum(warm.values()) / 60:.1f} min in all. This command's wall time: {wall / 60:.1f} min.\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"configs": args.config, "arms": args.arm, "seeds": args.seeds, "overrides": args.overrides,
         "wall_seconds": wall, "warm_start_seconds": warm, "runs": [asdict(run) for run in runs]}, indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
