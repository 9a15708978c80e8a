"""Pipeline configuration: frozen pydantic models loaded from YAML (docs/architecture.md §4).

Every section is `extra="forbid"`, and an unknown key anywhere fails at load time with the list of
valid keys at that level. Names of swappable parts (engine, scorer, estimator, ...) are checked
against their registries by `agent_core.validation.check_names`, which every loader of a run's
config calls once plugins are loaded (the registries live in the modules above this one, which
this module does not import), so a typo never survives to the middle of a run.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator

from agent_core.audit_config import AuditConfig
from agent_core.config_errors import ConfigError, Problem, config_error, validation_problems
from agent_core.cost_config import CostConfig
from agent_core.plugins import PluginError, load_plugins

__all__ = ["ConfigError"]  # re-exported: callers catch it from here


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataConfig(_Section):
    """The prompts and the corpus: the built-in synthetic multi-hop QA task (generated
    deterministically from `seed`), or a real dataset read from its native files.

    synthetic: the num_* sizes and *_fraction mix shape the generated world and questions. The
    defaults are the demo's task: 2-hop bridge questions about 2,000 films and 2,000 people whose
    one-syllable names are pairs from pools of 80 words, one passage per search (short contexts:
    what the tiny policy can learn to copy from on 2 cores; docs/results.md). The harder mix (3-hop,
    comparisons, namesakes, top_k 3) is a setting away.
    hotpotqa / 2wikimultihopqa / musique: `files` maps split names (train, dev, test) to native
    files (e.g. {train: hotpot_train_v1.1.json, dev: hotpot_dev_distractor_v1.json}); `setting` is
    HotpotQA / 2Wiki's distractor or fullwiki; `limit` keeps the first N questions of each file.
    jsonl: your own prompts, `files` maps split names to JSON-lines files of {id, question or
    messages, answers, env?, metadata?, documents?} (agent_core/data/prompt_files.py).
    """

    source: Literal["synthetic", "hotpotqa", "2wikimultihopqa", "musique", "jsonl"] = Field(
        "synthetic", description="where prompts and corpus come from: the generated task, a real dataset's native "
        "files, or your own JSON-lines prompts (real ones and jsonl need `files`)")
    seed: int = Field(0, description="synthetic: seed of the generated world, questions and splits; change it for "
                      "another task of the same shape (the run's own `seed` is separate)")
    num_films: int = Field(2000, ge=4, description="synthetic: films in the generated world (more: more questions)")
    num_people: int = Field(2000, ge=4, description="synthetic: people in the generated world")
    num_cities: int = Field(40, ge=2, description="synthetic: cities (shared by all splits)")
    num_countries: int = Field(12, ge=2, description="synthetic: countries (shared by all splits)")
    dev_fraction: float = Field(0.1, ge=0, lt=1, description="synthetic: share of questions held out as the dev "
                                "split (assigned in whole key-person groups, see split_by); dev + test must be < 1")
    test_fraction: float = Field(0.1, ge=0, lt=1, description="synthetic: share of questions held out as the test "
                                 "split, like dev_fraction")
    three_hop_fraction: float = Field(0.0, ge=0, lt=1, description="synthetic: share of 3-hop bridge questions")
    comparison_fraction: float = Field(0.0, ge=0, lt=1, description="synthetic: share of comparison questions")
    distractor_fraction: float = Field(0.0, ge=0, le=1, description="synthetic: share of namesake entities")
    name_syllables: int = Field(1, ge=1, description="synthetic: syllables per name word")
    name_pool: int = Field(
        80, ge=0, description="synthetic: 0 = every name word used once; k = names are pairs of words from pools of k"
    )
    split_by: Literal["key_people", "question"] = Field(
        "key_people", description="synthetic: held-out questions start from unseen people, or are unseen questions"
    )
    files: dict[Literal["train", "dev", "test"], str] = Field(
        default_factory=dict, description="real datasets: split name -> native file"
    )
    setting: Literal["distractor", "fullwiki"] = Field(
        "distractor", description="hotpotqa / 2wikimultihopqa: the files' setting; distractor: each question's own "
        "paragraphs (their ids kept in metadata for analysis); fullwiki: a retriever's, so supporting ones may be "
        "missing. Search always runs over the whole corpus")
    limit: int | None = Field(None, ge=1, description="real datasets: first N questions of each file")
    top_k: int = Field(1, ge=1, description="passages returned by one search call")
    prompts_per_iteration: int = Field(16, ge=1, description="training prompts sampled per iteration")

    @model_validator(mode="after")
    def _real_datasets_have_files(self) -> "DataConfig":
        if self.source != "synthetic" and not self.files:
            raise ValueError(f"data.source={self.source} needs data.files, e.g. {{train: /path/file, dev: /path/file}}")
        if self.source == "synthetic" and self.files:
            raise ValueError("data.files is for real datasets; set data.source to hotpotqa, 2wikimultihopqa, musique "
                             "or jsonl")
        return self


class PolicyLoraConfig(_Section):
    """LoRA adapters (peft) on the policy: only they train; the reference is the same module with
    them disabled; a checkpoint is the adapter plus the base model's path (agent_core/training/lora.py)."""

    rank: int = Field(16, ge=1, description="rank r of each adapter's A (r x in) and B (out x r) matrices")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the adapter's update is (alpha / rank) * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1,
        description="names (last component) of the Linear layers that get an adapter, e.g. the attention "
        "projections; add gate_proj, up_proj, down_proj for the MLP too")


class PolicyConfig(_Section):
    """Where the initial policy comes from.

    tiny: a Llama-architecture model built from scratch with a BPE tokenizer trained on the task's
    text (seconds), then pretrained to copy (`pretrain_steps`: ~90 s on 2 cores at the default size).
    path: any local transformers checkpoint directory. smollm2: the
    SmolLM2-135M-Instruct directory made by `make smollm2` (or `path` if given).
    A `path` with source tiny is refused at load, not ignored: a path never switches the source.
    """

    source: Literal["tiny", "path", "smollm2"] = Field(
        "tiny", description="tiny: build a small model from scratch (seconds); path: a local checkpoint at `path`; "
        "smollm2: the folder `make smollm2` makes")
    path: str | None = Field(
        None, description="the checkpoint folder of source path (or smollm2); refused with source tiny, which "
        "builds its model from scratch: set policy.source=path too"
    )
    vocab_size: int = Field(1024, ge=300, description="tiny: target size of the BPE vocabulary trained on the task's "
                            "text (fewer if the text has too few merges); must hold bytes and special tokens")
    hidden_size: int = Field(128, ge=8, description="tiny: width of the model (divisible by num_heads)")
    num_layers: int = Field(4, ge=1, description="tiny: transformer layers")
    num_heads: int = Field(4, ge=1, description="tiny: attention heads per layer")
    intermediate_size: int = Field(344, ge=8, description="tiny: width of each layer's MLP")
    seed: int = Field(0, description="tiny: seed of the weight initialisation and of the induction pretraining")
    pretrain_steps: int = Field(
        1000, ge=0, description="tiny: steps of induction pretraining (copy a repeated token span) before the warm "
        "start, the copying skill a pretrained model brings (agent_core/training/pretrain.py); 0 = none"
    )
    pretrain_lr: float = Field(1e-3, gt=0, description="tiny: learning rate of the induction pretraining")
    lora: PolicyLoraConfig | None = Field(
        None, description="train LoRA adapters instead of every weight (unset: full fine-tuning); the initial "
        "policy stays the full base model, which the adapters and the KL reference share")

    @model_validator(mode="after")
    def _path_needs_its_source(self) -> "PolicyConfig":
        # Refused rather than implied: an implied source would depend on whether some layer (a shipped
        # config says `source: tiny`) spelled the default out, and a silently ignored path trains the
        # wrong model for minutes before anyone notices.
        if self.source == "tiny" and self.path:
            raise ValueError(f"policy.path={self.path} is set but policy.source is 'tiny', which builds a model from "
                             "scratch and would ignore it: set policy.source=path to start from that checkpoint "
                             "(smollm2 for a converted SmolLM2 folder), or remove policy.path")
        return self


class VLLMConfig(_Section):
    """How the vLLM engine's server runs (rollout.engine: vllm; `make vllm` installs it)."""

    python: str | None = Field(None, description="the vLLM venv's python (default: $AGENTR1_VLLM_PYTHON or .venv-vllm)")
    kv_cache_gib: float = Field(1.0, gt=0, description="CPU backend: KV cache size in GiB; fractions work (0.25 "
                                "holds ~11k tokens of SmolLM2 in bfloat16, and saves 0.75 GiB of the server's memory)")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="GPU backend: share of the GPU's memory the server takes (weights, KV cache, "
        "graphs; --gpu-memory-utilization); the trainer on the same GPU needs the rest while the server is awake. "
        "On GPU it decides and kv_cache_gib is ignored; on CPU kv_cache_gib decides and this is ignored")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("float32", description="weights and compute dtype")
    weight_sync: Literal["reload", "restart"] = Field(
        "reload", description="reload: new weights into the running server (restart on failure); restart: always restart"
    )
    keep_server: bool = Field(
        True, description="false: stop the server when its rollout ends, so training gets its memory (~3.7 GiB for "
        "SmolLM2 on CPU); each rollout then starts a fresh one (~25-45 s)")
    sleep_mode: Literal["auto", "always", "never"] = Field(
        "auto", description="a kept server sleeps between rollouts (POST /sleep?level=1: weights to CPU memory, KV "
        "cache freed) so the trainer on the same GPU gets its memory, and wakes before the next rollout. auto: on GPU "
        "(the server starts with --enable-sleep-mode); always: also on CPU, where vLLM's sleep does nothing; never. "
        "Not run on a GPU here (docs/architecture.md §6)")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for the server's /health")
    max_concurrent_calls: int = Field(8, ge=1, description="generate calls the agent loop keeps in flight")
    extra_args: tuple[str, ...] = Field((), description="more vLLM server flags, verbatim")

    @model_validator(mode="after")
    def _sleep_needs_a_kept_server(self) -> "VLLMConfig":
        if self.sleep_mode == "always" and not self.keep_server:
            raise ValueError("sleep_mode=always puts a kept server to sleep between rollouts, but keep_server=false "
                             "stops it instead: set one of them")
        return self


class RolloutConfig(_Section):
    """How episodes are generated: the engine, group size, per-episode budgets, sampling and the env
    (agent_core/rollout; loop settings and sampling come from agent_core/rollout/spec.py)."""

    engine: str = Field("hf", description="inference engine: hf (transformers, in this process) or vllm (a vLLM "
                        "server, see rollout.vllm); set vllm for larger models")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    group_size: int = Field(4, ge=1, description="samples per prompt (a GRPO group)")
    max_steps: int = Field(4, ge=1, description="LLM calls per episode before it is cut off")
    max_new_tokens: int = Field(24, ge=1, description="tokens per action")
    max_context_tokens: int = Field(1024, ge=16, description="context budget of an episode")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of training rollouts (0 = greedy); the "
                               "trainer computes log-probs at this temperature (at 1 when it is 0)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the smallest token set with this much "
                         "probability (1 = off)")
    max_batch_size: int = Field(64, ge=1, description="sequences per engine forward pass")
    context_mode: Literal["append", "last_k"] = Field(
        "append", description="append: every turn stays in context; last_k: keep the opening and the last turns"
    )
    keep_last_turns: int = Field(2, ge=1, description="turns kept by context_mode=last_k")
    max_observation_tokens: int | None = Field(None, ge=1, description="cut each observation to this many tokens")
    env: str | None = Field(None, description="env for every prompt (default: each prompt's own, from the dataset)")
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="merged over each prompt's env kwargs, e.g. {tool_format: hermes}"
    )
    tool_instructions: bool = Field(
        False, description="envs that take `instructions` (tool_env, search_qa) write the tool-call format into the "
        "system prompt; off by default: the tiny policy learns the format from the warm start and copies better "
        "in short contexts; turn on for a pretrained instruct policy. env_kwargs.instructions wins")
    env_workers: int = Field(8, ge=1, description="threads running env steps (tool calls) concurrently")
    straggler_wait_s: float = Field(2.0, ge=0, description="serial engine (hf): how long it waits, free, for pending tool calls before generating for the ready episodes (.inf: lock-step turns, seeded runs reproducible); concurrent engines (vllm) never wait")

    @property
    def instructions(self) -> bool:
        """Whether an env that takes `instructions` writes them: env_kwargs.instructions, else tool_instructions."""
        return bool(self.env_kwargs.get("instructions", self.tool_instructions))


class RewardConfig(_Section):
    """The scorer, and how process and outcome rewards combine into the reward trained on (done once,
    at labelling: agent_core/rewards/combine.py)."""

    scorer: str = Field("qa_em", description="outcome scorer of a final answer: qa_em (exact match, 0/1) or qa_f1 "
                        "(token F1); a plugin may register more")
    format_weight: float = Field(0.1, ge=0, description="bonus for a well-formed final answer")
    process_weight: float = Field(1.0, ge=0, description="weight of the (normalized) process rewards")
    process_norm: Literal["none", "max_abs"] = Field(
        "none", description="max_abs: scale process rewards by the batch's largest absolute process return"
    )


class AlgorithmConfig(_Section):
    """Estimator, masks (docs/architecture.md §3; what each does: agent_core/algos/masks.py) and the KL term."""

    estimator: str = Field("grpo", description="advantage estimator (agent_core/algos); gae and step_gae train a "
                           "critic too (trainer.critic_lr)")
    norm_by_std: bool = Field(True, description="GRPO: divide by the group std (False = Dr.GRPO)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of future rewards (gae, step_gae, reinforce_pp, "
                         "gigpo's step returns); 1 = undiscounted, as episodes are short")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (gae, step_gae): lower trades variance for the "
                       "critic's bias")
    gigpo_omega: float = Field(1.0, ge=0, description="gigpo: weight of the anchor-state step advantage (0 = grpo)")
    eps: float = Field(1e-6, gt=0, description="added to a standard deviation before dividing by it (group "
                       "normalisation, whitening); numerical guard, rarely changed")
    whiten_advantages: bool = Field(True, description="gae, step_gae: whiten advantages over the advantage mask "
                                    "(verl, Agent-R1); others ignore it (reinforce_pp* always whiten, grpo/rloo never)")
    use_loss_mask: bool = Field(True, description="off = also train on observation tokens after the first prompt, "
                                "each with its own advantage (ablation)")
    use_advantage_mask: bool = Field(True, description="off = recursion and critic targets over observation tokens "
                                     "too (ablation; refused for grpo/rloo, where it changes nothing)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the frozen initial policy (0 = off)")
    kl_estimator: str = Field("k3", description="k1, k2 or k3 (Schulman's low-variance estimator)")
    kl_in_reward: bool = Field(False, description="True: subtract the KL from the reward; False: a loss term")


def _int_or_auto(minimum: int) -> PlainValidator:
    """An integer >= minimum or "auto", with one message (a plain union would give two)."""
    def check(value: Any) -> int | str:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            return value
        raise ValueError(f"got {value!r}; it must be an integer >= {minimum} or auto")
    return PlainValidator(check)


class TrainerConfig(_Section):
    """The policy update: optimizer, learning-rate schedule, PPO clipping and loss, micro-batching and
    memory, the critic's optimizer, and how the trained policy is kept between iterations
    (agent_core/training)."""

    lr: float = Field(5e-4, ge=0, description="0 makes no update (a dry run; the learning test's control)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay of the policy's and the "
                                "critic's optimizers (every trainable parameter)")
    clip_low: float = Field(0.2, ge=0, description="PPO clip: the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="PPO clip: the ratio is clipped above at 1 + clip_high (raise it "
                             "above clip_low for DAPO's clip-higher)")
    dual_clip: float | None = Field(None, gt=1, description="ppo_clip: dual-clip constant c > 1 bounding the loss of "
                                    "negative advantages at c * |A| (unset: off; gspo ignores it)")
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus subtracted from the loss (0 = off, "
                                "and the entropy gets no gradient)")
    max_grad_norm: float = Field(1.0, gt=0, description="clip the global L2 norm of the gradients to this before "
                                 "each optimizer step")
    micro_batch_tokens: Annotated[int | Literal["auto"], _int_or_auto(64)] = Field(
        "auto", description="padded tokens per micro-batch; auto: 8192 on the CPU, on CUDA from the device's free "
        "memory and the model's shape (agent_core/training/memory.py); a micro-batch that runs out of memory is split"
    )
    micro_batch_logits: Annotated[int | Literal["auto"], _int_or_auto(2**16)] = Field(
        "auto", description="cap on tokens x vocab per micro-batch (its fp32 logits and their copies bound memory); "
        "auto: 2**26 on the CPU, none on CUDA (the memory-based budget counts the logits)"
    )
    loss_agg_mode: str = Field("token-mean", description="how per-token losses become one: token-mean over all "
                               "tokens, seq-mean-token-mean (each sequence weighs the same) or seq-mean-token-sum-norm "
                               "(Dr.GRPO: token sums over a fixed length)")
    policy_loss: str = Field("ppo_clip", description="a registered policy loss (agent_core/algos/losses.py)")
    epochs: int = Field(1, ge=1, description="passes over an iteration's data")
    mini_batches: int = Field(2, ge=1, description="optimizer steps per epoch")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="the policy's learning rate after warm-up: constant, or a linear / cosine decay to 0 "
        "at total_steps (agent_core/training/schedule.py)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    total_steps: int | None = Field(None, ge=1, description="decay horizon of linear/cosine (default: the run's)")
    recompute_old_logprobs: bool = Field(
        False, description="True: old log-probs from the policy before the update; False: the rollout's"
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16: forward/backward matmuls under bfloat16 autocast (weights, optimizer and loss stay "
        "fp32); ~2x faster on CPUs with AVX512-BF16 or AMX and on GPUs, log-probs differ at the 1e-2 level; auto: bf16 "
        "on CUDA, fp32 on the CPU (agent_core/training/precision.py)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward pass: less memory, ~30% more compute"
    )
    layout: Literal["auto", "step", "packed"] = Field(
        "auto", description="auto: packed episodes where contexts only append, step rows otherwise"
    )
    critic_lr: float = Field(1e-4, gt=0, description="critic learning rate (gae, step_gae)")
    value_clip: float = Field(0.2, gt=0, description="clip range of the value loss")
    max_consecutive_nonfinite: int = Field(
        3, ge=0, description="optimizer steps in a row (counted across iterations) that may be skipped for non-finite "
        "inputs, log-probs, loss or gradients; one more stops the run before its checkpoint is written (0: the first)"
    )
    max_staleness: int = Field(0, ge=0, description="policy versions a trained step may lag its iteration (0: on-policy; "
                               "1: rollout k+1 overlaps training k, docs/scale-out.md); older steps are refused")
    keep_policy_in_memory: bool = Field(
        True, description="keep the trained policy, critic and optimizers in memory for the next iteration instead of "
        "reloading the checkpoint just written (still written every iteration; one process only, not "
        "data-parallel workers; same parameters either way)")
    background_save: bool = Field(
        True, description="write the optimizer state and the train stage's manifest on a background thread while the "
        "next rollout runs (the checkpoint is written before the stage returns; one process only)")


class ClusterConfig(_Section):
    """Where the work runs (docs/scale-out.md). address unset: everything in this process (no Ray);
    `local`: start a Ray cluster here with num_cpus / num_gpus; `auto` or `ray://host:port`: join one."""

    address: str | None = Field(None, pattern=r"^(local|auto|ray://.+)$", description="unset, local, auto or ray://host:port")
    num_cpus: int | None = Field(None, ge=1, description="local: CPUs Ray may schedule (default: all)")
    num_gpus: int | None = Field(None, ge=0, description="local: GPUs Ray may schedule (default: all)")
    rollout_replicas: int = Field(1, ge=1, description="inference replicas, each an actor owning one engine")
    replica_urls: tuple[str, ...] = Field((), description="external OpenAI-compatible servers (vllm engine): one replica each")
    replica_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica actor")
    replica_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica actor")
    generate_timeout_s: float = Field(300.0, gt=0, description="a replica that takes longer on one call is taken out")
    sync_timeout_s: float = Field(300.0, gt=0, description="how long a replica may take to load new weights")
    trainer_workers: int = Field(1, ge=1, description="data-parallel training workers (torch.distributed)")
    worker_cpus: float = Field(1.0, gt=0, description="CPUs reserved per training worker")
    worker_gpus: float = Field(0.0, ge=0, description="GPUs per training worker (NCCL when > 0, else gloo)")


_SOLVED_EPISODES = "select episode_id from rewards where em = 1"


class WarmStartConfig(_Section):
    """Supervised warm start before RL: imitate selected episodes (agent_core/training/sft.py).

    On by default: a from-scratch policy produces no reward at all without it. source oracle: a
    scripted agent solves `prompts` training prompts of the built-in task first (and answers
    `rag_prompts` in the naive_rag format). steps: the episodes of an existing steps table
    (`steps_uri`, with its rewards table next to it). select_sql picks the episodes (DuckDB over
    views `steps` and `rewards`; must return episode_id); unset, every oracle episode (ideal and
    lazy ones alike: the oracle plays what it is asked to) or, for source steps, the solved ones.

    The defaults are the demo's recipe (docs/results.md): 4,000 oracle episodes, 75% of them lazy,
    one epoch on the action tokens. A strong warm start would leave RL nothing visible to do; this
    one copies names well but stops searching too early, which RL fixes within a few iterations.
    """

    enabled: bool = Field(True, description="run the supervised warm start before RL; false: RL starts from the "
                          "initial policy as is (one that already uses the tools, or a smoke run: configs/tiny.yaml)")
    source: Literal["oracle", "steps"] = Field(
        "oracle", description="oracle: episodes of the scripted agent on the built-in task; steps: episodes of an "
        "existing steps table (steps_uri)")
    prompts: int = Field(4000, ge=1, description="oracle: training prompts solved by the scripted agent")
    rag_prompts: int = Field(0, ge=0, description="oracle: training prompts answered in the naive_rag format too")
    lazy_fraction: float = Field(
        0.75, ge=0, le=1, description="oracle: share of the tool episodes that answer the bridge entity after one "
        "search (agent_core/data/oracle.py): a weak warm start whose searching RL must fix; 0 = all ideal")
    steps_uri: str | None = Field(None, description="source steps: a steps.parquet with rewards.parquet beside it")
    select_sql: str | None = Field(None, description="episodes to imitate; unset: see the class docstring")
    epochs: int = Field(1, ge=1, description="passes over the selected episodes")
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step")
    lr: float = Field(1e-3, gt=0, description="3e-3 left 2 of 4 seeds of the demo on a plateau (docs/results.md)")
    loss_on: Literal["actions", "all"] = Field(
        "actions", description="targets: the action tokens, or every token of the episode (language modelling)"
    )

    @model_validator(mode="after")
    def _steps_source_has_a_table(self) -> "WarmStartConfig":
        if self.source == "steps" and not self.steps_uri:
            raise ValueError("warm_start.source=steps needs warm_start.steps_uri (a steps.parquet)")
        if (self.source == "oracle" and self.lazy_fraction > 0 and self.select_sql is not None
                and " ".join(self.select_sql.split()) == _SOLVED_EPISODES):
            raise ValueError("warm_start.lazy_fraction > 0 records lazy episodes with em 0, which this select_sql "
                             "drops; leave warm_start.select_sql unset (every oracle episode) or set lazy_fraction: 0")
        return self

    @property
    def selection_sql(self) -> str:
        """The SQL that picks the episodes to imitate (select_sql, or the source's default)."""
        if self.select_sql is not None:
            return self.select_sql
        return "select episode_id from rewards" if self.source == "oracle" else _SOLVED_EPISODES


class DevEvalConfig(_Section):
    """Held-out evaluation while training: the policy answers the first `prompts` prompts of `split`
    (greedy, one episode each, with the rollout's budgets and tool format) before RL and after every
    `every`-th iteration; the EM goes into the iteration summary and MLflow (metric dev_em)."""

    every: int = Field(1, ge=0, description="evaluate after every N-th iteration (and the last); 0 = never")
    split: Literal["train", "dev", "test"] = Field(
        "dev", description="the split evaluated; test is for the final report, not for choosing settings")
    prompts: int = Field(200, ge=1, description="prompts of the split evaluated (the first N)")


class TrackingConfig(_Section):
    """MLflow tracking: where runs are logged, the experiment, and the registered model each
    iteration's checkpoint becomes a version of (tasks/track.py)."""

    tracking_uri: str | None = Field(None, description="default: sqlite database in the data root")
    experiment: str = Field("agentr1", description="MLflow experiment the run is logged under; one per study, so "
                            "its runs compare side by side")
    model_name: str | None = Field(
        None, pattern=r"^[^'/@]+$",
        description="registered model each iteration's checkpoint becomes a version of (a loadable MLflow model; "
        "aliases `latest` and `best`); default: '<experiment>-policy', one model per experiment")
    register_every: int = Field(
        1, ge=1, description="register every N-th iteration's checkpoint as a model version, and always the last one "
        "and any whose dev EM reaches the model's best (so `best` is the same checkpoint as with 1)")

    def registered_model_name(self) -> str:
        return self.model_name or f"{self.experiment}-policy"


class PipelineConfig(_Section):
    """A whole run: its id, plugins, where its files go, the device, how many RL iterations, the run's
    seed, and one section per stage."""

    run_id: str | None = Field(None, description="default: a fresh id per run")
    plugins: list[str] = Field(
        default_factory=list, description="modules imported first; they register envs, tools, estimators ..."
    )
    data_root: str = Field("data", description="folder of everything a run writes: runs/, datasets, the MLflow "
                           "store, Prefect's home, the model cache (relative to the working directory)")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="where the policy, the reference scoring, the critic "
        "and the hf engine of this process live: auto (cuda when torch.cuda.is_available(), else cpu), cpu, cuda or "
        "cuda:N; a CUDA device the machine lacks fails at config check (agent_core/devices.py)")
    iterations: int = Field(12, ge=1, description="RL iterations (each: sample prompts, roll out, score, "
                            "advantages, train)")
    seed: int = Field(0, description="the run's seed: each iteration's prompt sample, rollout sampling and the warm "
                      "start; change it for another training seed of the same task (data.seed is the task's)")
    data: DataConfig = DataConfig()
    policy: PolicyConfig = PolicyConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    dev_eval: DevEvalConfig = DevEvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    cluster: ClusterConfig = ClusterConfig()
    audit: AuditConfig = Field(AuditConfig(), description="behaviour health checks after each iteration "
                               "(agent_core/audit_config.py)")
    cost: CostConfig = Field(CostConfig(), description="prices per device-hour for the costs view "
                             "(agent_core/cost_config.py)")

    @model_validator(mode="before")
    @classmethod
    def _load_plugins_first(cls, data: Any) -> Any:
        """Plugins register the names the other sections may use, so they load whenever a config is
        validated (also when Prefect validates a deployment's parameters in a worker), before
        `agent_core.validation.check_names` looks those names up."""
        plugins = data.get("plugins") if isinstance(data, dict) else None
        if plugins:
            if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
                raise ValueError(f"plugins must be a list of module names, got {plugins!r}")
            try:
                load_plugins(plugins)
            except PluginError as error:
                raise ValueError(str(error)) from None
        return data

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> scalar values (MLflow params)."""
        return _flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# Keys that moved, so an old config says where its key went.
MOVED_KEYS = {
    "algorithm.process_reward_weight": "reward.process_weight",
    "algorithm.process_reward_norm": "reward.process_norm",
}


def _check_keys(model: type[BaseModel], data: Any, prefix: str = "") -> list[Problem]:
    """Unknown keys, each with the valid keys at its level listed (pydantic alone does not list them)."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    problems = []
    for key, value in data.items():
        if key not in fields:
            moved = MOVED_KEYS.get(f"{prefix}{key}")
            hint = f" (it moved to '{moved}': rewards are combined once, at labelling)" if moved else ""
            problems.append(Problem(f"{prefix}{key}", f"unknown config key '{prefix}{key}'{hint}; valid keys here: "
                                                      f"{', '.join(fields)}"))
            continue
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            problems += _check_keys(annotation, value, f"{prefix}{key}.")
    return problems


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides; values are parsed as YAML scalars (3, 0.1, true, grpo)."""
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            where = getattr(error, "problem", None) or "not valid YAML"
            raise ConfigError(f"override {item!r}: its value is not valid YAML ({where}); quote the whole "
                              "--set for the shell, e.g. --set 'rollout.env_kwargs={tools: [search]}'") from None
    return data


def parse_config(data: dict[str, Any], source: str = "config", overrides: list[str] | None = None) -> PipelineConfig:
    """Validate `data` against the config models: keys, types and ranges; plugins are loaded. Registry
    names are not checked here: a config for a run comes from `agent_core.validation`, which does.

    An error names the layer that set the bad value: one of `overrides` (the `--set` items applied to
    `data`), else `source`."""
    problems = _check_keys(PipelineConfig, data)
    if problems:
        raise config_error(problems, source, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as error:
        raise config_error(validation_problems(error), source, overrides or []) from None
