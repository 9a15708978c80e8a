"""The run's resolved config, kept beside its tables so single stages can be rerun later."""

from __future__ import annotations

from agent_core.config import PipelineConfig
from agent_core.io.configs import load_config, save_config
from agent_core.io.layout import RunLayout
from tasks._common import stage_task


@stage_task(name="record_config")
def record_config(run: RunLayout, config: PipelineConfig) -> str:
    return str(save_config(config, run.config_path))


@stage_task(name="load_run_config")
def load_run_config(run: RunLayout, overrides: list[str]) -> PipelineConfig:
    if not run.config_path.is_file():
        raise FileNotFoundError(f"run {run.run_id!r} has no config at {run.config_path}: is the run id right?")
    return load_config(run.config_path, overrides)
