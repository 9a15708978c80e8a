"""Engine registry: a config names the engine; a factory builds it from a policy directory.

The factories read the checkpoint themselves (agent_core.io.checkpoints, a layer below): each
engine loads what it needs of it (the hf engine the model, the vLLM engine only the tokenizer, its
server reads the weights), so callers pass the directory rather than a loaded model.

Placement: `EngineOptions.device` is the run's `device` setting (auto, cpu, cuda, cuda:N), resolved
where the engine is built (agent_core/devices.py; on a Ray replica, in its process). Colocation: with
a lender installed (`lending`, which agent_core/run_resources.py uses for the trainer's resident
policy), the hf engine borrows the module already in memory for that checkpoint instead of loading
a second copy, and gives it back on `close_engine`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from agent_core.config import HFEngineConfig, RolloutConfig, VLLMConfig
from agent_core.devices import resolve_device
from agent_core.io.checkpoints import load_policy, load_tokenizer
from agent_core.registry import Registry
from agent_core.rollout.engine import Engine


@dataclass(frozen=True)
class EngineOptions:
    """max_batch_size: sequences per forward pass (per request for vLLM). max_model_len: the longest
    context + action the engine must hold (vLLM sizes its server by it). vllm: how a vLLM server runs (the config's rollout.vllm).
    hf: how the in-process engine samples (rollout.hf: its dtype, KV reuse, cache).
    device: where an in-process model lives (the run's `device` setting, resolved when built)."""

    max_batch_size: int = 64
    max_model_len: int = 2048
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)
    device: str = "auto"

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, device: str = "auto") -> "EngineOptions":
        """The options a rollout section asks of its engine (training's rollout, eval's, a benchmark's)."""
        return cls(max_batch_size=rollout.max_batch_size, max_model_len=rollout.max_context_tokens,
                   vllm=rollout.vllm, hf=rollout.hf, device=device)


EngineFactory = Callable[[Path, EngineOptions], Engine]
ENGINES: Registry[EngineFactory] = Registry("engine")


@dataclass(frozen=True)
class EngineTraits:
    """What a run needs to know of an engine without building one.

    concurrent_calls: generate calls one instance serves at once (1: one batch at a time; a router
    over such replicas sends one call at a time and splits it; more: continuous batching, and a
    router may keep that many in flight per replica). unavailable: why it cannot run on this machine
    with the run's rollout section (one line), or None. external_servers: `cluster.replica_urls`
    may name already running servers of it."""

    concurrent_calls: Callable[[EngineOptions], int] = lambda options: 1
    unavailable: Callable[[RolloutConfig], str | None] = lambda rollout: None
    external_servers: bool = False


def engine_traits(name: str) -> EngineTraits:
    """The traits engine `name` was registered with (`ENGINES.register(name, traits=...)`); the
    defaults (one call at a time, always available) for one registered without."""
    return ENGINES.traits(name, EngineTraits())


def router_concurrency(engine: str, options: EngineOptions, replicas: int) -> int:
    """Generate calls a router over `replicas` replicas of `engine` keeps in flight (EngineTraits)."""
    per_replica = engine_traits(engine).concurrent_calls(options)
    return 1 if per_replica == 1 else per_replica * replicas

# (checkpoint directory, device, dtype) -> a lease (.model, .tokenizer, .release()) on a module already in
# memory whose parameters are in that dtype (the trainer's own, or its inference copy), or None; set only
# inside `lending` (a run's resources), never left behind.
Lender = Callable[[Path, torch.device, torch.dtype], object | None]
_lender: Lender | None = None


@contextmanager
def lending(lender: Lender) -> Iterator[None]:
    """Within the block, hf engines first ask `lender` for the checkpoint's module (colocation)."""
    global _lender
    previous, _lender = _lender, lender
    try:
        yield
    finally:
        _lender = previous


@ENGINES.register("hf")
def _hf_engine(policy_dir: Path, options: EngineOptions) -> Engine:
    from agent_core.rollout.hf_engine import HFEngine  # transformers: imported only when an hf engine is built
    from agent_core.rollout.inference_copy import cast_parameters, inference_dtype

    device = resolve_device(options.device)
    dtype = inference_dtype(options.hf.dtype, device)
    lease = _lender(Path(policy_dir), device, dtype) if _lender is not None else None
    if lease is not None:  # the trainer's module, or its inference copy: no reload
        return HFEngine.configured(lease.model, lease.tokenizer, options.hf, max_batch_size=options.max_batch_size,
                                   release=lease.release)
    model, tokenizer = load_policy(policy_dir, device=device)
    return HFEngine.configured(cast_parameters(model, dtype), tokenizer, options.hf,
                               max_batch_size=options.max_batch_size)


def _vllm_unavailable(rollout: RolloutConfig) -> str | None:
    from agent_core.rollout.vllm_server import VLLMNotInstalledError, vllm_python

    try:
        vllm_python(rollout.vllm)
    except VLLMNotInstalledError as error:
        return str(error)
    return None


@ENGINES.register("vllm", traits=EngineTraits(concurrent_calls=lambda options: options.vllm.max_concurrent_calls,
                                              unavailable=_vllm_unavailable, external_servers=True))
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
