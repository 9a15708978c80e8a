"""TRL's side of bench/trl_compare.py and bench/gpu_trl.py: GRPO steps with TRL's GRPOTrainer (HF
generate; the CPU, or one GPU), timed.

Runs in TRL's own virtualenv (`make trl` builds .venv-trl) and imports nothing from this project,
so TRL's pins never meet the pipeline's. Usage:

    .venv-trl/bin/python bench/trl_grpo_worker.py SPEC.json

SPEC.json holds: model_dir; prompts (rows of {"messages": [chat messages], "answers": [gold answers]},
in the order the steps should use them: step k takes rows [k*P, (k+1)*P) with P prompts per step);
prompts_per_step, num_generations, max_completion_length, steps, learning_rate, grad_accum, seed,
output_dir; optional threads (torch intra-op threads), lockstep, bf16, use_cpu (default true; false:
the Trainer's device, a GPU where there is one) and report_distributions (the result then names the
installed distributions of every module the process imported, with versions).

Protocol: lines on stdout that start with "TRLW " carry JSON events (other stdout lines are
TRL's/transformers' own prints): {"event": "ready"} once the trainer is built, {"event": "step",
...} after each step, {"event": "result", ...} at the end. With lockstep true the worker reads one
line ("go") from stdin before each step, so the caller can alternate TRL steps with its own
iterations and a change in the machine's load hits both sides alike.

What one step is: TRL generates num_generations completions for each of the step's prompts in one
`generate` call (generation batch = per_device_train_batch_size * grad_accum = P * num_generations),
scores them with the reward below, computes group-normalized advantages, and runs grad_accum
forward/backward micro-batches followed by ONE optimizer step (num_iterations=1, so the sampling
log-probs are not recomputed; beta=0, so no reference model). Sampling: temperature 1, top_p 1,
top_k off. Precision fp32 (fp16 off; bf16 autocast, the Trainer's mixed precision, when the spec's
"bf16" is true), no gradient checkpointing, no logging, no saving.

Timing: a TrainerCallback takes on_step_begin/on_step_end timestamps (one optimizer step each);
`_generate_and_score_completions` (generation + rewards + advantages) and `_generate_single_turn`
(the `generate` call) are wrapped to split a step into generation, scoring and training.

Memory: the result carries the process's peak RSS (`peak_rss_gib`, getrusage's high-water mark;
bench/memory.py compares it, and its own sampling of this process, with the pipeline's) and the
peak when the trainer was built (`rss_gib_after_setup`).

Progress goes to stderr.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import string
import sys
import time

PREFIX = "TRLW "
for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                     "WANDB_DISABLED": "true", "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(_key, _value)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GENERATED_TOKENS: list[int] = []  # completion tokens of each scored generation batch


def log(message: str) -> None:
    print(f"trl-worker: {message}", file=sys.stderr, flush=True)


def emit(event: str, **fields) -> None:
    print(PREFIX + json.dumps({"event": event, **fields}), flush=True)


def _normalize(text: str) -> str:
    """SQuAD-style answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match_reward(completions, answers, completion_ids=None, **_) -> list[float]:
    """1 for an <answer> that matches a gold answer, plus 0.1 for a well-formed <answer> at all
    (the pipeline's qa_em scorer with format_weight 0.1, re-implemented: cheap string work)."""
    if completion_ids is not None:
        _GENERATED_TOKENS.append(sum(len(ids) for ids in completion_ids))
    rewards = []
    for completion, gold in zip(completions, answers):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = _ANSWER.findall(text)
        if not found:
            rewards.append(0.0)
            continue
        em = float(_normalize(found[-1]) in {_normalize(a) for a in gold})
        rewards.append(em + 0.1)
    return rewards


class _Timer:
    """Seconds spent in wrapped calls, one list entry per call."""

    def __init__(self):
        self.calls: dict[str, list[float]] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.setdefault(name, []).append(time.perf_counter() - started)
        return timed


def _build_trainer(spec: dict, timer: _Timer):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.cpu_seconds: list[float] = []  # CPU time of this process (all threads) per step
            self._started = self._cpu_started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if spec.get("lockstep") and sys.stdin.readline().strip() != "go":
                raise SystemExit("trl-worker: lockstep: expected 'go' on stdin")
            self._started, self._cpu_started = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._started)
            self.cpu_seconds.append(time.process_time() - self._cpu_started)
            log(f"step {len(self.seconds)}/{spec['steps']}: {self.seconds[-1]:.2f} s")
            emit("step", step=len(self.seconds) - 1, seconds=self.seconds[-1])

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tokenizer.chat_template is None:
        raise SystemExit(f"trl-worker: {spec['model_dir']} has no chat template; the prompts are chat messages")
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    rows = spec["prompts"]
    dataset = Dataset.from_dict({"prompt": [r["messages"] for r in rows], "answers": [r["answers"] for r in rows]})
    completions_per_step = spec["prompts_per_step"] * spec["num_generations"]
    if completions_per_step % spec["grad_accum"]:
        raise SystemExit(f"trl-worker: grad_accum={spec['grad_accum']} must divide {completions_per_step} completions")
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=completions_per_step // spec["grad_accum"],
        gradient_accumulation_steps=spec["grad_accum"],  # generation batch = the two multiplied = one step's work
        num_generations=spec["num_generations"],
        max_completion_length=spec["max_completion_length"],
        num_iterations=1, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=spec["steps"], shuffle_dataset=False, seed=spec["seed"],
        bf16=bool(spec.get("bf16")), fp16=False, use_cpu=spec.get("use_cpu", True), gradient_checkpointing=False,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
    )
    step_times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[step_times])
    trainer._generate_single_turn = timer.wrap("generate", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timer.wrap("generate_and_score", trainer._generate_and_score_completions)
    return trainer, tokenizer, step_times, config


def _median_after_first(values: list[float]) -> float:
    rest = values[1:] or values
    return statistics.median(rest) if rest else float("nan")


def run(spec: dict) -> dict:
    import torch
    import transformers
    import trl

    started = time.perf_counter()
    timer = _Timer()
    trainer, tokenizer, step_times, config = _build_trainer(spec, timer)
    setup_seconds = time.perf_counter() - started
    rss_after_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    prompt_tokens = [len(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]) for r in spec["prompts"]]
    log(f"TRL {trl.__version__}: {spec['steps']} steps of {spec['prompts_per_step']} prompts x "
        f"{spec['num_generations']} samples x {spec['max_completion_length']} tokens "
        f"(setup {setup_seconds:.1f} s)")
    emit("ready")
    trainer.train()
    steps = step_times.seconds
    scored = timer.calls.get("generate_and_score", [])
    generated = timer.calls.get("generate", [])
    training = [s - g for s, g in zip(steps, scored)]
    return {
        "trl_version": trl.__version__, "transformers_version": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "setup_seconds": setup_seconds, "step_seconds": steps, "step_cpu_seconds": step_times.cpu_seconds,
        "median_step_seconds": _median_after_first(steps), "first_step_seconds": steps[0] if steps else None,
        "generate_seconds": generated, "generate_and_score_seconds": scored,
        "median_generate_seconds": _median_after_first(generated),
        "median_score_seconds": _median_after_first([s - g for s, g in zip(scored, generated)]),
        "median_train_seconds": _median_after_first(training),
        "generated_tokens_per_step": list(_GENERATED_TOKENS),
        "prompt_tokens": prompt_tokens,
        # the kernel's high-water mark of this process's resident memory (KiB on Linux), exact, not sampled
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "rss_gib_after_setup": rss_after_setup,
        "batch": {"per_device_train_batch_size": config.per_device_train_batch_size,
                  "gradient_accumulation_steps": config.gradient_accumulation_steps,
                  "generation_batch_size": config.generation_batch_size,
                  "steps_per_generation": config.steps_per_generation, "num_generations": config.num_generations,
                  "loss_type": config.loss_type, "optimizer": str(config.optim)},
    }


def distributions() -> dict[str, str]:
    """name -> version of the installed distribution behind each module this process imported."""
    from importlib import metadata

    owners = metadata.packages_distributions()
    found = {}
    for top in {name.split(".")[0] for name in list(sys.modules)}:
        for dist in owners.get(top, ()):
            try:
                found[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    return dict(sorted(found.items(), key=lambda item: item[0].lower()))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as handle:
        spec = json.load(handle)
    result = run(spec)
    if spec.get("report_distributions"):
        result["distributions"] = distributions()
    emit("result", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
