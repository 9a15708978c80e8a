"""TRL's side of bench/trl_compare.py (and of bench/memory.py's peak against TRL): the work both
sides do (`Setting`), and bench/trl_grpo_worker.py run in .venv-trl (`make trl`): its spec, command
line and event lines, and `TrlWorker`, which steps it over a pipe in lockstep with the pipeline."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
WORKER = Path(__file__).resolve().with_name("trl_grpo_worker.py")


@dataclass(frozen=True)
class Setting:
    """One iteration's work, the same on both sides."""

    prompts: int = 16
    group_size: int = 4
    max_new_tokens: int = 64
    iterations: int = 3
    lr: float = 1e-6  # small, so the policy (and its completion lengths) barely move between iterations
    trl_grad_accum: int = 4  # TRL micro-batches per optimizer step (ours: trainer.micro_batch_tokens)
    micro_batch_tokens: int | None = None  # trainer.micro_batch_tokens (None: the pipeline's default)
    activation_checkpointing: bool = False  # ours only (bench/memory.py's variant)
    precision: str = "fp32"  # bf16: our trainer.precision and vLLM dtype; TRL's bf16 (autocast) mixed precision
    seed: int = 0
    threads: int | None = None  # torch intra-op threads on both sides (None: torch's default)



# ---- TRL --------------------------------------------------------------------------------------------

TRL_PREFIX = "TRLW "  # the worker's event lines on stdout (bench/trl_grpo_worker.py)


def trl_spec(model_dir: Path, rows: list[dict], setting: Setting, workdir: Path, lockstep: bool) -> Path:
    """The worker's SPEC.json (its module docstring) for `setting`, written into `workdir`."""
    if not TRL_PYTHON.is_file():
        raise FileNotFoundError(f"{TRL_PYTHON} not found: run `make trl` first (TRL in its own virtualenv)")
    spec = {"model_dir": str(model_dir), "prompts": rows, "prompts_per_step": setting.prompts,
            "num_generations": setting.group_size, "max_completion_length": setting.max_new_tokens,
            "steps": setting.iterations, "learning_rate": setting.lr, "grad_accum": setting.trl_grad_accum,
            "seed": setting.seed, "output_dir": str(workdir / "trl_output"), "threads": setting.threads,
            "lockstep": lockstep, "bf16": setting.precision == "bf16"}
    path = workdir / "trl_spec.json"
    path.write_text(json.dumps(spec))
    return path


def trl_command(spec_path: Path) -> tuple[list[str], dict]:
    """(argv, environment) that run the worker: .venv-trl's Python, nothing of this project on its path."""
    return [str(TRL_PYTHON), str(WORKER), str(spec_path)], {**os.environ, "PYTHONPATH": ""}


def trl_events(lines) -> dict[str, dict]:
    """The worker's last event of each kind from its stdout lines."""
    events = {}
    for line in lines:
        if line.startswith(TRL_PREFIX):
            message = json.loads(line[len(TRL_PREFIX):])
            events[message["event"]] = message
    return events


class TrlWorker:
    """bench/trl_grpo_worker.py in .venv-trl, stepped over a pipe (its module docstring: protocol)."""

    def __init__(self, model_dir: Path, rows: list[dict], setting: Setting, workdir: Path):
        self.steps = setting.iterations
        command, env = trl_command(trl_spec(model_dir, rows, setting, workdir, lockstep=True))
        print(f"bench: starting the TRL worker ({TRL_PYTHON.relative_to(REPO)})", flush=True)
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                        env=env, cwd=workdir)
        self.result: dict | None = None

    def _next(self, event: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(TRL_PREFIX):
                message = json.loads(line[len(TRL_PREFIX):])
                if message["event"] == event:
                    return message
        raise RuntimeError(f"the TRL worker exited (status {self.process.wait()}) before '{event}'; "
                           "its stderr is above")

    def step(self, k: int) -> None:
        """Run TRL's step k and wait for it (and, after the last one, for the worker's result)."""
        if k == 0:
            self._next("ready")
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        self._next("step")
        if k == self.steps - 1:
            self.result = self._next("result")
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
