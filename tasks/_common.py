"""What the stage tasks share: the task decorator, a logger that works in and out of a run, the
resume check (io/manifests.py); and the helpers more than one stage uses (a prepared dataset's
tables, reward labelling of a steps table). Stage modules never import each
other, only this module, so a stage can change without reaching into another."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

from agent_core.config import RewardConfig
from agent_core.data.rows import prompts_from_table, row_to_document
from agent_core.failpoints import failpoint
from agent_core.io.manifests import StageRecord
from agent_core.io.tables import read_table, write_table
from agent_core.progress import BarReporter, LogReporter, reporting_to
from agent_core.rewards.labelling import RewardRecord, StepOutcome, label_steps
from agent_core.types import Document, Prompt

# Stages skip or redo work by their manifests (`completed_outputs`), not through Prefect's result
# cache: its cache keys would hash configs and paths, not what the inputs hold.
stage_task = partial(task, cache_policy=NO_CACHE, persist_result=False)


def stage_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow/task run (shown in the UI), a plain logger outside."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(f"tasks.{name}")


# The library's own INFO lines (the agent loop's summary, engine start-up) belong in a stage's log;
# left at the root's WARNING they were silently dropped.
if logging.getLogger("agent_core").level == logging.NOTSET:
    logging.getLogger("agent_core").setLevel(logging.INFO)

PROGRESS_ENV = "AGENTR1_PROGRESS"  # auto (default), bar, log or off
PROGRESS_MODES = ("auto", "bar", "log", "off")
PROGRESS_LOG_EVERY_S = 10.0


def progress_mode() -> str:
    """bar on a terminal, log lines otherwise (a worker, CI, a file); $AGENTR1_PROGRESS overrides."""
    mode = os.environ.get(PROGRESS_ENV, "auto").strip().lower() or "auto"
    if mode not in PROGRESS_MODES:
        raise ValueError(f"${PROGRESS_ENV}={mode!r}; valid: {', '.join(PROGRESS_MODES)}")
    if mode == "auto":
        return "bar" if sys.stderr.isatty() else "log"
    return mode


@contextmanager
def stage_progress(name: str, description: str, unit: str) -> Iterator[None]:
    """Show the progress the library reports inside the block (agent_core.progress) as `description`."""
    mode = progress_mode()
    if mode == "off":
        yield
        return
    reporter = (BarReporter(description, unit) if mode == "bar"
                else LogReporter(stage_logger(name), description, unit, every_s=PROGRESS_LOG_EVERY_S))
    with reporting_to(reporter):
        yield


def completed_outputs(record: StageRecord, resume: bool, what: str) -> dict[str, str] | None:
    """The outputs of `record`'s stage if it already completed with the same inputs and settings
    and its outputs are still as it wrote them (logged as skipped), else None: the stage must run (a
    warning names outputs damaged since). resume=False (an explicit rerun) always runs."""
    if not resume:
        return None
    check = record.check()
    log = stage_logger(record.stage)
    if check.outputs is None:
        if check.damaged:  # outside damage (a truncated table, a deleted checkpoint): say what is redone and why
            log.warning("%s: redoing the stage, its outputs are missing or damaged since it completed: %s",
                        what, "; ".join(check.damaged))
        failpoint(f"stage:{record.stage}:start")
    else:
        log.info("%s: already complete with these inputs and settings, skipped (%s)", what, record.path)
    return check.outputs


# ---- a prepared dataset's tables (prepare_data writes them) ------------------------------------


@dataclass(frozen=True)
class DatasetUris:
    dataset_id: str
    prompts_uri: str
    corpus_uri: str


def read_corpus(corpus_uri: str) -> list[Document]:
    """The search corpus of a prepared dataset, in table order."""
    return [row_to_document(row) for row in read_table("corpus", corpus_uri).to_pylist()]


def split_prompts(dataset: DatasetUris, split: str, limit: int | None = None) -> list[Prompt]:
    """The split's prompts in dataset order, the first `limit` of them if given; their envs are
    checked, so a bad row fails naming the file and the row before an evaluation starts."""
    table = read_table("dataset_prompts", dataset.prompts_uri)
    splits = table.column("split").to_pylist()
    chosen = [index for index, name in enumerate(splits) if name == split]
    if not chosen:
        raise ValueError(f"{dataset.prompts_uri}: no prompts with split {split!r}; "
                         f"splits there: {', '.join(sorted(set(splits)))}")
    return prompts_from_table("dataset_prompts", table.take(chosen[:limit]), dataset.prompts_uri)


# ---- reward labelling of a steps table (label_rewards, the warm start's oracle episodes) ----------


_STEP_FIELDS = [f.name for f in dataclasses.fields(StepOutcome)]


def label_steps_table(steps_uri: str, answers: dict[str, list[str]], cfg: RewardConfig, run_id: str,
                      iteration: int, rewards_uri: str) -> list[RewardRecord]:
    """Label the steps table at `steps_uri` against `answers` (prompt id -> gold answers) and write
    the rewards table `rewards_uri`; the records, for logging."""
    steps = read_table("steps", steps_uri).select(_STEP_FIELDS).to_pylist()
    records = label_steps([StepOutcome(**row) for row in steps], answers, scorer=cfg.scorer,
                          format_weight=cfg.format_weight, process_weight=cfg.process_weight,
                          process_norm=cfg.process_norm)
    rows = [{"run_id": run_id, "iteration": iteration, **dataclasses.asdict(r)} for r in records]
    write_table("rewards", rows, rewards_uri)
    return records
