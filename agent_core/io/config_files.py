"""Reading and writing pipeline configs as YAML files.

`read_config` parses and validates the files (keys, types, ranges) but does not check registry
names, which needs the modules above io: a config for a run is loaded with
`agent_core.validation.load_config`, which reads it here and then checks its names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from agent_core.config import ConfigError, PipelineConfig, apply_overrides, parse_config
from agent_core.io.atomic import write_text_atomic
from agent_core.safe_yaml import YamlLimitError, load_yaml


def read_config(paths: str | Path | Sequence[str | Path] | None = None,
                overrides: list[str] | None = None) -> PipelineConfig:
    """Read YAML configs and apply `a.b=v` overrides; the embedded defaults fill what is not set.

    Several files are merged in order, section by section, a later file winning key by key: e.g.
    `configs/tiny.yaml` then `configs/algos/ppo.yaml` is the tiny model trained with PPO.
    """
    data: dict[str, Any] = {}
    for path in _paths(paths):
        data = _merge(data, _read(path))
    data = apply_overrides(data, overrides or [])
    return parse_config(data, source=config_source(paths), overrides=overrides)


def config_source(paths: str | Path | Sequence[str | Path] | None) -> str:
    """How errors name the config read from `paths`: the files joined by " + ", or "config"."""
    return " + ".join(map(str, _paths(paths))) or "config"


def _paths(paths: str | Path | Sequence[str | Path] | None) -> list[Path]:
    if paths is None:
        return []
    return [Path(paths)] if isinstance(paths, (str, Path)) else list(map(Path, paths))


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = load_yaml(path.read_text(), str(path))
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error(path, error)) from None
    except YamlLimitError as error:  # an alias bomb, nesting, a 10,000-digit number
        raise ConfigError(str(error)) from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return loaded or {}


def _yaml_error(path: Path, error: yaml.YAMLError) -> str:
    """`file:line:column: not valid YAML: <problem> (<context>)` on one line; PyYAML's own message
    spans several lines (the marks and a snippet of the file)."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    detail = f"{problem} ({context})" if context else problem
    return f"{where}: not valid YAML: {detail}; fix the file at that line and column"


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
    write_text_atomic(path, config.to_yaml())
    return path
