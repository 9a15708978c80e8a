"""PPOSettings mirrors the config: from_config wires every mirrored key, and no default drifts
from the config's unless PPOSettings' docstring says why (LIBRARY_DEFAULTS)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import pytest

from agent_core.config import PipelineConfig
from agent_core.training.objectives import TRAINING_OBJECTIVES
from agent_core.training.settings import PPOSettings

# PPOSettings field -> the config key it mirrors, and a valid non-default value of that key.
MIRRORED: dict[str, tuple[str, Any]] = {
    "epochs": ("trainer.epochs", 3),
    "mini_batches": ("trainer.mini_batches", 5),
    "clip_low": ("trainer.clip_low", 0.1),
    "clip_high": ("trainer.clip_high", 0.3),
    "dual_clip": ("trainer.dual_clip", 3.0),
    "policy_loss": ("trainer.policy_loss", "gspo"),
    "objective": ("trainer.objective", "second"),
    "objective_options": ("trainer.objective_options", {"steps": 2}),
    "entropy_coef": ("trainer.entropy_coef", 0.01),
    "kl_coef": ("algorithm.kl_coef", 0.05),
    "kl_estimator": ("algorithm.kl_estimator", "k1"),
    "value_clip": ("critic.value_clip", 0.5),
    "max_grad_norm": ("trainer.max_grad_norm", 0.5),
    "micro_batch_tokens": ("trainer.micro_batch_tokens", 512),
    "max_logit_elements": ("trainer.micro_batch_logits", 2**20),
    "temperature": ("rollout.temperature", 0.7),
    "agg_mode": ("trainer.loss_agg_mode", "seq-mean-token-mean"),
    "use_loss_mask": ("algorithm.use_loss_mask", False),
    "use_advantage_mask": ("algorithm.use_advantage_mask", False),
    "recompute_old_logprobs": ("trainer.recompute_old_logprobs", True),
    "activation_checkpointing": ("trainer.activation_checkpointing", True),
    "precision": ("trainer.precision", "bf16"),
}
NOT_IN_CONFIG = {"vf_coef", "norm_length"}
# Built from a config key, not copied: the policy loss's settings object from trainer.policy_loss_options
# (tests/test_algorithm_plugins.py follows one into the loss).
BUILT = {"policy_loss_options"}
# Defaults that legitimately differ from the config's; PPOSettings' docstring explains each.
LIBRARY_DEFAULTS = {"mini_batches": 1, "micro_batch_tokens": 4096, "precision": "fp32"}


@pytest.fixture(autouse=True)
def _a_second_objective():
    """trainer.objective has one built-in; a second name lets the key take a non-default value."""
    with TRAINING_OBJECTIVES.scoped():
        TRAINING_OBJECTIVES.register("second")(lambda *args, **kwargs: [])
        yield


def _config_value(config: PipelineConfig, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _from(config: PipelineConfig) -> PPOSettings:
    return PPOSettings.from_config(config.trainer, config.algorithm, config.rollout.temperature, config.critic)


def test_every_field_is_mirrored_or_declared_configless():
    names = {field.name for field in fields(PPOSettings)}
    assert names == set(MIRRORED) | NOT_IN_CONFIG | BUILT, "a PPOSettings field was added or removed: list it in MIRRORED"


def test_a_loss_without_a_settings_model_gets_no_options_object():
    assert _from(PipelineConfig()).policy_loss_options is None and PPOSettings().policy_loss_options is None


def test_settings_from_the_default_config_equal_the_config_defaults():
    config = PipelineConfig()
    built = _from(config)
    for name, (key, _) in MIRRORED.items():
        assert getattr(built, name) == _config_value(config, key), f"PPOSettings.{name} != {key} from a default config"


def test_bare_defaults_equal_the_config_defaults_except_the_documented_ones():
    config, bare = PipelineConfig(), PPOSettings()
    differing = {name: getattr(bare, name) for name, (key, _) in MIRRORED.items()
                 if getattr(bare, name) != _config_value(config, key)}
    assert differing == LIBRARY_DEFAULTS, (
        "PPOSettings defaults drifted from the config's: align them, or list the difference in LIBRARY_DEFAULTS "
        "and say why in PPOSettings' docstring")
    doc = " ".join((PPOSettings.__doc__ or "").split())
    for name, value in LIBRARY_DEFAULTS.items():
        assert f"{name} {json.dumps(value)}" in doc, f"PPOSettings' docstring does not explain its {name} default"


@pytest.mark.parametrize("name", sorted(MIRRORED))
def test_each_mirrored_key_reaches_its_field(name):
    key, value = MIRRORED[name]
    config = PipelineConfig.model_validate(_set(PipelineConfig().model_dump(), key, value))
    assert _config_value(config, key) == value != _config_value(PipelineConfig(), key)
    assert getattr(_from(config), name) == value, f"{key}={value!r} did not reach PPOSettings.{name}"


def test_a_kl_in_the_reward_is_no_loss_term():
    config = PipelineConfig.model_validate(
        _set(_set(PipelineConfig().model_dump(), "algorithm.kl_coef", 0.05), "algorithm.kl_in_reward", True))
    assert _from(config).kl_coef == 0.0


def _set(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    section, leaf = key.split(".")
    return {**data, section: {**data[section], leaf: value}}
