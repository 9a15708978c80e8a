"""Pipeline configuration: frozen pydantic models loaded from YAML (docs/architecture.md §4).

One module per section (data, policy, rollout, reward, algorithm, trainer, critic, warm_start,
dev_eval, tracking, runtime, checkpoints, cluster, audit, cost), the whole run's model in `pipeline`, and loading (unknown keys,
moved keys, `--set` overrides) in `loading`; every public name is re-exported here, so callers
import from `agent_core.config`. docs/config.md is generated from these models.

Every section is `extra="forbid"`, and an unknown key anywhere fails at load time with the list of
valid keys at that level. Names of swappable parts (engine, scorer, estimator, ...) are checked
against their registries by `agent_core.validation.check_names`, which every loader of a run's
config calls once plugins are loaded (the registries live in the modules above this one, which
this package does not import), so a typo never survives to the middle of a run.
"""

from __future__ import annotations

from agent_core.config._base import Section
from agent_core.config.algorithm import AlgorithmConfig
from agent_core.config.audit import BOUND_KEYS, AuditConfig, CheckBounds, UserCheck
from agent_core.config.checkpoints import CheckpointsConfig
from agent_core.config.cluster import ClusterConfig
from agent_core.config.cost import CostConfig
from agent_core.config.critic import CriticConfig
from agent_core.config.data import DataConfig
from agent_core.config.dev_eval import DevEvalConfig
from agent_core.config.loading import MOVED_KEYS, apply_overrides, parse_config
from agent_core.config.pipeline import PipelineConfig
from agent_core.config.policy import PolicyConfig, PolicyLoraConfig
from agent_core.config.reward import RewardConfig
from agent_core.config.rollout import HFEngineConfig, RolloutConfig, VLLMConfig
from agent_core.config.runtime import RuntimeConfig
from agent_core.config.tracking import TrackingConfig
from agent_core.config.trainer import TrainerConfig
from agent_core.config.warm_start import WarmStartConfig
from agent_core.config_errors import ConfigError  # re-exported: callers catch it from here

__all__ = [
    "AlgorithmConfig", "AuditConfig", "BOUND_KEYS", "CheckBounds", "CheckpointsConfig", "ClusterConfig", "ConfigError", "CostConfig",
    "CriticConfig", "DataConfig", "DevEvalConfig", "HFEngineConfig", "MOVED_KEYS", "PipelineConfig", "PolicyConfig",
    "PolicyLoraConfig", "RewardConfig", "RolloutConfig", "RuntimeConfig", "Section", "TrackingConfig", "TrainerConfig",
    "UserCheck",
    "VLLMConfig",
    "WarmStartConfig", "apply_overrides", "parse_config",
]
