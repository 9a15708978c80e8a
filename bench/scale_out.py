"""Scale-out on a local Ray cluster: 2 inference replicas vs 1, 2 data-parallel training workers vs
1 process, and the seconds of a weight sync (docs/scale-out.md).

Three parts, each timed within this run on one private Ray instance (4 logical CPUs, so 2 replicas
and 2 training workers fit; the machine's cores are what they are, see below):

- Rollout. The same rollout (the agent loop of agent_core/rollout/agent_loop.py with the search
  env and BM25 on the built-in synthetic task, --prompts x --group-size episodes of --max-steps
  steps, lock-step turns, seeded) run by four engines: (a) a ReplicaRouter over 1 hf replica
  (1 torch thread), (b) over 2 hf replicas (1 thread each), (c) the in-process hf engine with 1
  torch thread and (d) with 2. The router gives every prompt its own seed, so all four generate
  the same tokens (`same_tokens` says whether they did). Tokens/s = generated tokens / wall time of
  the rollout. Ratios: ``rollout_replicas`` = (b) / (a); ``rollout_ray_overhead`` = (a) / (c)
  (below 1: what a replica costs over calling the engine in-process: Ray calls, pickling, the
  split); ``rollout_replicas_vs_threads`` = (b) / (d) (the two ways to use 2 cores). The pools
  start once and are reused; each round runs every arm once (order reversed every other round),
  after one untimed full-size warm-up each, and the median of --repeats rounds is used. Start-up seconds
  of a pool of 1 and of 2 replicas are details.
- Training. One iteration's training job (tasks/train.py's `train_job` on the steps of a small
  `agentr1 train --config tiny` run, with random advantages so every token carries a gradient)
  run by `run_training` in this process (1 torch thread; 2 threads as a reference) and by a
  TrainerGroup of 2 Ray workers with 1 thread each (gloo; each worker takes half the micro-batches
  of each optimizer step, gradients summed). ``training_workers`` = seconds per iteration in
  1 process (1 thread) / with 2 workers (above 1 = faster). The group starts once (timed: a
  detail); each arm writes its own checkpoint; median of --repeats alternating rounds.
- Weight sync. Seconds of `ReplicaPool.sync` for 2 hf replicas (median of --syncs alternating syncs
  between two saved policies) and for 2 vLLM replicas (in-place reload; skipped with the reason
  where .venv-vllm is missing, and under --quick). ``sync_hf`` / ``sync_vllm`` = median sync seconds
  / seconds to start that pool (below 1: a sync is cheaper than restarting the replicas).

No goals: the machine here has 2 cores, so 2 replicas (or 2 workers) cannot be 2x one replica on
1 thread once the driver, the env and Ray take their share; the ratios report what this machine
does. On a machine with a core (or GPU) per replica the same script measures real scale-out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from agent_core.cluster.runtime import ClusterSpec, connect, disconnect
from agent_core.rollout.engines import EngineOptions
from bench.common import Measurement, Progress, base_parser, parse_args, skipped_measurement, write_result
from bench.scale_out_rollout import alternate, median, r3, rollout_part
from bench.workload import PolicySize, save_policy_dir, synthetic_task, tiny_policy

NAME = "scale_out"
TITLE = "Scale-out: replicas, data-parallel workers, weight sync (local Ray)"
RUN_ID = "bench"
QUICK = dict(prompts=2, group_size=2, max_steps=2, max_new_tokens=8, repeats=1, syncs=2,
             train_prompts=3, train_group_size=2, train_epochs=1, vllm=False)


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--max-steps", type=int, default=4, help="LLM calls per episode at most")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per action at most")
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences per hf forward pass")
    parser.add_argument("--hidden-size", type=int, default=64, help="policy hidden size (head size 32: vLLM's CPU minimum)")
    parser.add_argument("--num-layers", type=int, default=2, help="policy layers")
    parser.add_argument("--repeats", type=int, default=5, help="alternating timed rounds per part (median)")
    parser.add_argument("--syncs", type=int, default=6, help="timed weight syncs per pool (median)")
    parser.add_argument("--train-prompts", type=int, default=16, help="prompts of the run whose steps are trained")
    parser.add_argument("--train-group-size", type=int, default=4, help="episodes per prompt of that run")
    parser.add_argument("--train-epochs", type=int, default=2, help="passes over the steps per training job")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the weight sync of 2 vLLM replicas (default on; off with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task, the weights and the sampling")
    return parse_args(parser, argv, QUICK)


# ---------------------------------------------------------------- weight sync

def second_policy(model, tokenizer, directory: Path) -> Path:
    """Another version of the policy (perturbed weights, same architecture)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return save_policy_dir(model, tokenizer, directory)


def time_syncs(pool, policies: tuple[Path, Path], syncs: int, progress: Progress, what: str) -> list[float]:
    """`syncs` syncs alternating between the two policies (the pool starts on the first); their seconds."""
    from agent_core.cluster.runtime import ray_module

    ray = ray_module()
    seconds = []
    for k in range(syncs):
        version = pool.version + 1
        seconds.append(pool.sync(str(policies[(k + 1) % 2]), version))
        served = ray.get([r.actor.version.remote() for r in pool.replicas])
        if set(served) != {version}:
            raise RuntimeError(f"after sync {k + 1} the replicas serve versions {served}, not {version}")
        progress(f"{what} sync {k + 1}/{syncs} to version {version}: {seconds[-1]:.3f}s")
    return seconds


def sync_measurement(key: str, engine: str, seconds: list[float], start_seconds: float,
                     rollout_seconds: float | None) -> Measurement:
    sync = median(seconds)
    details = {"ratio_is": f"median seconds of ReplicaPool.sync over 2 {engine} replicas / seconds to start that "
                           "pool (below 1: a sync is cheaper than restarting the replicas)",
               "replicas": 2, "median_sync_seconds": r3(sync), "sync_seconds": [r3(s) for s in seconds],
               "pool_start_seconds": r3(start_seconds)}
    if rollout_seconds:
        details["sync / rollout seconds (2 hf replicas)"] = r3(sync / rollout_seconds)
    return Measurement(key, sync / start_seconds, None, details)


def vllm_sync_part(policies: tuple[Path, Path], args, progress: Progress, pools: dict) -> Measurement:
    from agent_core.cluster.replicas import ReplicaPool, ReplicaSpec
    from agent_core.config import VLLMConfig
    from agent_core.rollout.vllm_server import vllm_python

    if not args.vllm:
        return skipped_measurement("sync_vllm", None, "not measured under --quick / --no-vllm (a vLLM pool takes "
                                                      "about a minute to start on 2 cores)")
    try:
        vllm_python(VLLMConfig())
    except Exception as error:
        return skipped_measurement("sync_vllm", None, f"{type(error).__name__}: {error}"[:500])
    spec = ReplicaSpec(engine="vllm", options=EngineOptions(max_batch_size=16, max_model_len=512), count=2,
                       cpus=1, threads=1, sync_timeout_s=300)
    progress("starting a pool of 2 vLLM replicas (about a minute)")
    started = time.perf_counter()
    try:
        pools["vllm2"] = ReplicaPool(spec, str(policies[0]), 0)
    except Exception as error:
        return skipped_measurement("sync_vllm", None, f"the vLLM replicas did not start: "
                                                      f"{type(error).__name__}: {error}"[:500])
    start = time.perf_counter() - started
    progress(f"vLLM pool of 2 started in {start:.1f}s")
    seconds = time_syncs(pools["vllm2"], policies, args.syncs, progress, "vllm")
    return sync_measurement("sync_vllm", "vllm", seconds, start, None)


# ---------------------------------------------------------------- training

def make_run(data_root: Path, args, progress: Progress) -> None:
    """A one-iteration tiny run whose steps and advantages the training part trains on."""
    agentr1 = str(Path(sys.executable).with_name("agentr1"))
    overrides = ["iterations=1", "dev_eval.every=0", f"policy.hidden_size={args.hidden_size}",
                 f"policy.num_layers={args.num_layers}", f"policy.intermediate_size={2 * args.hidden_size}",
                 f"data.prompts_per_iteration={args.train_prompts}", f"rollout.group_size={args.train_group_size}",
                 f"rollout.max_steps={args.max_steps}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 "rollout.max_context_tokens=2048"]
    command = [agentr1, "train", "--config", "tiny", "--data-root", str(data_root), "--run-id", RUN_ID]
    for item in overrides:
        command += ["--set", item]
    progress("agentr1 train --config tiny " + " ".join(f"--set {o}" for o in overrides))
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"agentr1 train failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def training_job(data_root: Path, out: Path, args):
    """tests/test_scale_out.py's `_job` + `_with_signal`: iteration 0's job with random advantages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from agent_core.config import AlgorithmConfig, TrainerConfig
    from agent_core.io.layout import DataRoot
    from agent_core.io.tables import write_table
    from tasks.train import train_job

    run = DataRoot(data_root).run(RUN_ID)
    trainer = TrainerConfig(mini_batches=1, lr=3e-4, loss_agg_mode="token-mean", epochs=args.train_epochs)
    job = train_job(run, 0, run.table_uri(0, "steps"), run.table_uri(0, "advantages"), str(run.initial_policy_dir),
                   trainer, AlgorithmConfig(), 1.0, 1, background_save=False)
    table = pq.read_table(job.advantages_uri)
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(len(a), generator=generator).tolist() for a in table.column("advantages").to_pylist()]
    rows = table.set_column(table.schema.get_field_index("advantages"), "advantages",
                            pa.array(values, table.schema.field("advantages").type)).to_pylist()
    out.mkdir(parents=True, exist_ok=True)
    return dataclasses.replace(job, advantages_uri=write_table("advantages", rows, str(out / "advantages.parquet")))


def training_part(data_root: Path, out: Path, args, progress: Progress, groups: dict) -> Measurement:
    from agent_core.cluster.trainers import TrainerGroup, TrainerSpec
    from agent_core.training.batches import make_micro_batches
    from agent_core.training.iteration import job_sequences, run_training
    from agent_core.training.memory import vocab_capped_tokens

    make_run(data_root, args, progress)
    job = training_job(data_root, out, args)
    sequences = job_sequences(job)
    tokens = vocab_capped_tokens(job.settings.micro_batch_tokens, 0)  # "auto": the CPU's 8,192
    micro_batches = len(make_micro_batches(sequences, max_tokens=tokens, pad_id=0))
    progress(f"training job: {len(sequences)} rows, {sum(len(s) for s in sequences)} tokens, "
             f"{micro_batches} micro-batches per optimizer step")
    progress("starting 2 training workers")
    started = time.perf_counter()
    groups["trainers"] = TrainerGroup(TrainerSpec(workers=2, cpus=1, threads=1))
    group_start = time.perf_counter() - started
    progress(f"training workers joined in {group_start:.1f}s")
    runs = iter(range(1_000_000))

    def own(job_):  # every run writes its own checkpoint
        n = next(runs)
        return dataclasses.replace(job_, checkpoint_dir=str(out / f"run-{n}" / "checkpoint"),
                                   optimizer_out=str(out / f"run-{n}" / "optimizer.pt"))

    def in_process(threads: int):
        def train():
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                return run_training(own(job))
            finally:
                torch.set_num_threads(before)
        return train

    arms = {"1 process 1 thread": in_process(1), "1 process 2 threads": in_process(2),
            "2 workers": lambda: groups["trainers"].train(own(job))}
    for train in arms.values():  # untimed warm-up: imports, allocator, the workers' first call
        train()
    progress("training warm-ups done")

    def run_arm(train) -> dict:
        started_ = time.perf_counter()
        results, rows = train()
        seconds = time.perf_counter() - started_
        if any(r.skipped for r in results):
            raise RuntimeError("an optimizer step was skipped (non-finite): the timing would not be comparable")
        return {"seconds": seconds, "updates": len(results), "summary": f"{len(results)} update(s), {seconds:.2f}s"}

    rounds = alternate(arms, args.repeats, run_arm, progress, "training")
    secs = {name: median([r["seconds"] for r in rs]) for name, rs in rounds.items()}
    details = {
        "ratio_is": "seconds per training iteration in 1 process (1 thread) / with 2 Ray workers (1 thread each)",
        "rows": len(sequences), "tokens": sum(len(s) for s in sequences), "micro_batches_per_step": micro_batches,
        "optimizer_steps": rounds["2 workers"][0]["updates"],
        **{name: {"median_seconds": r3(secs[name]), "seconds": [r3(r["seconds"]) for r in rs]}
           for name, rs in rounds.items()},
        "1 process 2 threads / 2 workers": r3(secs["1 process 2 threads"] / secs["2 workers"]),
        "group_start_seconds": r3(group_start),
    }
    return Measurement("training_workers", secs["1 process 1 thread"] / secs["2 workers"], None, details)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    load_before = os.getloadavg()[0]
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bars from every actor
    ray_temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.environ["AGENTR1_RAY_TEMP_DIR"] = ray_temp
    work = Path(tempfile.mkdtemp(prefix="bench-scale-out-"))
    size = PolicySize(vocab_size=400, hidden_size=args.hidden_size, num_layers=args.num_layers,
                      num_heads=max(1, args.hidden_size // 32), intermediate_size=2 * args.hidden_size)
    task = synthetic_task(args.seed, small=True)
    if len(task.prompts) < args.prompts:
        raise SystemExit(f"the task has {len(task.prompts)} training prompts, {args.prompts} are needed")
    model, tokenizer = tiny_policy(task, size, seed=args.seed)
    policies = (save_policy_dir(model, tokenizer, work / "policy-v0"),
                second_policy(model, tokenizer, work / "policy-v1"))
    progress(f"policy: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; Ray: local, 4 logical CPUs")
    pools: dict = {}
    groups: dict = {}
    measurements: list[Measurement] = []
    try:
        connect(ClusterSpec("local", num_cpus=4))
        rollout_measurements, facts = rollout_part(policies[0], task, tokenizer, args, progress, pools)
        measurements += rollout_measurements
        pools.pop("hf1").shutdown()
        hf_sync = time_syncs(pools["hf2"], policies, args.syncs, progress, "hf")
        sync_hf = sync_measurement("sync_hf", "hf", hf_sync, facts["start_seconds"][2],
                                   facts["rollout_seconds_2_replicas"])
        pools.pop("hf2").shutdown()
        measurements.append(training_part(work / "data", work / "train", args, progress, groups))
        groups.pop("trainers").shutdown()
        measurements.append(sync_hf)
        measurements.append(vllm_sync_part(policies, args, progress, pools))
    finally:
        for pool in pools.values():
            pool.shutdown()
        for group in groups.values():
            group.shutdown()
        disconnect()
        shutil.rmtree(ray_temp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir",)}
    load_after = os.getloadavg()[0]
    write_result(NAME, TITLE, measurements, seconds=progress.elapsed, config=config, results_dir=args.results_dir,
                 argv=argv, data_root=work, notes=(
                     f"{os.cpu_count()} cores; Ray local with 4 logical CPUs; hf replicas and training workers 1 torch "
                     f"thread each. Rollout: {args.prompts} prompts x {args.group_size} episodes, max {args.max_steps} "
                     f"steps x {args.max_new_tokens} tokens, policy hidden {args.hidden_size} x {args.num_layers} "
                     f"layers; medians of {args.repeats} alternating rounds after a warm-up. No goals: with 2 cores "
                     "the driver, the env and Ray share the cores the replicas/workers use. The 2-thread in-process "
                     "arms are the most sensitive to other load (torch's OpenMP threads spin-wait, and an op stalls "
                     "while one of its 2 threads is descheduled): see their per-round numbers. 1-minute load "
                     f"average {load_before:.2f} at the start, {load_after:.2f} at the end (this script alone keeps "
                     "about 1-2 busy; more means other work shared the cores)."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
