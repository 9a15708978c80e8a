"""Why bench/memory.py missed a goal, in words, from what it measured: the iteration's seconds by
stage and probe, who held the memory at the tree's peak, and the single-turn peak against TRL's."""

from __future__ import annotations


def why_iteration_slow(goal_s: float, it: dict) -> str:
    """Why the iteration took longer than `goal_s`, from its measured parts (stage and probe seconds,
    tokens), and what each part would have to take for the goal with the others as measured."""
    seconds, stages, probes, steps = it["seconds"], it["stage_seconds"], it["probe_seconds"], it["steps"]
    start = it.get("vllm_server_start_seconds") or 0.0
    rollout = stages.get("rollout", 0.0) - start
    train = stages.get("train", 0.0)
    rest = seconds - rollout - train
    text = [f"The iteration took {seconds:.0f} s, {seconds - goal_s:.0f} s over the {goal_s:.0f} s goal "
            f"(the vLLM server's one-off start, {start:.0f} s, left out)."]
    roll = (f"Rollout {rollout:.0f} s: {steps['episodes']} episodes, {steps['agent_steps']} agent steps "
            f"({steps['steps_per_episode']:.1f} per episode), {steps['generated_tokens']} generated tokens "
            f"({steps['generated_tokens'] / max(rollout, 1e-9):.0f} tokens/s over the stage)")
    if probes.get("generate") is not None:
        roll += (f"; engine calls in flight {probes['generate']:.0f} s, the rest of the stage "
                 f"{rollout - probes['generate']:.0f} s (env steps, tokenizing, tables, loading the tokenizer)")
    text.append(roll + ".")
    tr = (f"Train {train:.0f} s for {steps['episode_tokens_total']} episode tokens "
          f"({steps['episode_tokens_total'] / max(train, 1e-9):.0f} tokens/s)")
    if probes.get("train_compute") is not None:
        tr += (f"; forward/backward/optimizer steps {probes['train_compute']:.0f} s, the rest of the stage "
               f"{train - probes['train_compute']:.0f} s (loading the policy, building batches, saving checkpoint "
               "and optimizer state)")
    text.append(tr + ".")
    text.append(f"Other stages and gaps (prepare, rewards, advantages, MLflow): {rest:.0f} s.")
    need_rollout, need_train = goal_s - train - rest, goal_s - rollout - rest
    text.append(
        (f"With the rest as measured, the rollout would have to take <= {need_rollout:.0f} s "
         f"({rollout / need_rollout:.1f}x faster)" if need_rollout > 0 else
         f"Train and the rest alone ({train + rest:.0f} s) exceed the goal, so a faster rollout cannot reach it alone")
        + (f", or training <= {need_train:.0f} s ({train / need_train:.1f}x faster)." if need_train > 0 else
           f"; rollout and the rest alone ({rollout + rest:.0f} s) exceed it too, so faster training cannot either."))
    return " ".join(text)


def why_iteration_peak(goal_gib: float, peak: dict, kv_cache_gib: float) -> str:
    """Why the iteration's tree passed `goal_gib`: who held what at the peak (measured)."""
    groups = peak["groups_at_peak_gib"]
    vllm = groups.get("vllm", 0.0)
    text = [f"The process tree peaked at {peak['peak_gib']:.2f} GiB during {peak['phase_at_peak']}: flow process "
            f"{groups.get('flow', 0.0):.2f} GiB, vLLM server processes {vllm:.2f} GiB (KV cache set to "
            f"{kv_cache_gib:g} GiB of it), Prefect's server {groups.get('prefect', 0.0):.2f} GiB, other "
            f"{groups.get('other', 0.0):.2f} GiB."]
    text.append(f"Summed PSS (shared pages once) peaked at {peak['tree_pss_peak_gib']:.2f} GiB.")
    text.append(f"The flow process alone peaked at {peak['own_process_peak_gib']:.2f} GiB (exact) during "
                f"{peak['own_process_phase_at_peak']}.")
    without = peak["sampled_tree_peak_gib"] - vllm
    text.append(f"Without the vLLM server resident at that moment the tree would have held {without:.2f} GiB"
                + (f", under the goal." if without <= goal_gib else f", still {without - goal_gib:.2f} GiB over."))
    return " ".join(text)


def why_peak_vs_trl(ours: dict, trl: dict) -> str:
    """Why the pipeline's single-turn peak is above TRL's on the same work (measured parts)."""
    groups = ours["groups_at_peak_gib"]
    return (f"This pipeline peaked at {ours['peak_gib']:.2f} GiB during {ours['phase_at_peak']} (flow process "
            f"{groups.get('flow', 0.0):.2f} GiB, Prefect's server {groups.get('prefect', 0.0):.2f} GiB, other "
            f"{groups.get('other', 0.0):.2f} GiB; the flow process's exact peak {ours['own_process_peak_gib']:.2f} GiB "
            f"during {ours['own_process_phase_at_peak']}) vs TRL's {trl['peak_gib']:.2f} GiB (exact "
            f"{trl['own_process_peak_gib']:.2f} GiB; {trl.get('rss_gib_after_setup', float('nan')):.2f} GiB once its "
            f"trainer was built): {ours['peak_gib'] - trl['peak_gib']:.2f} GiB more. The flow process alone is "
            f"{ours['own_process_peak_gib'] / trl['own_process_peak_gib']:.2f}x TRL's process.")
