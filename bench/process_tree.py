"""Watching a benchmark's process tree: RSS (and PSS) of a command and all its descendants, sampled
from /proc every POLL_S seconds and summed by group (the root's own group, `vllm`, `prefect`,
`other`), with the run's phases to say when a peak happened (bench/memory.py's runs)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import children_map, cmdline, process_tree, pss_bytes, rss_bytes

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
POLL_S = 0.1
PSS_EVERY = 10  # samples between PSS readings (smaps_rollup walks the page tables: dearer than statm)


def classify(command: str) -> str | None:
    """A process's group by its command line (None: not recognised, inherit the parent's)."""
    lowered = command.lower()
    if "vllm" in lowered:
        return "vllm"
    if "prefect" in lowered or "uvicorn" in lowered:
        return "prefect"
    return None


@dataclass
class TreeWatch:
    """RSS samples of a process tree, summed by group (the root's group, vllm, prefect, other)."""

    root: int
    root_group: str
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (unix time, group -> bytes)
    pss_peak: int = 0
    _groups: dict[int, str] = field(default_factory=dict)

    def sample(self) -> int:
        """Take one sample; the tree's summed RSS now."""
        children = children_map()
        totals: dict[str, int] = defaultdict(int)
        todo, pids = [(self.root, self.root_group)], []
        while todo:
            pid, inherited = todo.pop()
            if pid == self.root:
                group = self.root_group
            elif pid in self._groups:
                group = self._groups[pid]
            else:  # a fresh fork shows its parent's command line until it execs: only a match is kept
                group = classify(cmdline(pid))
                if group is not None:
                    self._groups[pid] = group
                group = group or inherited
            totals[group] += rss_bytes(pid)
            pids.append(pid)
            todo += [(child, group if group != self.root_group else "other") for child in children.get(pid, [])]
        if len(self.samples) % PSS_EVERY == 0:
            self.pss_peak = max(self.pss_peak, sum(pss_bytes(pid) for pid in pids))
        self.samples.append((time.time(), dict(totals)))
        return sum(totals.values())

    def peak(self, start: float = -math.inf, end: float = math.inf, group: str | None = None) -> dict:
        """The sample in [start, end] with the largest total (or the largest `group`): its time,
        total and per-group GiB; {} when there is none."""
        inside = [(t, g) for t, g in self.samples if start <= t <= end]
        if not inside:
            return {}
        t, groups = max(inside, key=lambda s: s[1].get(group, 0) if group else sum(s[1].values()))
        return {"time": t, "total_gib": sum(groups.values()) / GIB,
                "groups_gib": {name: value / GIB for name, value in sorted(groups.items())}}


@dataclass
class Watched:
    returncode: int
    killed: bool
    watch: TreeWatch
    seconds: float


def run_watched(command: list[str], group: str, max_gib: float, *, env: dict | None = None, cwd: Path = REPO,
                stdout=None, label: str = "") -> Watched:
    """Run `command` in its own session (a kill takes its whole tree), sampling its tree every
    POLL_S; killed (SIGKILL to the group) once the tree passes `max_gib`."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    watch, killed, last_print = TreeWatch(process.pid, group), False, time.monotonic()
    while process.poll() is None:
        total = watch.sample()
        if total > max_gib * GIB and not killed:  # protect the machine (and whoever shares it)
            print(f"bench: [{label}] over {max_gib} GiB: killing the run", flush=True)
            # the run's own group, and its descendants in sessions of their own (a vLLM server starts one)
            for pid in reversed(process_tree(process.pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed = True
        if time.monotonic() - last_print > 30:
            print(f"bench: [{label}] ... tree {total / GIB:.2f} GiB now, peak so far "
                  f"{watch.peak().get('total_gib', 0):.2f} GiB", flush=True)
            last_print = time.monotonic()
        time.sleep(POLL_S)
    try:  # a server the run left behind in the session would be an orphan; the group is ours to end
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return Watched(process.returncode, killed, watch, time.perf_counter() - started)


def phase_of(time_: float, phases: list) -> str:
    """The (innermost: the last listed) phase that contains `time_`."""
    found = [name for name, start, end in phases if start <= time_ <= end]
    return found[-1] if found else "?"


def tree_peak(watched: Watched, own_peak_gib: float | None, phases: list | None) -> dict:
    """The run's peak: sampled tree sum vs the exact own peak of its root, with phase and groups."""
    top = watched.watch.peak()
    sampled = top.get("total_gib", 0.0)
    root_top = watched.watch.peak(group=watched.watch.root_group)
    own = own_peak_gib if own_peak_gib is not None else float("nan")
    return {"peak_gib": max(sampled, own) if math.isfinite(own) else sampled,
            "sampled_tree_peak_gib": sampled, "groups_at_peak_gib": top.get("groups_gib", {}),
            "phase_at_peak": phase_of(top["time"], phases) if phases and top else None,
            "own_process_peak_gib": own,
            "own_process_sampled_peak_gib": root_top.get("groups_gib", {}).get(watched.watch.root_group, 0.0),
            "own_process_phase_at_peak": phase_of(root_top["time"], phases) if phases and root_top else None,
            "tree_pss_peak_gib": watched.watch.pss_peak / GIB, "killed": watched.killed}


def phase_peaks(watched: Watched, phases: list) -> dict:
    """Per phase (merged over iterations): the largest tree sum in it and the groups then."""
    peaks: dict[str, dict] = {}
    for name, start, end in phases:
        top = watched.watch.peak(start, end)
        if top and top["total_gib"] > peaks.get(name, {}).get("total_gib", -1):
            peaks[name] = {"total_gib": top["total_gib"], **{f"{g}_gib": v for g, v in top["groups_gib"].items()}}
    return peaks
