"""Engine registry: a config names the engine; a factory builds it from a policy directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent_core.registry import Registry
from agent_core.rollout.engine import Engine


@dataclass(frozen=True)
class EngineOptions:
    max_batch_size: int = 64


EngineFactory = Callable[[Path, EngineOptions], Engine]
ENGINES: Registry[EngineFactory] = Registry("engine")


@ENGINES.register("hf")
def _hf_engine(policy_dir: Path, options: EngineOptions) -> Engine:
    from agent_core.io.checkpoints import load_policy
    from agent_core.rollout.hf_engine import HFEngine

    model, tokenizer = load_policy(policy_dir)
    return HFEngine(model, tokenizer, max_batch_size=options.max_batch_size)


def close_engine(engine: Engine) -> None:
    """Engines that own a process (vLLM) expose close(); in-process ones need nothing."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()
