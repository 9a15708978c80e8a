"""Reading and writing pipeline configs as YAML files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from agent_core.config import ConfigError, PipelineConfig, apply_overrides, build_config
from agent_core.io.atomic import atomic_file


def load_config(paths: str | Path | Sequence[str | Path] | None = None,
                overrides: list[str] | None = None) -> PipelineConfig:
    """Load YAML configs and apply `a.b=v` overrides; the embedded defaults fill what is not set.

    Several files are merged in order, section by section, a later file winning key by key: e.g.
    `configs/tiny.yaml` then `configs/algos/ppo.yaml` is the tiny model trained with PPO.
    """
    if paths is None:
        paths = []
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    data: dict[str, Any] = {}
    for path in map(Path, paths):
        data = _merge(data, _read(path))
    data = apply_overrides(data, overrides or [])
    return build_config(data, source=" + ".join(map(str, paths)) or "config")


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return loaded or {}


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "env_kwargs":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def save_config(config: PipelineConfig, path: Path) -> Path:
    """Write the resolved config next to the run's tables (atomically, like every output)."""
    with atomic_file(path, "w") as sink:
        sink.write(config.to_yaml())
    return path
