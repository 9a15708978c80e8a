"""bench/gpu.py's speed rows: the trainer (default settings, fixed micro-batch sizes, a plain PPO loop)
and generation (the hf engine on the trainer's module vs bare bf16 `generate`). See bench/gpu.py."""

from __future__ import annotations

import copy
import math
import random
import statistics
import time
from dataclasses import asdict, replace

import torch

from agent_core.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from agent_core.rollout.hf_engine import HFEngine
from agent_core.rollout.inference_copy import InferenceCopy, inference_dtype, parameter_dtype
from agent_core.rollout.spec import RolloutSpec
from agent_core.training.batches import choose_layout, make_micro_batches
from agent_core.training.precision import resolve_precision
from agent_core.training.memory import device_free_bytes, pending_state_bytes
from agent_core.training.prepared import loss_token_fraction, training_micro_batch_tokens
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import make_optimizer, train_iteration
from bench.common import Goal, Measurement
from bench.gpu_iteration import free_memory, synchronize
from bench.training import raw_update
from bench.workload import append_only_episodes

GOALS = {
    "trainer_default": Goal("trainer tokens/s, default settings", ">=", 55_000),
    "trainer_mfu": Goal("trainer model FLOP utilisation, default settings", ">=", 0.30),
    "trainer_default_vs_best": Goal("default tokens/s / best of {4k,8k,16k,32k}-token micro-batches", ">=", 0.9),
    "trainer_vs_plain": Goal("trainer tokens/s / plain PPO loop tokens/s, 4,096-token micro-batches", ">=", 1.5),
    "hf_vs_bare_generate": Goal("HFEngine tokens/s / bare bf16 generate tokens/s, batch 256", ">=", 0.95),
}
# dense bf16 tensor-core peaks (FLOP/s) by a substring of torch.cuda.get_device_name
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def timed(device: torch.device, call) -> float:
    synchronize(device)
    started = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - started


def out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError, or the trainer's own (agent_core/training/oom.py: one row alone does not fit)."""
    return (isinstance(error, torch.OutOfMemoryError) or "OutOfMemory" in type(error).__name__
            or "out of memory" in str(error).lower())


# ---- (a) the trainer: default settings vs fixed micro-batch sizes vs a plain loop ----------------------


def trainer_arms(model, tokenizer, args, device, progress) -> dict[str, dict]:
    """Tokens/s (median of `updates` alternating rounds after a warm-up) of each arm; an arm that runs
    out of memory is recorded so and leaves the rounds."""
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    episodes = append_only_episodes(args.episodes, steps=args.steps, prompt_len=args.prompt_len,
                                    response_len=args.response_len, obs_len=args.obs_len, vocab_size=vocab,
                                    seed=args.seed)
    rows = choose_layout(episodes, "packed")
    tokens = sum(len(r) for r in rows)
    default = PPOSettings.from_config(TrainerConfig(), AlgorithmConfig(), 1.0)
    precision = resolve_precision(default.precision, device)
    optimizer = make_optimizer(model, lr=1e-6)  # one model and optimizer for every arm: speed, not learning
    arms = {"default": lambda s: train_iteration(model, optimizer, rows, default, pad_id=pad, seed=s)}
    for size in sorted({*map(int, args.sizes.split(",")), args.plain_tokens}):
        fixed = replace(default, micro_batch_tokens=size, max_logit_elements=size * vocab)  # the cap lifted
        arms[f"mb{size}"] = lambda s, fixed=fixed: train_iteration(model, optimizer, rows, fixed, pad_id=pad, seed=s)
    batches = [b.to(device) for b in make_micro_batches(rows, max_tokens=args.plain_tokens, pad_id=pad)]
    action_tokens = float(sum(sum(r.action_mask) for r in rows))

    def plain(_seed):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            raw_update(model, optimizer, batches, action_tokens)

    arms["plain"] = plain
    chosen = training_micro_batch_tokens(  # what the default arm's first update picks (before any split)
        model, optimizer, rows, tokens=default.micro_batch_tokens, logits=default.max_logit_elements,
        precision=default.precision, checkpointing=default.activation_checkpointing,
        use_loss_mask=default.use_loss_mask)
    # what the default's choice was made from, so a GPU run shows why it picked its size
    budget_inputs = {"free_bytes": device_free_bytes(device), "pending_bytes": pending_state_bytes(model, optimizer),
                     "loss_fraction": round(loss_token_fraction(rows, default.use_loss_mask), 4)}
    progress(f"trainer: {len(rows)} packed rows, {tokens} tokens per update, precision {precision}, default "
             f"micro-batch {chosen} tokens, arms {', '.join(arms)}")
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    failed: dict[str, str] = {}
    splits = dict.fromkeys(arms, 0)  # micro-batches the trainer split after running out of memory
    for round_ in range(args.updates + 1):  # round 0: warm-up, untimed
        for name, update in arms.items():
            if name in failed:
                continue
            try:
                results = []
                took = timed(device, lambda: results.append(update(round_)))
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not out_of_memory(error):
                    raise
                failed[name] = f"out of memory: {' '.join(str(error).split())[:200]}"
                progress(f"trainer {name}: out of memory")
            else:
                splits[name] += sum(getattr(r, "oom_splits", 0) for r in results[0] or [])
                if round_:
                    seconds[name].append(took)
                    progress(f"trainer {name} update {round_}: {took:.2f}s ({tokens / took:,.0f} tokens/s)")
            free_memory(device)
    del optimizer
    free_memory(device)
    return {name: ({"error": failed[name]} if name in failed else
                   {"seconds": [round(s, 3) for s in seconds[name]], "oom_splits": splits[name],
                    "tokens_per_s": round(tokens / statistics.median(seconds[name]), 1)})
            for name in arms} | {"_workload": {"rows": len(rows), "tokens_per_update": tokens,
                                                "precision": precision, "default_micro_batch_tokens": chosen,
                                                "budget_inputs": budget_inputs,
                                                "default_settings": asdict(default)}}


def mfu(tokens_per_s: float, parameters: int, device: torch.device) -> float | None:
    """6 x N x tokens/s over the card's dense bf16 peak (None: not a card in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((flops for key, flops in PEAK_BF16.items() if key in name), None)
    return None if peak is None else round(6 * parameters * tokens_per_s / peak, 3)


def trainer_measurements(arms: dict[str, dict], args, parameters: int, device) -> list[Measurement]:
    rate = lambda name: arms.get(name, {}).get("tokens_per_s", math.nan)  # noqa: E731
    sized = {name: rate(name) for name in arms if name.startswith("mb")
             and int(name[2:]) in map(int, args.sizes.split(","))}
    best = max(sized, key=lambda n: -1 if math.isnan(sized[n]) else sized[n])
    default = rate("default")
    details = {"arms": arms, "mfu": {name: mfu(rate(name), parameters, device) for name in arms if name[0] != "_"},
               "parameters": parameters}
    out = [Measurement("trainer_default", default, GOALS["trainer_default"], details),
           Measurement("trainer_mfu", details["mfu"].get("default") or math.nan, GOALS["trainer_mfu"],
                       {"parameters": parameters}),
           Measurement("trainer_default_vs_best", default / sized[best], GOALS["trainer_default_vs_best"],
                       {"best": best, "best_tokens_per_s": sized[best]}),
           Measurement("trainer_vs_plain", rate(f"mb{args.plain_tokens}") / rate("plain"), GOALS["trainer_vs_plain"],
                       {"trainer_tokens_per_s": rate(f"mb{args.plain_tokens}"), "plain_tokens_per_s": rate("plain")})]
    errors = "; ".join(f"{n}: {a['error']}" for n, a in arms.items() if "error" in a)
    workload = arms["_workload"]
    why = (f"the default picked {workload['default_micro_batch_tokens']}-token micro-batches "
           f"({arms['default'].get('oom_splits', 0)} out-of-memory splits) at {default:,.0f} tokens/s; the best fixed "
           f"size was {best} at {sized[best]:,.0f}; the plain loop {rate('plain'):,.0f} at {args.plain_tokens} tokens")
    for m in out:
        if m.met is not True:
            m.why_missed = why + (f"; {errors}" if errors else "")
    return out


# ---- (b) generation: the hf engine on the trainer's module vs bare bf16 generate -----------------------


def generation_row(model, tokenizer, args, device, progress) -> Measurement:
    rng = random.Random(args.seed)
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    prompts = [[rng.randrange(3, vocab) for _ in range(args.gen_prompt_len)] for _ in range(args.gen_batch)]
    params = RolloutSpec.from_config(RolloutConfig(max_new_tokens=args.gen_new_tokens, temperature=1.0,
                                                   top_p=1.0)).sampling(args.seed)
    bare = copy.deepcopy(model).to(torch.bfloat16).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def bare_generate(new_tokens: int) -> int:
        with torch.inference_mode():
            out = bare.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                temperature=1.0, max_new_tokens=new_tokens, pad_token_id=pad,
                                eos_token_id=tokenizer.eos_token_id)
        return int((out[:, ids.shape[1]:] != pad).sum())

    hf = RolloutConfig().hf  # the shipped engine settings: on CUDA a bf16 copy of the trainer's module
    copies = InferenceCopy(inference_dtype(hf.dtype, device))
    sampled = model if parameter_dtype(model) == copies.dtype else copies.refresh(model)
    static = hf.model_copy(update={"cache": "static"})
    engines = {"engine": HFEngine.configured(sampled, tokenizer, hf, max_batch_size=args.gen_batch),
               "engine_static_cache": HFEngine.configured(sampled, tokenizer, static, max_batch_size=args.gen_batch),
               "engine_fp32_module": HFEngine(model, tokenizer, max_batch_size=args.gen_batch)}
    sides = {"bare_bf16": bare_generate} | {
        name: (lambda n, e=e: sum(len(g.token_ids) for g in e.generate(prompts, replace(params, max_new_tokens=n))))
        for name, e in engines.items()}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for name, side in sides.items():  # warm-up
        side(min(4, args.gen_new_tokens))
    for repeat in range(args.repeats):
        for name, side in sides.items():
            produced = []
            took = timed(device, lambda: produced.append(side(args.gen_new_tokens)))
            rates[name].append(produced[0] / took)
            progress(f"generate {name} {repeat + 1}/{args.repeats}: {produced[0]} tokens in {took:.2f}s")
    fallback = engines["engine_static_cache"].cache != "static"  # the model had no static cache
    del bare, engines
    copies.close()
    free_memory(device)
    median = {name: round(statistics.median(r), 1) for name, r in rates.items()}
    ratio = median["engine"] / median["bare_bf16"]
    versus = {name: round(median[name] / median["bare_bf16"], 3) for name in median if name != "bare_bf16"}
    m = Measurement("hf_vs_bare_generate", ratio, GOALS["hf_vs_bare_generate"],
                    {"tokens_per_s": median, "vs_bare": versus, "sampled_dtype": str(copies.dtype).removeprefix("torch."),
                     "static_cache_fell_back": fallback, "batch": args.gen_batch,
                     "new_tokens": args.gen_new_tokens, "prompt_tokens": args.gen_prompt_len})
    if not GOALS["hf_vs_bare_generate"].met(ratio):
        m.why_missed = (f"the engine (rollout.hf defaults, {m.details['sampled_dtype']} weights) at {ratio:.2f}x bare "
                        f"bf16 generate; with the static cache {versus['engine_static_cache']:.2f}x, on the fp32 "
                        f"module {versus['engine_fp32_module']:.2f}x")
    return m
