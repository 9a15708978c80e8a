"""The paper's experiment at CPU scale (Agent-R1, Tables 3 and 4): its definition, the targets it is
checked against, and the results page. Pure: the flow (flows/experiment.py) runs it, a task writes
the page and the plots.

Where it differs from the paper: one small policy warm-started on scripted episodes stands in for
Qwen2.5-3B-Instruct, so "Base Tool Call" and "Naive RAG" are that warm-started policy with tools /
with one retrieval (the paper's instruct model already knew how to answer); the benchmark is the
built-in synthetic multi-hop task (held-out test split whose key people no training question
uses), not HotpotQA / 2Wiki / MuSiQue; and the "algorithms beat Base Tool Call" target compares
means over evaluation seeds of one training run per arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from agent_core.config import Section
from agent_core.safe_yaml import load_yaml

BASELINES = ("naive_rag", "base_tool_call")
BASELINE_TITLES = {"naive_rag": "Naive RAG", "base_tool_call": "Base Tool Call"}


class ArmConfig(Section):
    """One trained arm: pipeline config files layered on the experiment's base (paths relative to
    the experiment file), e.g. an algorithm or a mask ablation."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="id in tables and run ids, e.g. grpo")
    title: str = Field(description="shown in the table and plots, e.g. GRPO")
    configs: list[str] = Field(default_factory=list)
    overrides: list[str] = Field(default_factory=list, description="key=value, applied last")
    ablation_of: str | None = Field(None, description="the arm this one ablates: expected to score below it")


class ExperimentConfig(Section):
    name: str = Field("paper-cpu", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    base_configs: list[str] = Field(description="pipeline configs shared by every arm (relative to this file)")
    base_overrides: list[str] = Field(default_factory=list)
    arms: list[ArmConfig]
    eval_split: Literal["dev", "test"] = "test"
    eval_seeds: int = Field(3, ge=1)
    eval_greedy: bool = Field(False, description="greedy decoding gives every seed the same answers")
    eval_limit: int | None = Field(None, ge=1)
    rag_ratio_target: float = Field(2.5, gt=0, description="best RL EM / Naive RAG EM the paper reaches")
    report_path: str = Field("docs/results.md", description="results page (relative to the working directory)")
    plots_dir: str = Field("docs/results", description="its PNG plots")
    notes_path: str | None = Field(None, description="markdown appended to the page (relative to the experiment "
                                   "file): the hand-written analysis of the last run, kept across reruns")

    @model_validator(mode="after")
    def _arms_are_consistent(self) -> "ExperimentConfig":
        names = [arm.name for arm in self.arms]
        if not names or len(set(names)) != len(names) or set(names) & set(BASELINES):
            raise ValueError(f"arms need distinct names other than {', '.join(BASELINES)}; got {names}")
        for arm in self.arms:
            if arm.ablation_of is not None and arm.ablation_of not in names:
                raise ValueError(f"arm {arm.name!r}: ablation_of {arm.ablation_of!r} is not an arm ({', '.join(names)})")
        return self

    def algorithm_arms(self) -> list[ArmConfig]:
        return [arm for arm in self.arms if arm.ablation_of is None]


def load_experiment(path: str | Path) -> tuple[ExperimentConfig, Path]:
    """The experiment file and the directory its config paths are relative to."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment file not found: {path}")
    try:
        return ExperimentConfig.model_validate(load_yaml(path.read_text(), str(path)) or {}), path.parent
    except ValidationError as error:
        raise ValueError(f"{path}: {error}") from None


@dataclass(frozen=True)
class ArmCurve:
    """One arm's training: held-out dev EM at the start (x=0) and after each iteration (x=k+1), and
    the mean episode reward of iteration k's rollouts (x=k)."""

    dev_em: list[tuple[int, float]]
    reward: list[tuple[int, float]]
    seconds: float


@dataclass(frozen=True)
class MethodEm:
    """A method's (or arm's) EM on the evaluation split: mean and std over the evaluation seeds."""

    mean: float
    std: float


@dataclass(frozen=True)
class TargetCheck:
    target: str
    met: bool
    detail: str


def _separated(higher: MethodEm, lower: MethodEm) -> bool:
    """higher beats lower by more than the seed noise: the larger of the two stds."""
    return higher.mean - lower.mean > max(higher.std, lower.std)


def target_checks(exp: ExperimentConfig, em: dict[str, MethodEm]) -> list[TargetCheck]:
    """The issue's targets, each with the numbers that decide it. "Above" means by more than one seed
    std (the larger of the two compared), so a difference inside the seed noise never counts."""
    rag, base = em["naive_rag"].mean, em["base_tool_call"]
    best = max(exp.algorithm_arms(), key=lambda arm: em[arm.name].mean)
    ratio = em[best.name].mean / rag if rag > 0 else math.inf
    checks = [TargetCheck(
        f"best RL agent >= {exp.rag_ratio_target}x Naive RAG EM", ratio >= exp.rag_ratio_target,
        f"{best.title} {em[best.name].mean:.3f} vs Naive RAG {rag:.3f}: {ratio:.2f}x",
    )]
    losers = [arm.title for arm in exp.algorithm_arms() if not _separated(em[arm.name], base)]
    checks.append(TargetCheck(
        "every RL algorithm above Base Tool Call by more than one seed std", not losers,
        ", ".join(f"{arm.title} {em[arm.name].mean:.3f} ± {em[arm.name].std:.3f}" for arm in exp.algorithm_arms())
        + f" vs Base Tool Call {base.mean:.3f} ± {base.std:.3f}" + (f"; not: {', '.join(losers)}" if losers else ""),
    ))
    titles = {arm.name: arm.title for arm in exp.arms}
    for arm in exp.arms:
        if arm.ablation_of is not None:
            full, ablated = em[arm.ablation_of], em[arm.name]
            checks.append(TargetCheck(
                f"{arm.title} below {titles[arm.ablation_of]} by more than one seed std", _separated(full, ablated),
                f"{ablated.mean:.3f} ± {ablated.std:.3f} vs {full.mean:.3f} ± {full.std:.3f}",
            ))
    return checks


def results_markdown(exp: ExperimentConfig, *, command: str, wall_seconds: float, eval_table: str,
                     checks: list[TargetCheck], curves: dict[str, ArmCurve], plots: dict[str, str],
                     setup: list[str], notes: str = "") -> str:
    """The results page: command, wall time, setup, the measured table, the targets, the plots, then
    `notes` (hand-written analysis kept beside the experiment file, so a rerun keeps it)."""
    lines = [
        "# Results: the Agent-R1 experiment at CPU scale", "",
        "Generated by the experiment command below; every number on this page was measured by it "
        "(nothing was tuned on the test split).", "",
        "```", command, "```", "",
        f"Wall time: {wall_seconds / 60:.1f} min in total on this machine "
        f"({', '.join(f'{exp_arm.title} {curves[exp_arm.name].seconds:.0f}s' for exp_arm in exp.arms)}).", "",
        "## Setup", "", *[f"- {item}" for item in setup], "",
        f"## {exp.eval_split.capitalize()} split: EM and F1, mean ± std over {exp.eval_seeds} seeds", "",
        eval_table.strip(), "",
        "## Targets", "",
        "| Target | Met | Numbers |", "| --- | --- | --- |",
        *[f"| {c.target} | {'yes' if c.met else '**no**'} | {c.detail} |" for c in checks], "",
        "## Plots", "",
        *[f"![{title}]({path})" for title, path in plots.items()], "",
    ]
    if notes.strip():
        lines += [notes.strip(), ""]
    return "\n".join(lines)
