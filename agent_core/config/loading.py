"""Loading a config: moved keys read at their new place, unknown keys listed, `--set` overrides,
validation."""

from __future__ import annotations

import json
import logging
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from agent_core.config.pipeline import PipelineConfig
from agent_core.config_errors import ConfigError, Problem, config_error, validation_problems
from agent_core.safe_yaml import YamlLimitError, load_yaml


log = logging.getLogger(__name__)

# Keys that moved: old -> new. An old key still loads, read as its new one, with a warning naming
# the new place (docs/config.md lists them); setting both is an error.
MOVED_KEYS = {
    "algorithm.process_reward_weight": "reward.process_weight",  # rewards are combined once, at labelling
    "algorithm.process_reward_norm": "reward.process_norm",
    "trainer.max_staleness": "runtime.max_staleness",  # runtime switches: how, not what, a run computes
    "trainer.keep_policy_in_memory": "runtime.keep_policy_in_memory",
    "trainer.background_save": "runtime.background_save",
    "trainer.critic_lr": "critic.lr",  # the critic's settings beside each other, out of the policy's
    "trainer.value_clip": "critic.value_clip",
}


def _move_keys(data: dict[str, Any], source: str, overrides: list[str]) -> tuple[dict[str, Any], list[Problem]]:
    """`data` with every old key of MOVED_KEYS at its new place (a copy), and a problem for each
    old key whose new one is set too. The warning names where the old key was set: its `--set`, or
    `source` (a user's YAML, or a run's stored config recorded before the move)."""
    data = json.loads(json.dumps(data))  # deep copy: the caller's dict stays as given
    problems = []
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        section = data.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        new_section, new_key = new.split(".")
        target = data.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # a malformed section: validation names it
        if new_key in target:
            problems.append(Problem(old, f"'{old}' and '{new}' are both set; '{old}' moved to '{new}': keep only '{new}'"))
            continue
        target[new_key] = value
        where = next((f"--set {item}" for item in reversed(overrides) if item.partition("=")[0] == old), source)
        log.warning("config key '%s' (set by %s) moved to '%s'; read as '%s', nothing else changes",
                    old, where, new, new)
    return data, problems


def _check_keys(model: type[BaseModel], data: Any, prefix: str = "") -> list[Problem]:
    """Unknown keys, each with the valid keys at its level listed (pydantic alone does not list them)."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    problems = []
    for key, value in data.items():
        if key not in fields:
            problems.append(Problem(f"{prefix}{key}", f"unknown config key '{prefix}{key}'; valid keys here: "
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
        shown = item if len(item) <= 60 else item[:57] + "..."
        try:
            value = load_yaml(raw, f"override {shown!r}")
        except yaml.YAMLError as error:
            where = getattr(error, "problem", None) or "not valid YAML"
            raise ConfigError(f"override {item!r}: its value is not valid YAML ({where}); quote the whole "
                              "--set for the shell, e.g. --set 'rollout.env_kwargs={tools: [search]}'") from None
        except YamlLimitError as error:  # an alias bomb, nesting, a 10,000-digit number
            raise ConfigError(str(error)) from None
        node[leaf] = value
    return data


def parse_config(data: dict[str, Any], source: str = "config", overrides: list[str] | None = None) -> PipelineConfig:
    """Validate `data` against the config models: keys, types and ranges; plugins are loaded. Registry
    names are not checked here: a config for a run comes from `agent_core.validation`, which does.

    An error names the layer that set the bad value: one of `overrides` (the `--set` items applied to
    `data`), else `source`."""
    data, problems = _move_keys(data, source, overrides or []) if isinstance(data, dict) else (data, [])
    problems += _check_keys(PipelineConfig, data)
    if problems:
        raise config_error(problems, source, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as error:
        raise config_error(validation_problems(error), source, overrides or []) from None
