"""`PipelineConfig`: a whole run, one field per section (loading it: agent_core/config/loading.py)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from agent_core.config._base import Section
from agent_core.config.algorithm import AlgorithmConfig
from agent_core.config.audit import AuditConfig
from agent_core.config.checkpoints import CheckpointsConfig
from agent_core.config.cluster import ClusterConfig
from agent_core.config.cost import CostConfig
from agent_core.config.critic import CriticConfig
from agent_core.config.data import DataConfig
from agent_core.config.dev_eval import DevEvalConfig
from agent_core.config.policy import PolicyConfig
from agent_core.config.reward import RewardConfig
from agent_core.config.rollout import RolloutConfig
from agent_core.config.runtime import RuntimeConfig
from agent_core.config.tracking import TrackingConfig
from agent_core.config.trainer import TrainerConfig
from agent_core.config.warm_start import WarmStartConfig
from agent_core.plugins import PluginError, load_plugins


class PipelineConfig(Section):
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
    critic: CriticConfig = CriticConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    dev_eval: DevEvalConfig = DevEvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    checkpoints: CheckpointsConfig = Field(CheckpointsConfig(), description="which iterations' checkpoints and "
                                           "optimizer states a run keeps, and the free space it needs before writing")
    cluster: ClusterConfig = ClusterConfig()
    audit: AuditConfig = Field(AuditConfig(), description="behaviour health checks after each iteration "
                               "(agent_core/config/audit.py)")
    cost: CostConfig = Field(CostConfig(), description="prices per device-hour for the costs view "
                             "(agent_core/config/cost.py)")

    @model_validator(mode="before")
    @classmethod
    def _load_plugins_first(cls, data: Any) -> Any:
        """Plugins register the names the other sections may use, so they load whenever a config is
        validated (also when Prefect validates a deployment's parameters in a worker), before
        `agent_core.validation.check_names` looks those names up."""
        plugins = data.get("plugins") if isinstance(data, dict) else None
        if plugins:
            if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
                raise _plugins_error(cls, plugins, f"plugins must be a list of module names, got {plugins!r}")
            try:
                load_plugins(plugins)
            except PluginError as error:
                raise _plugins_error(cls, plugins, str(error)) from None
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


def _plugins_error(model: type, plugins: Any, message: str) -> ValidationError:
    """An error at the key `plugins` (a ValueError raised by a model validator has no key, so the
    error was blamed on the config file even when `--set plugins=[...]` set the bad name)."""
    details = InitErrorDetails(type=PydanticCustomError("plugins", message), loc=("plugins",), input=plugins)
    return ValidationError.from_exception_data(model.__name__, [details])
