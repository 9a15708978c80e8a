"""Progress of the long loops (rollout and eval episodes, training micro-batches), for whoever listens.

A loop calls `report(...)` as work finishes; a stage that wants to show it installs a reporter
around the call (`reporting_to`, which `tasks._common.stage_progress` uses): a tqdm bar on a
terminal, a log line every few seconds otherwise (a Prefect worker's log, CI). With no reporter
installed `report` is a context-variable lookup, so library calls and tests pay nothing.

The reporter is found through a `ContextVar` rather than passed down as an argument: the loops sit
several calls below the stage (a registered eval method calls the agent loop, the trainer's update
calls the micro-batch loop), and their signatures are the library's API. Every `report` runs on
the thread that called the loop (the agent loop's scheduler and the trainer both run there).
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol, TextIO

Stat = float | int | str


class ProgressReporter(Protocol):
    def update(self, advance: int, total: int | None, stats: Mapping[str, Stat]) -> None: ...

    def close(self) -> None: ...


_reporter: ContextVar[ProgressReporter | None] = ContextVar("agentr1_progress_reporter", default=None)


def report(advance: int = 1, *, total: int | None = None, **stats: Stat) -> None:
    """`advance` more units done (of `total`, if known), with the latest `stats` (e.g. loss=0.12): a
    reporter shows each stat's last value, so `report(0, loss=...)` updates a stat without counting."""
    reporter = _reporter.get()
    if reporter is not None:
        reporter.update(advance, total, stats)


@contextmanager
def reporting_to(reporter: ProgressReporter) -> Iterator[ProgressReporter]:
    """Send every `report` made inside the block (on this thread) to `reporter`; close it after."""
    token = _reporter.set(reporter)
    try:
        yield reporter
    finally:
        _reporter.reset(token)
        reporter.close()


def _format_stats(stats: Mapping[str, Stat]) -> str:
    return ", ".join(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                     for key, value in stats.items() if not (isinstance(value, float) and math.isnan(value)))


class LogReporter:
    """At most one log line per `every_s` seconds: `rollout iteration 0: 40/96 episodes, tokens/s 512`."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter, description: str, unit: str,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.log, self.description, self.unit, self.every_s, self.clock = log, description, unit, every_s, clock
        self.done, self.last_line = 0, clock()
        self.stats: dict[str, Stat] = {}

    def update(self, advance: int, total: int | None, stats: Mapping[str, Stat]) -> None:
        self.done += advance
        self.stats.update(stats)
        now = self.clock()
        if now - self.last_line >= self.every_s:
            self.last_line = now
            count = f"{self.done}/{total}" if total else str(self.done)
            extra = _format_stats(self.stats)
            self.log.info("%s: %s %s%s", self.description, count, self.unit, f", {extra}" if extra else "")

    def close(self) -> None:
        pass


class BarReporter:
    """A tqdm bar on `stream` (stderr), kept when done so the terminal shows what each stage did."""

    def __init__(self, description: str, unit: str, stream: TextIO | None = None):
        from tqdm import tqdm  # only where a bar is drawn

        # a pseudo-terminal without a size (`script`, some CI runners) reports 0 columns and 0 rows,
        # where tqdm draws nothing at all: fall back to 100 x 20
        size = shutil.get_terminal_size((100, 20))
        self.bar = tqdm(desc=description, unit=f" {unit}", file=stream or sys.stderr, ncols=size.columns or 100,
                        nrows=size.lines or 20, mininterval=0.5, leave=True)
        self.stats: dict[str, Stat] = {}

    def update(self, advance: int, total: int | None, stats: Mapping[str, Stat]) -> None:
        if total is not None and self.bar.total != total:
            self.bar.total = total
        self.stats.update(stats)
        self.bar.set_postfix_str(_format_stats(self.stats), refresh=False)
        self.bar.update(advance)

    def close(self) -> None:
        self.bar.close()
