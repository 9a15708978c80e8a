"""Stage 0: the policy the first iteration rolls out with."""

from __future__ import annotations

import json
from pathlib import Path

from agent_core.config import PolicyConfig
from agent_core.io.checkpoints import load_policy, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.tables import read_table
from agent_core.training.model import build_tiny_policy, build_tokenizer, count_parameters
from tasks._common import stage_logger, stage_task
from tasks.prepare_data import DatasetUris

DEFAULT_SMOLLM2_DIR = Path("data/models/smollm2-135m-instruct")


@stage_task(name="init_policy")
def init_policy(run: RunLayout, dataset: DatasetUris, policy: PolicyConfig) -> str:
    """Build (tiny) or copy (path, smollm2) the initial policy into the run; return its directory."""
    log = stage_logger("init_policy")
    target = run.initial_policy_dir
    if policy.source == "tiny":
        texts = [row["text"] for row in read_table("corpus", dataset.corpus_uri).to_pylist()]
        prompt_rows = read_table("dataset_prompts", dataset.prompts_uri).to_pylist()
        # unique message texts: the shared system prompt would otherwise dominate the BPE merges
        texts += sorted({m["content"] for row in prompt_rows for m in json.loads(row["messages"])})
        tokenizer = build_tokenizer(texts, vocab_size=policy.vocab_size)
        model = build_tiny_policy(
            tokenizer, hidden_size=policy.hidden_size, num_layers=policy.num_layers, num_heads=policy.num_heads,
            intermediate_size=policy.intermediate_size, seed=policy.seed,
        )
    else:
        source = Path(policy.path) if policy.path else DEFAULT_SMOLLM2_DIR
        if policy.source == "smollm2" and not source.exists():
            raise FileNotFoundError(f"SmolLM2 checkpoint not found at {source}: run `make smollm2` first")
        model, tokenizer = load_policy(source)
    save_policy(model, tokenizer, target)
    log.info("initial policy (%s, %.2fM parameters, vocab %d) at %s",
             policy.source, count_parameters(model) / 1e6, len(tokenizer), target)
    return str(target)
