"""docs/config.md, the config reference, generated from the config models (agent_core/config/).

Every key of `PipelineConfig`, section by section: dotted name, type, default, valid choices
(Literal values, ranges, and the registered names of swappable parts) and its description. The
page is generated, never edited: `python -m flows.config_reference` rewrites it, `--check` exits 1
when it is stale (tests/test_config_reference.py runs the same comparison).

Registered names are the built-in ones (items defined under agent_core): plugins add their own at
run time, and a page that listed them would depend on what the generating process had imported.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from agent_core.algos.estimator_core import ADVANTAGE_ESTIMATORS
from agent_core.algos.kl import KL_ESTIMATORS
from agent_core.algos.losses import LOSS_AGG_MODES, POLICY_LOSSES
from agent_core.audit.checks import BUILTIN_NAMES
from agent_core.config import MOVED_KEYS, PipelineConfig
from agent_core.envs.registry import ENVS
from agent_core.registry import Registry
from agent_core.rewards.scorers import SCORERS
from agent_core.rollout.engines import ENGINES
from agent_core.training.objectives import TRAINING_OBJECTIVES

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "python -m flows.config_reference"

# The keys that name a registered part: the registries agent_core.validation.check_names checks
# them against (tests/test_config_reference.py checks this table against check_names itself).
REGISTERED: dict[str, Registry[Any]] = {
    "rollout.engine": ENGINES,
    "rollout.env": ENVS,
    "reward.scorer": SCORERS,
    "algorithm.estimator": ADVANTAGE_ESTIMATORS,
    "algorithm.kl_estimator": KL_ESTIMATORS,
    "trainer.loss_agg_mode": LOSS_AGG_MODES,
    "trainer.policy_loss": POLICY_LOSSES,
    "trainer.objective": TRAINING_OBJECTIVES,
}

# Keys of a mapping or a list of models: the model's keys are documented under `<key>.<name>.` / `<key>[].`
_MAPPING_KEYS = {"audit.thresholds": "<check>"}

_BOUNDS = ((annotated_types.Ge, "ge", "≥"), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "≤"),
           (annotated_types.Lt, "lt", "<"))


@dataclass(frozen=True)
class Key:
    """One documented key: its dotted name and its field."""

    name: str
    field: FieldInfo


@dataclass(frozen=True)
class Section:
    """One model's keys under a dotted prefix, with the model's docstring."""

    prefix: str
    model: type[BaseModel]
    keys: tuple[Key, ...]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field (`X`, `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a `dict[str, X]` or `list[X]` field's items, else None."""
    if get_origin(annotation) in (dict, list):
        return _model_in(get_args(annotation)[-1])
    return None


def sections(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[Section]:
    """Every model reachable from `model`, depth first, each with its own (non-section) keys."""
    keys: list[Key] = []
    nested: list[Section] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        section = _model_in(field.annotation)
        item = _item_model(field.annotation)
        if section is not None:
            nested += sections(section, f"{dotted}.")
            continue
        keys.append(Key(dotted, field))
        if item is not None:
            below = f"{dotted}.{_MAPPING_KEYS[dotted]}." if dotted in _MAPPING_KEYS else f"{dotted}[]."
            nested += sections(item, below)
    return [Section(prefix, model, tuple(keys)), *nested]


def all_keys() -> list[Key]:
    """Every documented key, in page order."""
    return [key for section in sections() for key in section.keys]


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " or ".join(sorted({type(value).__name__ for value in args}))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in args if arg is not type(None)) + (
            " or null" if type(None) in args else "")
    if origin in (tuple, list):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    return getattr(annotation, "__name__", str(annotation))


def _literal_values(annotation: Any) -> list[Any]:
    """The Literal values anywhere in `annotation` (a union or an Annotated wrapper included)."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [value for arg in get_args(annotation) for value in _literal_values(arg)]


def _builtin_names(registry: Registry[Any]) -> list[str]:
    return [name for name in registry.names() if getattr(registry.get(name), "__module__", "").startswith("agent_core")]


def choices(key: Key) -> str:
    """Valid values beyond the type: Literal values, registered names, numeric bounds, a pattern."""
    parts = []
    literals = _literal_values(key.field.annotation)
    if literals:  # a mapping's Literal values are its keys (data.files)
        keys = "keys: " if get_origin(key.field.annotation) is dict else ""
        parts.append(keys + ", ".join(f"`{value}`" for value in literals))
    if key.name in REGISTERED:
        names = ", ".join(f"`{name}`" for name in _builtin_names(REGISTERED[key.name]))
        parts.append(f"{names} (or a plugin's {REGISTERED[key.name].kind})")
    if key.name in _MAPPING_KEYS:
        parts.append("keys: " + ", ".join(f"`{name}`" for name in BUILTIN_NAMES))
    for constraint in key.field.metadata:
        for kind, attribute, sign in _BOUNDS:
            if isinstance(constraint, kind):
                parts.append(f"{sign} {getattr(constraint, attribute)}")
        pattern = getattr(constraint, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
        for attribute, sign in (("min_length", "≥"), ("max_length", "≤")):
            if getattr(constraint, attribute, None) is not None:
                parts.append(f"length {sign} {getattr(constraint, attribute)}")
    return "; ".join(parts)


def default(key: Key) -> str:
    if key.field.is_required():
        return "(required)"
    value = key.field.get_default(call_default_factory=True)
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _intro(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    return inspect.cleandoc(doc) if doc else ""


def _section_lines(section: Section) -> list[str]:
    title = section.prefix.rstrip(".") or "top level"
    lines = [f"## `{title}`" if section.prefix else f"## {title}", ""]
    intro = _intro(section.model)
    if intro:
        lines += [intro, ""]
    lines += ["| key | type | default | choices | description |", "|---|---|---|---|---|"]
    for key in section.keys:
        lines.append(f"| `{key.name}` | {_cell(_type_name(key.field.annotation))} | {_cell(default(key))} | "
                     f"{_cell(choices(key))} | {_cell(key.field.description or '')} |")
    return lines + [""]


def render() -> str:
    """The whole page."""
    every = sections()
    count = sum(len(section.keys) for section in every)
    lines = [
        "# Config reference",
        "",
        f"<!-- Generated by `{COMMAND}` from agent_core/config/; do not edit by hand. -->",
        "",
        f"Every key of a pipeline config ({count} keys), section by section. A config is YAML "
        "(`configs/demo.yaml`); `--set section.key=value` overrides one key; an unknown key fails at load "
        "time with the valid keys listed. Registered names are the built-in ones; a config's `plugins` "
        "register more.",
        "",
    ]
    for section in every:
        lines += _section_lines(section)
    lines += ["## Moved keys", "", "An old config that sets one of these keys still loads: the value is read as "
              "its new key, with a warning naming the new place; setting both the old and the new key is an "
              "error.", "", "| old key | now |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in sorted(MOVED_KEYS.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the models")
    parser.add_argument("--path", type=Path, default=PAGE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = args.path.read_text() if args.path.is_file() else ""
        if current != page:
            print(f"{args.path.name} is stale: run `{COMMAND}` to regenerate it", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(page)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
