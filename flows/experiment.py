"""The experiment flow: the structure of Agent-R1's Tables 3 and 4 in one command (docs/architecture.md §1).

1. base run: dataset -> initial policy -> warm start (scripted oracle episodes, supervised fine-tuning);
2. one training run per arm (algorithm or mask ablation), each starting from the warm-started policy;
3. evaluation of Naive RAG and Base Tool Call (the warm-started policy) and of every arm's last
   checkpoint on the held-out split, several seeds each;
4. the report: results page with the table and the targets, PNG plots, an MLflow run.

See agent_core/eval/experiment.py for where this differs from the paper.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from prefect import flow

from agent_core.config import DevEvalConfig
from agent_core.eval.experiment import ArmCurve, ExperimentConfig
from agent_core.io.layout import DataRoot, new_run_id
from agent_core.io.summaries import eval_scores
from agent_core.validation import load_config
from flows.eval import evaluate_methods
from flows.train import TrainResult, start_policy, train
from tasks.evaluate import dev_eval, run_eval_settings
from tasks.experiment_report import experiment_report


@dataclass(frozen=True)
class ExperimentResult:
    experiment_id: str
    report_path: str
    eval_markdown: str
    wall_seconds: float


def _curve(result: TrainResult, seconds: float) -> ArmCurve:
    dev = [(0, result.start_dev_em)] + [(s.iteration + 1, s.dev_em) for s in result.iterations]
    return ArmCurve(dev_em=[(x, y) for x, y in dev if y == y],  # drop NaN: iterations not evaluated
                    reward=[(s.iteration, s.mean_reward) for s in result.iterations], seconds=seconds)


def _setup(base, exp: ExperimentConfig, warm_policy: str) -> list[str]:
    ws = base.warm_start
    where = Path(warm_policy).resolve().relative_to(Path(base.data_root).resolve())
    return [
        f"policy: tiny Llama from scratch ({base.policy.num_layers} layers x {base.policy.hidden_size} hidden, "
        f"BPE vocab {base.policy.vocab_size}), {base.policy.pretrain_steps} steps of induction pretraining; warm "
        f"start on {ws.prompts} scripted tool episodes ({ws.lazy_fraction:.0%} of them lazy: one search, then the "
        f"bridge entity as the answer) + {ws.rag_prompts} naive_rag-format answers (training prompts; {ws.epochs} "
        f"epochs, lr {ws.lr}, loss on {ws.loss_on} tokens) -> `<data root>/{where}`; Naive RAG and Base Tool Call "
        f"are this policy",
        f"data: built-in synthetic multi-hop QA (seed {base.data.seed}, {base.data.num_films} films, "
        f"{base.data.num_people} people, names from pools of {base.data.name_pool}; 3-hop "
        f"{base.data.three_hop_fraction}, comparison {base.data.comparison_fraction}), search top_k {base.data.top_k}",
        f"RL per arm: {base.iterations} iterations x {base.data.prompts_per_iteration} prompts x "
        f"{base.rollout.group_size} samples, max {base.rollout.max_steps} steps, lr {base.trainer.lr}, "
        f"{base.trainer.mini_batches} updates per iteration",
        f"evaluation: {exp.eval_split} split, {'greedy' if exp.eval_greedy else f'sampled (T={base.rollout.temperature})'}, "
        f"seeds 0..{exp.eval_seeds - 1}" + (f", first {exp.eval_limit} prompts" if exp.eval_limit else ""),
    ]


@flow(name="agentr1-experiment", log_prints=True)
def experiment(exp: ExperimentConfig, config_dir: str, data_root: str, command: str,
               overrides: list[str] | None = None) -> ExperimentResult:
    """Run the experiment `exp` (config paths relative to `config_dir`); `overrides` apply to every run."""
    started = time.perf_counter()
    experiment_id = new_run_id(exp.name)
    common = [*exp.base_overrides, *(overrides or []), f"data_root={data_root}"]
    base_files = [Path(config_dir) / name for name in exp.base_configs]

    base = load_config(base_files, [*common, "warm_start.enabled=true", f"run_id={experiment_id}-base"])
    base_run = DataRoot(Path(data_root)).run(base.run_id)
    dataset, warm_policy = start_policy(base_run, base)
    # What the warm start memorised vs what generalises: its greedy EM on training prompts
    on_train = DevEvalConfig(split="train", prompts=base.dev_eval.prompts)
    train_em, _ = eval_scores(dev_eval(base_run, None, warm_policy, dataset, on_train,
                                       run_eval_settings(base, greedy=True)))

    curves = {}
    checkpoints = {"naive_rag": warm_policy, "base_tool_call": warm_policy}
    for arm in exp.arms:
        arm_started = time.perf_counter()
        config = load_config(
            [*base_files, *(Path(config_dir) / name for name in arm.configs)],
            [*common, *arm.overrides, "warm_start.enabled=false", "policy.source=path", f"policy.path={warm_policy}",
             f"run_id={experiment_id}-{arm.name}"],
        )
        print(f"agentr1 experiment: arm {arm.title} ({config.algorithm.estimator}), run {config.run_id}")
        result = train(config)
        curves[arm.name] = _curve(result, time.perf_counter() - arm_started)
        checkpoints[arm.name] = result.final_checkpoint

    evaluation = evaluate_methods(
        data_root, checkpoints, list(checkpoints), dataset=dataset, split=exp.eval_split,
        seeds=list(range(exp.eval_seeds)), settings=run_eval_settings(base, greedy=exp.eval_greedy),
        limit=exp.eval_limit, eval_id=f"{experiment_id}-eval", method_of={arm.name: "agent" for arm in exp.arms},
    )
    wall = time.perf_counter() - started
    setup = [*_setup(base, exp, warm_policy),
             f"warm-started policy, greedy EM on the first {on_train.prompts} training prompts: {train_em:.3f} "
             f"(on the dev prompts: the iteration-0 points of the dev EM plot)"]
    notes = str(Path(config_dir) / exp.notes_path) if exp.notes_path else None
    page = experiment_report(exp, data_root, experiment_id, evaluation.table_uris, curves, command, wall, setup, notes)
    return ExperimentResult(experiment_id, page, evaluation.markdown, wall)
