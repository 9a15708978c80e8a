"""Run every benchmark, each in its own process, then write the benchmarks page (`make bench`).

Each script of bench.report.BENCHMARKS runs as `python -m bench.<name> [--quick]` in a fresh process
with $BENCH_RESULTS_DIR pointing at the results folder; its old result is removed first, so a failed
script shows as missing rather than with stale numbers, and one that is not there is reported and
skipped. A full run adds FULL_RUN_ARGS (both engines, SmolLM2, ...) and writes bench/results/ and
docs/benchmarks.md; --quick runs tiny sizes into a temporary folder. `--args "NAME=ARGS"` appends
arguments to one script. Sizes, durations and what each needs: README, "Benchmarks".
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import report
from bench.common import RESULTS_DIR, RESULTS_DIR_ENV, base_parser

BENCH_DIR = Path(__file__).resolve().parent
QUICK_DIR = Path(tempfile.gettempdir()) / "agentr1-bench-quick"
# arguments of a full (not --quick) run, per script
FULL_RUN_ARGS = {"rollout": ["--engine", "all"], "trl_compare": ["--engine", "all"],
                 "training": ["--model-dir", "data/models/smollm2-135m-instruct"]}
# arguments after --quick (explicit options win over a script's quick defaults): the vLLM rows too
QUICK_RUN_ARGS = {"rollout": ["--engine", "all"]}


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--only", default="", help="comma list of benchmarks to run (default: all)")
    parser.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                        help="more arguments for one script, e.g. 'trl_compare=--iterations 2' (repeatable)")
    parser.add_argument("--output", default=None,
                        help="the page to write (default: docs/benchmarks.md; with --quick, in the results dir)")
    args = parser.parse_args(argv)
    args.results_dir = Path(args.results_dir or os.environ.get(RESULTS_DIR_ENV) or
                            (QUICK_DIR if args.quick else RESULTS_DIR))
    args.extra = extra_arguments(parser, args.args)
    if args.output is None:
        args.output = args.results_dir / "benchmarks.md" if args.quick else report.DEFAULT_OUTPUT
    return args


def extra_arguments(parser, items: list[str]) -> dict[str, list[str]]:
    """--args items ("name=arguments") -> {name: [argument, ...]}."""
    extra: dict[str, list[str]] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or name.strip() not in report.BENCHMARKS:
            parser.error(f"--args {item!r}: expected NAME=ARGS with NAME one of {', '.join(report.BENCHMARKS)}")
        extra.setdefault(name.strip(), []).extend(shlex.split(rest))
    return extra


def selected(only: str) -> list[str]:
    names = [n.strip() for n in only.split(",") if n.strip()] or list(report.BENCHMARKS)
    unknown = [n for n in names if n not in report.BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(report.BENCHMARKS)}")
    return names


def runnable(name: str) -> str | None:
    """None if bench/<name>.py can run, else why not."""
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        return f"bench/{name}.py not found (not written yet?)"
    if "def main(" not in path.read_text():
        return f"bench/{name}.py defines no main()"
    return None


def run_one(name: str, args) -> tuple[int, float]:
    """Run bench.<name> in a child process; (exit status, seconds)."""
    (args.results_dir / f"{name}.json").unlink(missing_ok=True)
    extra = ["--quick", *QUICK_RUN_ARGS.get(name, [])] if args.quick else FULL_RUN_ARGS.get(name, [])
    command = [sys.executable, "-m", f"bench.{name}", *extra, *getattr(args, "extra", {}).get(name, [])]
    env = {**os.environ, RESULTS_DIR_ENV: str(args.results_dir)}
    if args.threads:  # children read it at torch import (not every script takes --threads)
        env["OMP_NUM_THREADS"] = str(args.threads)
    print(f"\n=== {' '.join(command[1:])} ===", flush=True)
    started = time.perf_counter()
    status = subprocess.run(command, cwd=report.REPO_ROOT, env=env).returncode
    return status, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench: results in {args.results_dir}, page {args.output}", flush=True)
    outcomes: list[tuple[str, str]] = []
    for name in selected(args.only):
        reason = runnable(name)
        if reason:
            print(f"\n=== bench.{name}: skipped, {reason} ===", flush=True)
            outcomes.append((name, f"skipped: {reason}"))
            continue
        status, seconds = run_one(name, args)
        outcomes.append((name, f"{'ok' if status == 0 else f'FAILED (exit {status})'} in {seconds:.0f}s"))
    report.main(["--results-dir", str(args.results_dir), "--output", str(args.output)])
    print("\nbench summary:")
    for name, outcome in outcomes:
        print(f"  {name:12s} {outcome}")
    return 1 if any("FAILED" in outcome for _, outcome in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
