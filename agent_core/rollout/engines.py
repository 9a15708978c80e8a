"""Engine registry: a config names the engine; a factory builds it from a policy directory.

The factories read the checkpoint themselves (agent_core.io.checkpoints, a layer below): each
engine loads what it needs of it (the hf engine the model, the vLLM engine only the tokenizer, its
server reads the weights), so callers pass the directory rather than a loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from agent_core.io.checkpoints import load_policy, load_tokenizer
from agent_core.registry import Registry
from agent_core.rollout.engine import Engine
from agent_core.rollout.vllm_server import VLLMOptions


@dataclass(frozen=True)
class EngineOptions:
    """max_batch_size: sequences per forward pass (per request for vLLM). max_model_len: the longest
    context + action the engine must hold (vLLM sizes its server by it). vllm: how a vLLM server runs."""

    max_batch_size: int = 64
    max_model_len: int = 2048
    vllm: VLLMOptions = field(default_factory=VLLMOptions)


EngineFactory = Callable[[Path, EngineOptions], Engine]
ENGINES: Registry[EngineFactory] = Registry("engine")


@ENGINES.register("hf")
def _hf_engine(policy_dir: Path, options: EngineOptions) -> Engine:
    from agent_core.rollout.hf_engine import HFEngine  # transformers: imported only when an hf engine is built

    model, tokenizer = load_policy(policy_dir)
    return HFEngine(model, tokenizer, max_batch_size=options.max_batch_size)


@ENGINES.register("vllm")
def _vllm_engine(policy_dir: Path, options: EngineOptions) -> Engine:
    from agent_core.rollout.vllm_engine import VLLMEngine, pooled_server

    server = pooled_server(policy_dir, options.max_model_len, options.vllm)
    return VLLMEngine(server, load_tokenizer(policy_dir), max_batch_size=options.max_batch_size,
                      max_concurrent_calls=options.vllm.max_concurrent_calls)


def shutdown_engines() -> None:
    """Stop engine processes kept warm between rollouts (vLLM servers); flows call it when they end."""
    from agent_core.rollout.vllm_engine import shutdown_servers

    shutdown_servers()


def close_engine(engine: Engine) -> None:
    """Engines that hold resources expose close() (vLLM: its request threads; the server stays
    pooled until `shutdown_engines`); in-process ones need nothing."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()
