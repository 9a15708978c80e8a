"""After each iteration: its cost ledger, the stages' recorded seconds priced by the run's `cost:`
section (agent_core/io/ledger.py, README "What a run cost")."""

from __future__ import annotations

import os

from agent_core.config import PipelineConfig
from agent_core.devices import resolve_device
from agent_core.io.layout import RunLayout
from agent_core.io.ledger import DeviceUse, ledger_rows, ledger_uri
from agent_core.io.tables import rows_of, write_table
from tasks._common import stage_task


def device_use(setting: str) -> DeviceUse:
    """The run's device as a bill counts it: one GPU where it is CUDA (this process trains and
    generates on one), else the CPU cores this process may run on."""
    if resolve_device(setting).type == "cuda":
        return DeviceUse("cuda", 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return DeviceUse("cpu", max(1, cores))


@stage_task(name="record_ledger")
def record_ledger(run: RunLayout, iteration: int, config: PipelineConfig) -> str:
    """Write iteration `iteration`'s `ledger` table (rewritten whole on a rerun: it only copies what the
    stages' manifests hold); its URI."""
    rows = ledger_rows(run, iteration, config.algorithm.estimator, device_use(config.device), config.cost)
    return write_table("ledger", rows_of(rows, run_id=run.run_id, iteration=iteration), ledger_uri(run, iteration))
