"""Shared by the benchmark scripts: one result format, the machine it ran on, peak memory.

Every benchmark reports ratios measured in one run (never absolute timings compared across runs
or machines) and writes ``bench/results/<name>.json``; ``bench/report.py`` turns the JSON files
into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent_core.io.portable_paths import CHECKOUT, portable

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# run_all.py points every script (also ones that do not parse --results-dir) at one folder with it
RESULTS_DIR_ENV = "BENCH_RESULTS_DIR"


@dataclass
class Goal:
    """A ratio's goal: `ratio >= value` (op ">=") or `ratio <= value` (op "<=")."""

    metric: str  # what the ratio is, in words, e.g. "agent loop tokens/s / raw engine tokens/s"
    op: str
    value: float

    def met(self, ratio: float) -> bool:
        return ratio >= self.value if self.op == ">=" else ratio <= self.value


@dataclass
class Measurement:
    """One ratio of one benchmark (a benchmark may report several)."""

    key: str  # short id, e.g. "hf" or "smollm2"
    ratio: float
    goal: Goal | None  # None: reported without a goal (e.g. the tiny-model TRL ratio)
    details: dict = field(default_factory=dict)  # the raw numbers behind the ratio (seconds, tokens, ...)
    why_missed: str = ""  # filled when the goal is missed: why, and what would close it
    skipped: str = ""  # set when it could not be measured here (e.g. vLLM not installed): the reason

    @property
    def met(self) -> bool | None:
        if self.goal is None or self.skipped or not math.isfinite(self.ratio):
            return None
        return self.goal.met(self.ratio)


def skipped_measurement(key: str, goal: Goal | None, reason: str) -> Measurement:
    """A measurement that could not be taken here; the report shows the reason instead of a ratio."""
    return Measurement(key=key, ratio=math.nan, goal=goal, skipped=reason)


def machine_info() -> dict:
    """What the numbers were measured on."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["gpu"] = None
    try:
        model = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        info["cpu_model"] = model or platform.processor()
    except (OSError, subprocess.SubprocessError):
        info["cpu_model"] = platform.processor()
    return info


def peak_rss_gib(include_children: bool = False) -> float:
    """Peak resident set size of this process (and optionally its waited-for children), GiB."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if include_children:
        peak_kib = max(peak_kib, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return peak_kib / 2**20


# ---- processes, from /proc (Linux): memory and CPU of a process tree ------------------------------

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def children_map() -> dict[int, list[int]]:
    """Parent pid -> its child pids, for every process now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def process_tree(pid: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """`pid` and its live descendants (a pid in `exclude` is left out with its own descendants)."""
    children, found, todo = children_map(), [], [pid]
    while todo:
        current = todo.pop()
        if current in exclude:
            continue
        found.append(current)
        todo += children.get(current, [])
    return found


def rss_bytes(pid: int) -> int:
    """Resident memory of one process now (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as handle:
            return int(handle.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process now: its RSS with each shared page divided among the
    processes that map it (so PSS summed over processes counts shared libraries once); 0 if gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far, all its threads (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15 of stat)
    except (OSError, IndexError, ValueError):
        return 0.0


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def tree_rss_bytes(pid: int) -> int:
    """Summed RSS of `pid` and its descendants right now (0 once it is gone)."""
    return sum(rss_bytes(p) for p in process_tree(pid))


def resolve_results_dir(override: str | Path | None = None) -> Path:
    """Where results go: `override`, else $BENCH_RESULTS_DIR, else bench/results."""
    chosen = override or os.environ.get(RESULTS_DIR_ENV)
    return Path(chosen) if chosen else RESULTS_DIR


def json_safe(value):
    """nan/inf -> None: the files stay strict JSON (json.dumps would write NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_result(name: str, title: str, measurements: list[Measurement], *, seconds: float,
                 notes: str = "", config: dict | None = None, results_dir: str | Path | None = None,
                 argv: list[str] | None = None, data_root: str | Path | None = None) -> Path:
    """<results dir>/<name>.json with the command that produced it and the machine.

    results_dir: see `resolve_results_dir` (default bench/results). argv: the script's arguments
    (default sys.argv[1:]; give them when main() was called in-process, e.g. from a test).
    data_root: the benchmark's (temporary) data root. The file is committed, so no machine paths:
    paths under the data root are written `<data root>/...`, a results folder outside the checkout
    `<results dir>`, paths in the checkout relative to it (agent_core/io/portable_paths.py).
    """
    folder = resolve_results_dir(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "name": name,
        "title": title,
        "command": " ".join(["python", "-m", f"bench.{name}", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(),
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_seconds": round(seconds, 2),
        "config": config or {},
        "measurements": [{**asdict(m), "met": m.met} for m in measurements],
        "notes": notes,
    }
    outside = not Path(folder).resolve().is_relative_to(CHECKOUT)
    payload = portable(payload, {"data root": data_root, "results dir": folder if outside else None})
    path = folder / f"{name}.json"
    path.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    print(f"bench: wrote {path}")
    for m in measurements:
        if m.skipped:
            print(f"  {name}/{m.key}: skipped ({m.skipped})")
            continue
        goal = "" if m.goal is None else f" (goal {m.goal.op} {m.goal.value}: {'met' if m.met else 'MISSED'})"
        print(f"  {name}/{m.key}: {m.ratio:.3f}{goal}")
    return path


def base_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has (--quick, --results-dir); the
    module docstring is its description, so `--help` says what is measured and how."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes: a smoke run in seconds (the ratios then mean little)")
    parser.add_argument("--results-dir", default=None,
                        help=f"where <name>.json goes (default: ${RESULTS_DIR_ENV} or bench/results)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's, one per core); 1 steadies timings on a "
                             "machine shared with other work")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict) -> argparse.Namespace:
    """Parse argv; with --quick, `quick` replaces the defaults (options given explicitly still win)."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    return args


class Progress:
    """Progress lines with the seconds since the benchmark started (long runs must show life)."""

    def __init__(self, name: str):
        self.name = name
        self.started = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{self.name} {time.perf_counter() - self.started:7.1f}s] {message}", flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started
