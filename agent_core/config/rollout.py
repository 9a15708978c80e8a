"""The `rollout:` section: how episodes are generated, and the vLLM engine's server (`rollout.vllm`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from agent_core.config._base import Section


class VLLMConfig(Section):
    """How the vLLM engine's server runs (rollout.engine: vllm; `make vllm` installs it). The rollout
    layer takes this object as it is (EngineOptions.vllm, agent_core/rollout/vllm_server.py): frozen and
    hashable, so it also keys the pool of kept servers."""

    python: str | None = Field(None, description="the vLLM venv's python (default: $AGENTR1_VLLM_PYTHON, "
                               "else .venv-vllm/bin/python)")
    kv_cache_gib: float = Field(
        1.0, gt=0, description="CPU backend: KV cache size in GiB, passed as --kv-cache-memory-bytes so fractions "
        "work (0.25 holds ~11k tokens of SmolLM2 in bfloat16, and saves 0.75 GiB of the server's memory); ignored "
        "on GPU")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="GPU backend: share of the GPU's memory the server takes (weights, KV cache, "
        "graphs; --gpu-memory-utilization); the trainer on the same GPU needs the rest while the server is awake. "
        "On GPU it decides and kv_cache_gib is ignored; on CPU kv_cache_gib decides and this is ignored")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="weights and compute dtype; auto keeps the checkpoint's; the CPU backend here is "
        "exact in float32")
    weight_sync: Literal["reload", "restart"] = Field(
        "reload", description="reload: new weights into the running server, in place (falls back to a restart on "
        "failure); restart: always restart"
    )
    keep_server: bool = Field(
        True, description="false: stop the pooled server when the engine of its rollout is closed, so training "
        "gets its memory (~3.7 GiB for SmolLM2 on CPU); each rollout then starts a fresh one (~25-45 s)")
    sleep_mode: Literal["auto", "always", "never"] = Field(
        "auto", description="a kept server sleeps when its last engine is closed (a rollout's end, before training; "
        "POST /sleep?level=1: weights to CPU memory, KV cache freed) so the trainer on the same GPU gets its memory, "
        "and wakes before the next rollout. auto: on GPU (the server starts with --enable-sleep-mode); always: also "
        "on CPU, where vLLM's sleep does nothing (no --enable-sleep-mode there: it only exercises the calls); never. "
        "Not run on a GPU here (docs/architecture.md §6)")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for the server's /health "
                                     "before giving up")
    max_concurrent_calls: int = Field(8, ge=1, description="generate calls the agent loop keeps in flight "
                                      "at once")
    extra_args: tuple[str, ...] = Field((), description="more vLLM server flags, verbatim")

    @model_validator(mode="after")
    def _sleep_needs_a_kept_server(self) -> "VLLMConfig":
        if self.sleep_mode == "always" and not self.keep_server:
            raise ValueError("sleep_mode=always puts a kept server to sleep between rollouts, but keep_server=false "
                             "stops it instead: set one of them")
        return self


class HFEngineConfig(Section):
    """How the in-process engine (rollout.engine: hf, transformers `generate`) samples
    (agent_core/rollout/hf_engine.py)."""

    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the weights it samples with: auto is bfloat16 on CUDA (a bf16 copy of the trainer's "
        "module, refreshed before each rollout: the weights the trainer's bf16 autocast uses) and float32 on the CPU")
    kv_reuse: bool = Field(
        True, description="keep each episode's KV cache between its turns and prefill only what a turn appended "
        "(the response and the observation); contexts that are rewritten (context_mode: last_k) are prefilled whole")
    kv_reuse_gib: float = Field(
        4.0, gt=0, description="most memory (GiB, on the engine's device) that kept KV caches may hold across "
        "episodes; the least recently used episode's cache is dropped beyond it (prefilled whole on its next turn)")
    cache: Literal["dynamic", "static"] = Field(
        "dynamic", description="static: a preallocated KV cache per call, with transformers' compiled decode step on "
        "CUDA (no KV reuse across turns); dynamic: transformers' growing cache. A model that has no static cache falls "
        "back to dynamic with a warning")


class RolloutConfig(Section):
    """How episodes are generated: the engine, group size, per-episode budgets, sampling and the env
    (agent_core/rollout; loop settings and sampling come from agent_core/rollout/spec.py)."""

    engine: str = Field("hf", description="inference engine: hf (transformers, in this process) or vllm (a vLLM "
                        "server, see rollout.vllm); set vllm for larger models")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    hf: HFEngineConfig = Field(default_factory=HFEngineConfig)
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
    straggler_wait_s: float = Field(2.0, ge=0, allow_inf_nan=True, description="serial engine (hf): how long it waits, free, for pending tool calls before generating for the ready episodes (.inf: lock-step turns, seeded runs reproducible); concurrent engines (vllm) never wait")

    @property
    def instructions(self) -> bool:
        """Whether an env that takes `instructions` writes them: env_kwargs.instructions, else tool_instructions."""
        return bool(self.env_kwargs.get("instructions", self.tool_instructions))
