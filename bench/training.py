"""Training throughput: the project's trainer vs a hand-written torch loop, and packed vs step rows.

Workload: synthetic append-only agent episodes of exactly --steps steps (a prompt, then per step a
response and an observation, lengths as in the demo's rollouts), trained with PPO-clip by one
optimizer step per update over all rows (gradient accumulation in micro-batches of
--micro-batch-tokens padded tokens, the trainer's default), on the demo's tiny policy.

Two ratios, each from arms timed in alternation within this run (update 1 of every arm, then
update 2 of every arm, ...), so a slowdown of the machine hits all arms alike; each arm's time is
its median update (--updates, default 3):

- ``trainer`` = trainer tokens/s / raw loop tokens/s (goal >= 0.9). Trainer: `train_iteration`
  (agent_core/training/trainer.py) on the packed rows, as `tasks/train.py` calls it (one epoch,
  one mini-batch). Raw loop: the same model class and initial weights, the SAME micro-batches
  (built once, before timing), and the least a PPO step needs: logits -> log_softmax -> gather ->
  clipped ratio loss over action tokens -> backward; after the last micro-batch, grad-norm
  clipping and an AdamW step. Tokens = real (non-padding) tokens of the rows per update, the same
  for both. Whatever the trainer does beyond that (building padded tensors from lists, masks,
  loss normalizers, entropy and KL metrics, float() syncs) is its overhead.
- ``packed_vs_step`` = wall time of the trainer on the step-row layout / on the packed layout,
  same episodes, same number of optimizer steps (goal >= 2). Step rows re-encode each step's
  whole context (T rows of growing length per episode, O(T^2) tokens); packed = one row.

Each arm gets one untimed warm-up update first (allocator, kernels, AdamW state).

The trainer runs the LM head only at the loss-mask positions (agent_core/training/scoring.py), the
raw loop at every position, as a plain PyTorch loop would: on a large vocabulary (SmolLM2's 49k,
`--model-dir`, measured after the tiny policy's arms with --model-episodes episodes and
--model-updates timed updates; both arms then use the trainer's micro-batches, capped by tokens x vocabulary) this is
where the trainer gains most. After the timed updates one more trainer
update and one raw update run under torch.profiler; the ops where the trainer spends more self
CPU time than the raw loop are in the details (`profile`), and a missed goal names them.

    .venv/bin/python -m bench.training [--quick] [--model-dir data/models/smollm2-135m-instruct]
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from agent_core.training.batches import PaddedBatch, TrainSequence, choose_layout, make_micro_batches
from agent_core.training.scoring import model_vocab_size, vocab_capped_tokens
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import make_optimizer, train_iteration
from bench.common import Goal, Measurement, Progress, base_parser, parse_args, write_result
from bench.workload import POLICY_SIZES, append_only_episodes, fresh_copy, synthetic_task, tiny_policy

NAME = "training"
TITLE = "Training: trainer vs raw torch loop, packed episodes vs step rows"
TRAINER_GOAL = Goal("trainer tokens/s / raw torch loop tokens/s (same micro-batches)", ">=", 0.9)
PACKING_GOAL = Goal("wall time on step rows / wall time on packed episodes (same episodes)", ">=", 2.0)
LR, CLIP, MAX_GRAD_NORM = 3e-4, 0.2, 1.0


@dataclass(frozen=True)
class Sizes:
    episodes: int
    steps: int
    prompt_len: int
    response_len: int
    obs_len: int
    updates: int
    micro_batch_tokens: int
    policy: str


QUICK = dict(episodes=4, prompt_len=24, response_len=8, obs_len=8, updates=1, policy="quick")


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--episodes", type=int, default=32, help="episodes per update")
    parser.add_argument("--steps", type=int, default=4, help="steps per episode (all episodes have exactly this many)")
    parser.add_argument("--prompt-len", type=int, default=224, help="tokens of the opening prompt (max; min is half)")
    parser.add_argument("--response-len", type=int, default=48, help="tokens per action (max; min is half)")
    parser.add_argument("--obs-len", type=int, default=88, help="tokens per observation (max; min is half)")
    parser.add_argument("--updates", type=int, default=3, help="timed optimizer steps per arm (the median is used)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="padded tokens per micro-batch")
    parser.add_argument("--policy", choices=sorted(POLICY_SIZES), default="demo", help="policy size")
    parser.add_argument("--model-dir", default=None,
                        help="also measure trainer vs raw loop on this checkpoint (e.g. SmolLM2's, `make smollm2`; "
                        "key trainer-<first word of the dir name>), after the --policy arms")
    parser.add_argument("--model-episodes", type=int, default=8, help="--model-dir: episodes per update")
    parser.add_argument("--model-updates", type=int, default=3, help="--model-dir: timed updates per arm")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled update of each arm")
    parser.add_argument("--seed", type=int, default=0, help="seed of the episodes and the initial weights")
    return parse_args(parser, argv, QUICK)


def raw_update(model, optimizer, batches: list[PaddedBatch], action_tokens: float) -> None:
    """One PPO optimizer step written directly in torch: the floor the trainer is compared to."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for batch in batches:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        logprobs = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        mask = batch.action_mask[:, 1:].float()
        ratio = torch.exp(logprobs - batch.old_logprobs[:, 1:])
        advantages = batch.advantages[:, 1:]
        loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + CLIP))
        ((loss * mask).sum() / action_tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Arm:
    """One timed contestant: its own model copy, optimizer, and an update function."""

    def __init__(self, name: str, base_model, rows: list[TrainSequence], pad_id: int, sizes: Sizes, raw: bool):
        self.name, self.rows, self.pad_id, self.sizes, self.raw = name, rows, pad_id, sizes, raw
        self.model = fresh_copy(base_model)
        self.optimizer = make_optimizer(self.model, lr=LR)
        self.settings = PPOSettings(clip_low=CLIP, clip_high=CLIP, max_grad_norm=MAX_GRAD_NORM,
                                    micro_batch_tokens=sizes.micro_batch_tokens)
        self.batches = make_micro_batches(rows, max_tokens=sizes.micro_batch_tokens, pad_id=pad_id)
        self.action_tokens = float(sum(sum(r.action_mask) for r in rows))
        self.tokens = sum(len(r) for r in rows)
        self.padded_tokens = sum(b.input_ids.numel() for b in self.batches)
        self.seconds: list[float] = []

    def update(self, seed: int, rows: list[TrainSequence] | None = None) -> None:
        if self.raw:
            batches = self.batches if rows is None else make_micro_batches(
                rows, max_tokens=self.sizes.micro_batch_tokens, pad_id=self.pad_id)
            raw_update(self.model, self.optimizer, batches, self.action_tokens)
        else:
            train_iteration(self.model, self.optimizer, self.rows if rows is None else rows, self.settings,
                            pad_id=self.pad_id, seed=seed)

    def timed_update(self, seed: int) -> float:
        started = time.perf_counter()
        self.update(seed)
        self.seconds.append(time.perf_counter() - started)
        return self.seconds[-1]

    def summary(self) -> dict:
        """`seconds` is the median update's (of alternated repeats), as every ratio here uses."""
        median = statistics.median(self.seconds)
        return {"rows": len(self.rows), "tokens_per_update": self.tokens,
                "padded_tokens_per_update": self.padded_tokens, "micro_batches": len(self.batches),
                "seconds": round(median, 3),
                "seconds_per_update": [round(s, 3) for s in self.seconds],
                "tokens_per_s": round(self.tokens / median, 1) if median > 0 else math.nan}


def run_arms(arms: list[Arm], updates: int, progress: Progress) -> None:
    for arm in arms:  # warm-up, untimed, on a few rows
        arm.update(seed=-1, rows=arm.rows[: max(1, len(arm.rows) // 8)])
    for u in range(updates):
        for arm in arms:
            seconds = arm.timed_update(seed=u)
            progress(f"update {u + 1}/{updates} {arm.name}: {seconds:.2f}s ({arm.tokens} tokens)")


def self_cpu_seconds(update) -> dict[str, float]:
    """Self CPU seconds per op of one call of `update`, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update()
    return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}


def profile_difference(trainer: Arm, raw: Arm, top: int = 6) -> dict:
    """Where the trainer spends more than the raw loop: the ops with the largest extra self CPU time."""
    ops = {name: self_cpu_seconds(lambda: arm.update(seed=99)) for name, arm in (("trainer", trainer), ("raw", raw))}
    extra = {op: ops["trainer"].get(op, 0.0) - ops["raw"].get(op, 0.0) for op in set(ops["trainer"]) | set(ops["raw"])}
    ranked = sorted(extra.items(), key=lambda item: -abs(item[1]))[:top]
    return {"trainer_seconds": round(sum(ops["trainer"].values()), 3), "raw_seconds": round(sum(ops["raw"].values()), 3),
            "extra_seconds_by_op": {op: round(seconds, 3) for op, seconds in ranked}}


def measurements(trainer: Arm, raw: Arm, steps: Arm, key: str = "trainer",
                 profile: dict | None = None) -> list[Measurement]:
    t, r, s = trainer.summary(), raw.summary(), steps.summary()
    ratio = t["tokens_per_s"] / r["tokens_per_s"]
    out = [Measurement(key, ratio, TRAINER_GOAL, {"trainer": t, "raw_loop": r, **({"profile": profile} if profile else {})})]
    if not TRAINER_GOAL.met(ratio):
        where = ("; under torch.profiler the trainer's extra self CPU seconds per op were "
                 + ", ".join(f"{op} {sec:+.2f}s" for op, sec in profile["extra_seconds_by_op"].items())) if profile else ""
        out[0].why_missed = (f"a median train_iteration update took {t['seconds']:.2f}s vs {r['seconds']:.2f}s for the "
                             f"raw loop on the same micro-batches{where}.")
    packing = s["seconds"] / t["seconds"]
    out.append(Measurement("packed_vs_step", packing, PACKING_GOAL, {
        "packed": t, "step_rows": s, "token_ratio": round(s["tokens_per_update"] / t["tokens_per_update"], 3)}))
    if not PACKING_GOAL.met(packing):
        token_ratio = out[1].details["token_ratio"]
        speed = s["tokens_per_s"] / t["tokens_per_s"]
        cause = (f"step rows carry only {token_ratio}x the tokens of packed rows (the opening prompt is long "
                 "relative to what each step adds, or episodes have few steps)") if token_ratio < PACKING_GOAL.value \
            else (f"step rows carry {token_ratio}x the tokens, but went through at {speed:.2f}x the tokens/s of "
                  "packed rows: a token costs more in a long row (attention over the whole context, [B, heads, L, L] "
                  "scores), which on a tiny model is a large share of the compute")
        out[1].why_missed = f"{cause}; time ratio = token ratio / tokens/s ratio = {token_ratio} / {speed:.2f}."
    return out


def measure(model, tokenizer, sizes: Sizes, args, progress: Progress, key: str, step_rows: bool) -> list[Measurement]:
    """The arms on one model: trainer and raw loop on packed rows (and the trainer on step rows)."""
    episodes = append_only_episodes(sizes.episodes, steps=sizes.steps, prompt_len=sizes.prompt_len,
                                    response_len=sizes.response_len, obs_len=sizes.obs_len,
                                    vocab_size=len(tokenizer), seed=args.seed)
    packed, pad = choose_layout(episodes, "packed"), tokenizer.pad_token_id
    arms = [Arm(f"{key}/packed", model, packed, pad, sizes, raw=False), Arm(f"raw/{key}", model, packed, pad, sizes, raw=True)]
    if step_rows:
        arms.append(Arm(f"{key}/step", model, choose_layout(episodes, "step"), pad, sizes, raw=False))
    progress(f"{key}: {sizes.episodes} episodes x {sizes.steps} steps, {len(packed)} packed rows ({arms[0].tokens} "
             f"tokens){f', {len(arms[2].rows)} step rows ({arms[2].tokens} tokens)' if step_rows else ''}, policy "
             f"{sizes.policy} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters), "
             f"{sizes.micro_batch_tokens} tokens per micro-batch")
    run_arms(arms, sizes.updates, progress)
    profile = None if args.no_profile else profile_difference(arms[0], arms[1])
    if profile:
        progress(f"{key} profiled: trainer {profile['trainer_seconds']}s, raw {profile['raw_seconds']}s of self CPU time")
    found = measurements(*arms, key=key, profile=profile) if step_rows else \
        measurements(arms[0], arms[1], arms[0], key=key, profile=profile)[:1]
    for m in found:
        m.details["config"] = asdict(sizes)
    return found


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    torch.manual_seed(args.seed)
    model, tokenizer = tiny_policy(synthetic_task(args.seed, small=True), POLICY_SIZES[args.policy], seed=args.seed)
    sizes = Sizes(args.episodes, args.steps, args.prompt_len, args.response_len, args.obs_len, args.updates,
                  vocab_capped_tokens(args.micro_batch_tokens, model_vocab_size(model)), args.policy)
    found = measure(model, tokenizer, sizes, args, progress, "trainer", step_rows=True)
    if args.model_dir:  # a real vocabulary: both arms get the micro-batches the trainer makes (tokens x vocab cap)
        from pathlib import Path

        from agent_core.io.checkpoints import load_policy

        model, tokenizer = load_policy(Path(args.model_dir))
        name = Path(args.model_dir).name
        model_sizes = replace(sizes, episodes=args.model_episodes, updates=args.model_updates, policy=name,
                              micro_batch_tokens=vocab_capped_tokens(args.micro_batch_tokens, model_vocab_size(model)))
        found += measure(model, tokenizer, model_sizes, args, progress, f"trainer-{name.split('-')[0]}", step_rows=False)
    write_result(NAME, TITLE, found, seconds=progress.elapsed, config=asdict(sizes), results_dir=args.results_dir,
                 argv=argv, notes=(
                     f"torch threads: {torch.get_num_threads()}. Ratios from the median of {sizes.updates} alternating "
                     "timed updates per arm after one warm-up update (--model-dir: of --model-updates)."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
