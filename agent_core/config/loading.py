"""Loading a config: unknown keys listed (and where a moved key went), `--set` overrides, validation."""

from __future__ import annotations

import json
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from agent_core.config.pipeline import PipelineConfig
from agent_core.config_errors import ConfigError, Problem, config_error, validation_problems


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
