"""Reading and writing pipeline configs as YAML files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agent_core.config import ConfigError, PipelineConfig, apply_overrides, build_config


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load a YAML config (the embedded defaults when `path` is None) and apply `a.b=v` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    return build_config(data, source=str(path) if path else "config")


def save_config(config: PipelineConfig, path: Path) -> Path:
    """Write the resolved config next to the run's tables (atomically, like every output)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(config.to_yaml())
    tmp.replace(path)
    return path
