"""Configs by name and a run's recorded config, found without Prefect: the `agentr1` command calls
these before Prefect is configured (bad input fails in one line), the deployments' flows call them too."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command imports this module first thing: nothing heavy at import
    from agent_core.config import PipelineConfig
    from agent_core.io.layout import RunLayout

# The top-level configs/ folder ships in the wheel as the package flows.configs (pyproject.toml).
SHIPPED_CONFIGS_PACKAGE = "flows.configs"


def shipped_configs_dir() -> Path | None:
    """Where the shipped configs are: flows/configs/ of an installed wheel, the checkout's configs/
    for an editable install or a source checkout (flows/ next to configs/); None if neither."""
    try:
        spec = importlib.util.find_spec(SHIPPED_CONFIGS_PACKAGE)
    except ImportError:
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    checkout = Path(__file__).resolve().parent.parent / "configs"
    return checkout if checkout.is_dir() else None


def shipped_configs() -> dict[str, Path]:
    """Shipped configs by name: the path below the configs folder without `.yaml` (`tiny`, `algos/ppo`)."""
    folder = shipped_configs_dir()
    if folder is None:
        return {}
    return {path.relative_to(folder).with_suffix("").as_posix(): path for path in sorted(folder.rglob("*.yaml"))}


def resolve_config(name: str) -> str:
    """A config argument as a file path: an existing file as given; else a shipped config named
    `tiny`, `tiny.yaml`, `algos/ppo` or `configs/tiny.yaml` (the checkout's spelling, which then also
    works outside the checkout); else unchanged (the loader reports the missing file)."""
    if Path(name).is_file():
        return name
    key = name.removeprefix("configs/").removesuffix(".yaml")
    shipped = shipped_configs()
    if key in shipped:
        print(f"agentr1: using the shipped config {key!r} ({shipped[key]})", flush=True)
        return str(shipped[key])
    if shipped and "/" not in name.removeprefix("configs/") and not name.endswith((".yaml", ".yml")):
        raise FileNotFoundError(f"config {name!r}: no such file and no shipped config of that name; shipped: "
                                f"{', '.join(shipped)} (`agentr1 configs` lists them with their paths)")
    return name


def recorded_config(data_root: str | Path, run_id: str) -> tuple[RunLayout, PipelineConfig]:
    """A run and the config it recorded (runs/<id>/config.yaml), with `data_root` as given (a run
    moved to another folder still reads its tables); FileNotFoundError if the run has none."""
    from agent_core.io.layout import DataRoot
    from agent_core.validation import load_config

    run = DataRoot(Path(data_root)).run(run_id)
    if not run.config_path.is_file():
        raise FileNotFoundError(f"run {run_id!r} has no config at {run.config_path}: is the run id right?")
    return run, load_config(run.config_path, [f"data_root={data_root}"])
