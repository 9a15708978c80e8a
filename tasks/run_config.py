"""The run's resolved config, kept beside its tables so single stages can be rerun later; and the
run's writer lock, taken by every flow that writes into a run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from agent_core.config import PipelineConfig
from agent_core.io import background
from agent_core.io.config_files import save_config
from agent_core.io.layout import RunLayout
from agent_core.io.locks import run_lock, sweep_temporaries
from agent_core.io.manifests import commits_made
from agent_core.io.run_status import record_run_end, record_run_failure
from agent_core.validation import load_config
from tasks._common import stage_logger, stage_task


@contextmanager
def writing_run(run: RunLayout) -> Iterator[RunLayout]:
    """Hold the run's lock while the block writes into it (a second writer fails at once, naming the
    first one's pid), after removing what a killed earlier writer left half-written, and until the
    block's background writes (runtime.background_save) are done too."""
    with run_lock(run.lock_path, run.run_id):
        removed = sweep_temporaries(run.run_dir)
        if removed:
            stage_logger("resume").info("run %s: removed %d unfinished temporaries of an interrupted writer: %s",
                                        run.run_id, len(removed), ", ".join(str(p) for p in removed[:5]))
        try:
            yield run
        except BaseException:
            background.wait_quietly()
            raise
        background.wait()


@dataclass
class RunEnd:
    """How a block that does not raise ends: finished, or stopped early with a reason (audit.on_alert: stop)."""

    status: str = "finished"
    detail: str | None = None

    def stop(self, reason: str) -> None:
        self.status, self.detail = "stopped", reason


@contextmanager
def recording_end(run: RunLayout) -> Iterator[RunEnd]:
    """Record how the block ended in the run's status: finished, or failed with its error (`agentr1
    runs` shows it); a process killed inside the block records nothing, which reads as killed. Writes
    still running on the background thread (runtime.background_save) belong to the run: they finish first.
    A finished run that the block fails on without committing a stage stays finished (io/run_status.py)."""
    committed_before = commits_made()
    end = RunEnd()
    try:
        yield end
        background.wait()
    except Exception as error:
        background.wait_quietly()  # what was submitted is complete work; the block's error is the one to raise
        first_line = (str(error).splitlines() or [""])[0]
        detail = f"{type(error).__name__}: {first_line}"
        if record_run_failure(run, detail, commits_made() - committed_before) == "finished":
            stage_logger("resume").warning("run %s stays finished: this command changed none of its stages "
                                           "before it failed (%s)", run.run_id, detail)
        raise
    record_run_end(run, end.status, end.detail)


@stage_task(name="record_config")
def record_config(run: RunLayout, config: PipelineConfig) -> str:
    return str(save_config(config, run.config_path))


@stage_task(name="load_run_config")
def load_run_config(run: RunLayout, overrides: list[str]) -> PipelineConfig:
    if not run.config_path.is_file():
        raise FileNotFoundError(f"run {run.run_id!r} has no config at {run.config_path}: is the run id right?")
    return load_config(run.config_path, overrides)
