"""bench/gpu.py's row `trl_vs_ours` (issue 38): TRL's GRPOTrainer and this library on the same card.

The work of bench/trl_compare.py, single turn: P prompts x G samples x up to T new tokens (bench/gpu.py's
--prompts, --group-size, --new-tokens: 64 x 4 x 64 on a GPU, 2 x 2 x 8 with --quick) of the built-in
task, rewarded (exact match of an <answer>), group-normalized advantages, no KL (no reference model),
ONE optimizer step over all P*G completions; temperature 1, top_p 1, lr 1e-6, clip 0.2, grad norm 1.
Both sides start from the same shaped model (bench/gpu_workload.py, saved to a temporary folder for TRL):

- ours: the library called directly (no Prefect, Parquet or MLflow; bench/gpu_iteration.py's stages):
  rollout (HFEngine on the trainer's fp32 module, max_steps 1, one engine batch of P*G), labelling,
  GRPO advantages, `train_iteration` (precision auto: bf16 autocast on CUDA; micro-batches the
  library picks), one AdamW kept across iterations;
- TRL: bench/trl_grpo_worker.py in TRL's own interpreter (plain `generate`, no vLLM), the same
  prompts as chat messages, bf16=True on CUDA (fp32 weights, autocast), micro-batches of up to 32
  completions accumulated into one step.

Iterations: 1 + --updates each (the first is warm-up; the median of the rest). On the CPU the sides
alternate (TRL step k, then our iteration k: a shared machine's load hits both); on a GPU TRL runs
first and exits, then ours, so two processes never hold the card's memory at once.

TRL's interpreter: $TRL_PYTHON; else, with $TRL_SITE (a folder TRL's wheels were installed into with
`pip install --target`), this Python with only that folder on PYTHONPATH; else .venv-trl (`make trl`).
Where none is found or TRL does not import, the row is skipped with the reason.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from agent_core.algos.step_advantages import StepRewardRow, estimate_step_advantages, prepare_episodes
from agent_core.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from agent_core.envs.registry import make_env
from agent_core.episodes import episodes_from_rows
from agent_core.rollout.spec import env_for, env_resources
from agent_core.training.batches import TrainStep, choose_layout
from agent_core.training.precision import resolve_precision
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import make_optimizer, train_iteration
from bench.common import Goal, Measurement, skipped_measurement
from bench.gpu_iteration import StageClock, estimator_settings, free_memory, rewards_of, rollout
from bench.gpu_workload import shaped_model
from bench.trl_side import REPO, TRL_PREFIX, TRL_PYTHON, WORKER

KEY = "trl_vs_ours"
GOAL = Goal("TRL GRPOTrainer seconds per single-turn iteration / ours, same card", ">=", 3)
LR = 1e-6  # as bench/trl_compare.py: the policy (and its completion lengths) barely move
TRL_MICRO_BATCH = 32  # completions per TRL forward/backward


@dataclass(frozen=True)
class TrlPython:
    """How to start TRL's interpreter: argv[0], its PYTHONPATH, and where it came from (no machine path)."""

    python: Path
    pythonpath: str
    source: str


def trl_python() -> TrlPython | str:
    """TRL's interpreter (module docstring), or why there is none."""
    site, python = os.environ.get("TRL_SITE"), os.environ.get("TRL_PYTHON")
    if site and not Path(site).is_dir():
        return f"TRL_SITE is not a folder: {site}"
    if python:
        found = TrlPython(Path(python), site or "", "$TRL_PYTHON" + (" with $TRL_SITE" if site else ""))
    elif site:
        found = TrlPython(Path(sys.executable), site, "this Python with $TRL_SITE")
    else:
        found = TrlPython(TRL_PYTHON, "", str(TRL_PYTHON.relative_to(REPO).parent.parent))
    if not found.python.is_file():
        return (f"TRL's interpreter not found ({found.source}: {found.python}); set TRL_SITE or TRL_PYTHON, "
                "or `make trl`")
    return found


def trl_grad_accum(completions: int) -> int:
    """Micro-batches per TRL step: completions split into parts of at most TRL_MICRO_BATCH."""
    return completions // math.gcd(completions, TRL_MICRO_BATCH) if completions > TRL_MICRO_BATCH else 1


def chat_rows(task, tokenizer, cfg: RolloutConfig, prompts: int) -> list[dict]:
    """The first `prompts` prompts as the messages our rollout's env opens with, and their answers."""
    resources = env_resources(tokenizer, task.documents)
    rows = []
    for prompt in task.prompts[:prompts]:
        env = make_env(*env_for(prompt, cfg), resources)
        if getattr(env, "tools_for_template", None):
            raise RuntimeError("the env passes tools to the chat template; the TRL worker renders messages only")
        rows.append({"messages": [m.as_dict() for m in env.reset(prompt)], "answers": list(prompt.answers)})
    return rows


class TrlRun:
    """bench/trl_grpo_worker.py stepped in lockstep over a pipe; its stderr kept in a file."""

    def __init__(self, side: TrlPython, spec: dict, workdir: Path):
        self.steps = spec["steps"]
        (workdir / "trl_spec.json").write_text(json.dumps(spec))
        self.stderr_path = workdir / "trl_stderr.txt"
        env = {**os.environ, "PYTHONPATH": side.pythonpath}
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # bench/trl_compare.py: spinning threads on a shared CPU
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen([str(side.python), str(WORKER), str(workdir / "trl_spec.json")],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                            bufsize=1, env=env, cwd=workdir)
        self.result: dict | None = None

    def stderr_tail(self, lines: int = 1) -> str:
        text = [line for line in self.stderr_path.read_text().splitlines() if line.strip()]
        return "\n".join(text[-lines:])

    def next(self, event: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(TRL_PREFIX) and json.loads(line[len(TRL_PREFIX):])["event"] == event:
                return json.loads(line[len(TRL_PREFIX):])
        raise RuntimeError(f"TRL's worker exited (status {self.process.wait()}) before '{event}': "
                           f"{self.stderr_tail()}")

    def step(self, k: int) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        self.next("step")
        if k == self.steps - 1:
            self.result = self.next("result")
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def grpo_steps(records, rewards, algorithm: AlgorithmConfig) -> list[TrainStep]:
    """GRPO advantages of every step, no reference log-probs (kl_coef 0: the advantages stage skips them)."""
    batch = prepare_episodes([StepRewardRow(r.episode_id, r.group_id, r.step_idx, r.prompt_ids, r.response_ids,
                                            rewards[r.episode_id, r.step_idx]) for r in records])
    estimated = estimate_step_advantages(batch, **estimator_settings(algorithm))
    advantages = {(a.episode_id, a.step_idx): a.advantages for a in estimated}
    return [TrainStep(r.prompt_ids, r.response_ids, r.response_logprobs, advantages[r.episode_id, r.step_idx],
                      episode_id=r.episode_id, group_id=r.group_id, step_idx=r.step_idx) for r in records]


class OurSide:
    """Our single-turn GRPO iteration on `model`, one optimizer kept across iterations (as TRL's)."""

    def __init__(self, model, tokenizer, task, cfg: RolloutConfig, prompts: int, seed: int):
        self.model, self.tokenizer, self.task, self.cfg = model, tokenizer, task, cfg
        self.prompts, self.seed = prompts, seed
        self.trainer = TrainerConfig(lr=LR, epochs=1, mini_batches=1, lr_schedule="constant", clip_low=0.2,
                                     clip_high=0.2, max_grad_norm=1.0, loss_agg_mode="token-mean", weight_decay=0.0)
        self.algorithm = AlgorithmConfig(estimator="grpo", kl_coef=0.0)
        self.settings = PPOSettings.from_config(self.trainer, self.algorithm, cfg.temperature)
        self.optimizer = make_optimizer(model, lr=LR, weight_decay=0.0)
        self.iterations: list[dict] = []

    def iteration(self, k: int) -> None:
        device = next(self.model.parameters()).device
        clock = StageClock(device)
        started = time.perf_counter()
        with clock.stage("rollout"):
            records = rollout(self.model, self.tokenizer, self.task, self.cfg, self.prompts, self.seed + k)
        with clock.stage("labelling"):
            rewards = rewards_of(records, self.task)
        with clock.stage("advantages"):
            steps = grpo_steps(records, rewards, self.algorithm)
        with clock.stage("training"):
            sequences = choose_layout([list(e.steps) for e in episodes_from_rows(steps)], self.trainer.layout)
            results = train_iteration(self.model, self.optimizer, sequences, self.settings,
                                      pad_id=self.tokenizer.pad_token_id, seed=self.seed + k)
        self.iterations.append({
            "seconds": time.perf_counter() - started, "stage_seconds": clock.seconds,
            "peak_gib": max((v for v in clock.peak_gib.values() if v is not None), default=None),
            "generated_tokens": sum(len(r.response_ids) for r in records),
            "train_tokens": sum(len(s) for s in sequences), "updates": len(results),
            "precision": resolve_precision(self.settings.precision, device),
            "prompt_tokens": [len(r.prompt_ids) for r in records if r.sample_idx == 0]})


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


def run_sides(model, tokenizer, task, cfg: RolloutConfig, args, trl: TrlRun, iterations: int, device,
              progress) -> list[dict]:
    """TRL step k then our iteration k (the CPU), or all TRL steps, then ours (a GPU: the model moves to
    the card once TRL's process has exited); our iterations' numbers (the optimizer is freed here)."""
    alternate = device.type == "cpu"
    progress(f"{KEY}: TRL's trainer is built; {iterations} iterations each, " + ("alternating" if alternate else
                                                                                 "TRL's first"))
    ours = OurSide(model.to(device), tokenizer, task, cfg, args.prompts, args.seed) if alternate else None
    for k in range(iterations):
        trl.step(k)
        if alternate:
            ours.iteration(k)
    if ours is None:
        ours = OurSide(model.to(device), tokenizer, task, cfg, args.prompts, args.seed)
        for k in range(iterations):
            ours.iteration(k)
    return ours.iterations


def trl_spec(rows: list[dict], model_dir: Path, workdir: Path, prompts: int, group_size: int, new_tokens: int,
             iterations: int, seed: int, device: torch.device) -> dict:
    """bench/trl_grpo_worker.py's SPEC for the same work: the P rows again for every step."""
    return {"model_dir": str(model_dir), "prompts": rows * iterations, "prompts_per_step": prompts,
            "num_generations": group_size, "max_completion_length": new_tokens, "steps": iterations,
            "learning_rate": LR, "grad_accum": trl_grad_accum(prompts * group_size), "seed": seed,
            "output_dir": str(workdir / "trl_output"), "lockstep": True, "report_distributions": True,
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "bf16": device.type == "cuda", "use_cpu": device.type == "cpu"}


def trl_row(shape, tokenizer, task, args, device, progress) -> Measurement:
    """Both sides on `shape` (random weights, saved for TRL), iterations = 1 + args.updates each."""
    side = trl_python()
    if isinstance(side, str):
        return skipped_measurement(KEY, GOAL, side)
    iterations = 1 + max(1, args.updates)
    cfg = RolloutConfig(group_size=args.group_size, max_steps=1, max_new_tokens=args.new_tokens, temperature=1.0,
                        top_p=1.0, max_context_tokens=args.context, max_batch_size=args.prompts * args.group_size)
    rows = chat_rows(task, tokenizer, cfg, args.prompts)
    with tempfile.TemporaryDirectory(prefix="agentr1-gpu-trl-") as folder:
        workdir = Path(folder)
        model = shaped_model(shape, tokenizer, torch.device("cpu"), args.seed)  # on the card after TRL, on a GPU
        model.save_pretrained(workdir / "model")
        tokenizer.save_pretrained(workdir / "model")
        spec = trl_spec(rows, workdir / "model", workdir, args.prompts, args.group_size, args.new_tokens, iterations,
                        args.seed, device)
        trl = TrlRun(side, spec, workdir)
        try:
            try:
                trl.next("ready")
            except RuntimeError:
                if trl.stderr_tail().startswith(("ModuleNotFoundError", "ImportError")):
                    return skipped_measurement(KEY, GOAL, f"TRL does not import ({side.source}): {trl.stderr_tail()}")
                raise
            ours = run_sides(model, tokenizer, task, cfg, args, trl, iterations, device, progress)
        except (RuntimeError, torch.OutOfMemoryError) as error:
            message = " ".join(str(error).split())[:400]
            progress(f"{KEY}: {message}")
            return Measurement(KEY, math.nan, GOAL, {"error": message}, why_missed=message)
        finally:
            trl.stop()
            del model
            free_memory(device)
    return measurement(ours, trl.result, side, spec, device)


def measurement(ours: list[dict], trl: dict, side: TrlPython, spec: dict, device) -> Measurement:
    """The ratio, both sides' seconds, tokens and split, the settings and the versions."""
    mine = median_after_first([it["seconds"] for it in ours])
    theirs = trl["median_step_seconds"]
    trl_prompt_tokens = trl["prompt_tokens"][:spec["prompts_per_step"]]
    details = {
        "trl_seconds_per_iteration": theirs, "our_seconds_per_iteration": mine,
        "settings": {"prompts": spec["prompts_per_step"], "group_size": spec["num_generations"],
                     "max_new_tokens": spec["max_completion_length"], "iterations": spec["steps"], "lr": LR,
                     "temperature": 1.0, "top_p": 1.0, "kl_coef": 0.0, "optimizer_steps_per_iteration": 1,
                     "trl_grad_accum": spec["grad_accum"], "trl_bf16": spec["bf16"], "device": device.type,
                     "order": "alternating" if device.type == "cpu" else "TRL's first",
                     "our_precision": ours[0].get("precision")},
        "prompt_tokens_match": ours[0]["prompt_tokens"] == trl_prompt_tokens,
        "prompt_tokens_total": {"ours": sum(ours[0]["prompt_tokens"]), "trl": sum(trl_prompt_tokens)},
        "ours": {"iteration_seconds": [round(it["seconds"], 3) for it in ours],
                 "stage_seconds": [it["stage_seconds"] for it in ours],
                 "generated_tokens": [it["generated_tokens"] for it in ours],
                 "train_tokens": [it["train_tokens"] for it in ours], "peak_gib": [it["peak_gib"] for it in ours],
                 "torch": torch.__version__, "transformers": transformers.__version__},
        "trl": {k: v for k, v in trl.items() if k not in ("event", "prompt_tokens", "omp_wait_policy")},
        "trl_python": side.source,
    }
    m = Measurement(KEY, theirs / mine if mine > 0 else math.nan, GOAL, details)
    if math.isfinite(m.ratio) and not GOAL.met(m.ratio):
        m.why_missed = why_missed(details)
    return m


def why_missed(details: dict) -> str:
    """Each side's parts, and the seconds per iteration the goal leaves ours."""
    trl, ours = details["trl"], details["ours"]
    timed = ours["stage_seconds"][1:] or ours["stage_seconds"]
    stages = {name: round(statistics.median(s[name] for s in timed), 3) for name in timed[0]}
    return (f"TRL {details['trl_seconds_per_iteration']:.2f} s per step "
            f"(generate {trl['median_generate_seconds']:.2f}, "
            f"scoring {trl['median_score_seconds']:.2f}, training {trl['median_train_seconds']:.2f}); ours "
            f"{details['our_seconds_per_iteration']:.2f} s (stages {stages}); {GOAL.value:g}x needs ours <= "
            f"{details['trl_seconds_per_iteration'] / GOAL.value:.2f} s.")


def words(m: Measurement) -> str:
    """The row in bench/gpu.py's goals table (a finite ratio)."""
    return (f"{m.ratio:.2f} (TRL {m.details['trl_seconds_per_iteration']:.2f} s / ours "
            f"{m.details['our_seconds_per_iteration']:.2f} s per iteration)")
