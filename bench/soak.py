"""Kill soak: SIGKILL tiny training runs at random moments, many times, resume each, and check that every run ends equal to an uninterrupted run of the same seed.

Not a speed benchmark: a slow reliability script (issue 39, "A soak"), kept out of the default test
suite. It reuses the kill test's harness (tests/kill_harness.py): the same tiny run (configs/tiny.yaml
with the kill test's overrides), the same launcher (`agentr1` in a subprocess of its own session, so
a kill takes the whole process group, like a lost machine) and the same checks.

For each run seed (--run-seeds) one uninterrupted reference run is recorded (tables minus wall-clock
columns, checkpoint file hashes). Then, until --kills SIGKILLs have landed, runs are started over
(a fresh data root each, the seeds taken in turn): the run is killed after a delay drawn from a seeded
RNG over the reference run's duration from its recorded start (config.yaml written); then `agentr1
resume` is started, and each resume is killed again with probability --rekill, after a delay from its
start drawn over 3/4 of a run (at most --max-kills-per-run kills per run), until a resume finishes. After each kill nothing half-written may be visible (every table reads and validates,
every checkpoint is whole, every manifest matches, DuckDB reads the run). A finished run must have
every table row for row and every checkpoint file byte for byte equal to the reference of its seed,
exactly the registered model versions retention keeps (the newest iteration's), no hidden temporaries, and no process left
behind: none of the launched process group alive when `agentr1` exited on its own, and after every
process (killed or not) no process anywhere whose command line, environment or working folder names
the run's data root (a descendant that left the group, e.g. by setsid, is found too).

A kill that lands after the process already finished is a miss: it is recorded, the run is still
checked, and it does not count towards --kills. Writes one JSON file (--out): the usual benchmark
payload (bench/common.py, so bench/report.py can render it) plus every kill's row and every run's
row. Exits 1 if any check failed.

    .venv/bin/python -m bench.soak --kills 100 --seed 0 --out bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from agent_core.io.portable_paths import CHECKOUT, portable
from bench.common import Goal, Measurement, Progress, json_safe, machine_info

REPO_ROOT = Path(__file__).resolve().parent.parent
ITERATIONS = 2  # configs/tiny.yaml
RESUME_WINDOW = 0.75  # a resume's kill window, as a share of an uninterrupted run's seconds


def _harness():
    """tests/kill_harness.py (tests/ is not a package: pytest puts it on the path; so do we)."""
    tests = str(REPO_ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import kill_harness

    return kill_harness


def processes_naming(root: Path, exclude: set[int]) -> list[dict]:
    """Live processes whose command line, environment or working folder names `root` (a path
    component match: root1 does not match root10)."""
    pattern = re.compile(re.escape(str(root)).encode() + rb"(?=/|\0|\s|$)")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        pid = int(entry)
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            where = []
            for name in ("cmdline", "environ"):
                try:
                    if pattern.search(Path(f"/proc/{pid}/{name}").read_bytes()):
                        where.append(name)
                except PermissionError:
                    pass
            try:
                if pattern.search(os.readlink(f"/proc/{pid}/cwd").encode() + b"\0"):
                    where.append("cwd")
            except PermissionError:
                pass
            if where:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append({"pid": pid, "where": where, "cmdline": command.strip()[:300]})
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return found


def settle_and_scan(root: Path, exclude: set[int], grace_s: float = 3.0) -> list[dict]:
    """`processes_naming(root)` once the killed group has had `grace_s` to disappear."""
    deadline = time.monotonic() + grace_s
    while True:
        found = processes_naming(root, exclude)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path, progress: Progress):
        self.h = _harness()
        self.args, self.work, self.progress = args, work, progress
        self.rng = random.Random(args.seed)
        self.api = self.h.prefect_api_url()
        self.exclude = {os.getpid()}
        self.kills: list[dict] = []
        self.runs: list[dict] = []
        self.references: dict[int, dict] = {}
        self.misses = 0
        self._launch = 0

    def launch(self, args: list[str], root: Path, kill_after_s: float | None) -> dict:
        """One `agentr1` process (killed after `kill_after_s` if given): its outcome, where it died,
        what it left."""
        self._launch += 1
        trace = self.work / f"{root.name}.{self._launch:04d}.trace"
        survivors: list[int] = []
        started = time.perf_counter()
        code, output = self.h.run_cli(args, root, trace=trace, kill_after_s=kill_after_s, prefect_api=self.api,
                                      timeout_s=self.args.timeout, survivors=survivors)
        seconds = time.perf_counter() - started
        trace_names = self.h.read_trace(trace)
        stage, iteration = self.h.stage_at_death(trace_names)
        result = {"code": code, "seconds": round(seconds, 2), "stage": stage, "iteration": iteration,
                  "last_failpoint": trace_names[-1] if trace_names else None,
                  "group_alive_at_exit": survivors,
                  "left_processes": settle_and_scan(root, self.exclude), "output_tail": output[-2000:]}
        trace.unlink(missing_ok=True)
        return result

    def reference(self, seed: int) -> dict:
        root = self.work / f"reference-seed{seed}"
        result = self.launch(self.h.train_args() + ["--set", f"seed={seed}"], root, None)
        ended = time.time()
        config = root / "runs" / self.h.RUN_ID / "config.yaml"
        # a fresh run's kill delay counts from its recorded start (config.yaml), after the interpreter's start-up
        recorded_s = round(ended - config.stat().st_mtime, 2) if config.is_file() else result["seconds"]
        failures = []
        if result["code"] != 0:
            failures.append(f"the reference run failed (exit {result['code']}):\n{result['output_tail']}")
        if result["group_alive_at_exit"] or result["left_processes"]:
            failures.append(f"processes left behind by the reference run: {result['group_alive_at_exit']} "
                            f"{result['left_processes']}")
        versions = self.h.registered_iterations(root) if not failures else []
        if not failures and versions != [ITERATIONS - 1]:  # retention keeps the newest only (checkpoints.*)
            failures.append(f"reference model versions by iteration: {versions}")
        reference = {"seed": seed, "seconds": result["seconds"], "recorded_s": recorded_s, "failures": failures,
                     "snapshot": self.h.snapshot(root) if not failures else {}}
        self.progress(f"reference run, seed {seed}: {result['seconds']:.1f} s ({recorded_s:.1f} s from its recorded start)"
                      + ("" if not failures else f"  FAILED: {failures[0][:300]}"))
        if not failures and not self.args.keep:
            shutil.rmtree(root, ignore_errors=True)
        return reference

    def one_run(self, number: int, seed: int) -> None:
        """Kill a fresh run, resume (killing again at random) until a resume finishes; check it."""
        reference = self.references[seed]
        root = self.work / f"run{number:03d}-seed{seed}"
        h, args = self.h, self.args
        failures: list[str] = []
        kills_here, processes, started = 0, 0, time.perf_counter()
        row = None  # the kill whose resume is running
        finished = False
        while not finished:
            recorded = (root / "runs" / h.RUN_ID / "config.yaml").is_file()
            command = ["resume", "--run-id", h.RUN_ID] if recorded else h.train_args() + ["--set", f"seed={seed}"]
            kind = "resume" if recorded else "train"
            budget_left = len(self.kills) < args.kills
            kill = budget_left and kills_here < args.max_kills_per_run and (
                kills_here == 0 or self.rng.random() < args.rekill)
            # a fresh run: over its duration from its recorded start (where run_cli counts from); a
            # resume: from the process's start, over RESUME_WINDOW of a whole run (a resume has less
            # to do than a fresh run, so some of its kills still miss)
            duration = reference["recorded_s"] if kind == "train" else RESUME_WINDOW * reference["seconds"]
            delay = round(self.rng.uniform(args.low, args.high) * duration, 2) if kill else None
            result = self.launch(command, root, delay)
            processes += 1
            if row is not None:  # the previous kill's resume
                row["resume_s"] = result["seconds"]
                row["resume_outcome"] = {0: "finished", -9: "killed"}.get(result["code"], f"exit {result['code']}")
                row = None
            if result["group_alive_at_exit"]:
                failures.append(f"{kind} exited with its group still alive: {result['group_alive_at_exit']}")
            if result["left_processes"]:
                failures.append(f"{kind} left processes behind: {result['left_processes']}")
            if result["code"] == -9:
                kills_here += 1
                problems = h.visible_problems(root)
                failures += [f"after kill {len(self.kills) + 1}: {p}" for p in problems]
                row = {"kill": len(self.kills) + 1, "run": number, "run_seed": seed, "process": kind,
                       "delay_s": delay, "counted_from": "recorded start" if kind == "train" else "process start", "fraction": round(delay / duration, 3), "stage": result["stage"],
                       "iteration": result["iteration"], "last_failpoint": result["last_failpoint"],
                       "visible_problems": len(problems), "left_processes": len(result["left_processes"]),
                       "resume_s": None, "resume_outcome": None}
                self.kills.append(row)
                self.progress(f"kill {row['kill']:3d}/{args.kills}: run {number} (seed {seed}) {kind} after "
                              f"{delay:5.1f} s ({row['fraction']:.2f} of its window), in {result['stage']} "
                              f"(iteration {result['iteration']}, last failpoint {result['last_failpoint']})"
                              + (f"  {len(problems)} visible problem(s)" if problems else ""))
            elif result["code"] == 0:
                finished = True
                if delay is not None:
                    self.misses += 1
                    self.progress(f"  miss: run {number} {kind} finished before its kill at {delay:.1f} s")
            else:
                failures.append(f"{kind} failed (exit {result['code']}):\n{result['output_tail']}")
                break
            if processes > args.max_kills_per_run + 3:
                failures.append(f"no resume finished after {processes} processes")
                break
        if finished:
            failures += h.snapshot_differences(reference["snapshot"], h.snapshot(root))
            versions = h.registered_iterations(root)  # the snapshot compares them with the reference's too
            if versions != [ITERATIONS - 1]:
                failures.append(f"model versions by iteration: {versions}, want the newest iteration's only")
            failures += [f"left behind: {p}" for p in h.leftover_files(root)]
        run = {"run": number, "run_seed": seed, "kills": kills_here, "processes": processes,
               "seconds": round(time.perf_counter() - started, 1), "passed": not failures,
               "failures": [f[:2000] for f in failures]}
        self.runs.append(run)
        self.progress(f"run {number} (seed {seed}): {kills_here} kill(s), {processes} process(es), "
                      + ("equal to the uninterrupted run, one version per iteration, nothing left behind"
                         if not failures else f"FAILED ({len(failures)}): {failures[0][:400]}"))
        if not failures and not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    def run(self) -> None:
        for seed in self.args.run_seeds:
            self.references[seed] = self.reference(seed)
        seeds = [s for s in self.args.run_seeds if not self.references[s]["failures"]]
        number = 0
        while seeds and len(self.kills) < self.args.kills:
            if self.misses > self.args.kills + 10:
                self.progress("too many misses: stopping")
                break
            self.one_run(number, seeds[number % len(seeds)])
            number += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=100, help="SIGKILLs that must land (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the RNG seed of the kill moments")
    parser.add_argument("--run-seeds", type=int, nargs="+", default=[0, 1],
                        help="the training seeds, taken in turn; one reference run each (default 0 1)")
    parser.add_argument("--rekill", type=float, default=0.5,
                        help="probability that a resume is killed again (default 0.5)")
    parser.add_argument("--max-kills-per-run", type=int, default=4)
    parser.add_argument("--low", type=float, default=0.0, help="earliest kill, as a fraction of a run (default 0)")
    parser.add_argument("--high", type=float, default=0.9, help="latest kill, as a fraction of a run (default 0.9)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one process may take")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "soak.json"))
    parser.add_argument("--work-dir", default=None, help="where the data roots go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep every data root (failing ones are always kept)")
    args = parser.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="agentr1-soak-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # this process's own Prefect state (its temporary API server, shared by every run), before prefect is imported
    os.environ["PREFECT_HOME"] = str(work / "api" / "prefect")
    os.environ.pop("PREFECT_API_URL", None)
    os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"
    from flows.environment import configure_environment

    configure_environment(work / "api")
    progress = Progress("soak")
    progress(f"{args.kills} kills, kill seed {args.seed}, run seeds {args.run_seeds}, data roots under {work}")
    soak = Soak(args, work, progress)
    try:
        soak.run()
    except KeyboardInterrupt:
        progress("interrupted: writing what was measured")
    seconds = progress.elapsed

    kills, runs = soak.kills, soak.runs
    reference_failures = [f for r in soak.references.values() for f in r["failures"]]
    passed = [r for r in runs if r["passed"]]
    resumes = [k["resume_s"] for k in kills if k["resume_s"] is not None]
    reference_s = [r["seconds"] for r in soak.references.values()]
    stages: dict[str, int] = {}
    for k in kills:
        stages[k["stage"]] = stages.get(k["stage"], 0) + 1
    ok = (not reference_failures and len(kills) >= args.kills and runs and len(passed) == len(runs))
    summary = {
        "kills": len(kills), "kills_asked": args.kills, "misses": soak.misses, "runs": len(runs),
        "runs_passed": len(passed), "kills_of_train": sum(k["process"] == "train" for k in kills),
        "kills_of_resume": sum(k["process"] == "resume" for k in kills),
        "visible_problems_after_kills": sum(k["visible_problems"] for k in kills),
        "processes_left_behind": sum(k["left_processes"] for k in kills),
        "reference_run_s": reference_s,
        "resume_s_median": round(statistics.median(resumes), 2) if resumes else None,
        "resume_s_max": max(resumes) if resumes else None,
        "kills_by_stage": dict(sorted(stages.items(), key=lambda kv: -kv[1])),
        "reference_failures": reference_failures, "passed": bool(ok),
    }
    runs_goal = Goal("runs ending equal to the uninterrupted run of their seed, with the registered versions "
                     "retention keeps and no process or temporary left behind / runs", ">=", 1.0)
    measurements = [
        Measurement("runs_equal", len(passed) / len(runs) if runs else float("nan"), runs_goal,
                    {k: summary[k] for k in ("kills", "kills_asked", "misses", "runs", "runs_passed")}),
        Measurement("resume_vs_run", (statistics.median(resumes) / statistics.median(reference_s))
                    if resumes and reference_s else float("nan"), None,
                    {"resume_s_median": summary["resume_s_median"], "reference_run_s": reference_s,
                     "what": "median seconds of a resume after a kill (to its end or its own kill) / seconds of an "
                             "uninterrupted run"}),
    ]
    payload = {
        "name": "soak",
        "title": "Kill soak: SIGKILLs at random moments, each resumed, runs equal to uninterrupted ones",
        "command": " ".join(["python", "-m", "bench.soak", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(),
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_seconds": round(seconds, 2),
        "config": {"kills": args.kills, "seed": args.seed, "run_seeds": args.run_seeds, "rekill": args.rekill,
                   "max_kills_per_run": args.max_kills_per_run, "kill_window": [args.low, args.high],
                   "run": "configs/tiny.yaml + tests/kill_harness.py OVERRIDES, 2 iterations"},
        "measurements": [{**asdict(m), "met": m.met} for m in measurements],
        "notes": "Not a speed benchmark: a reliability soak (issue 39). Per-kill rows under `kills`, per-run rows "
                 "under `runs`.",
        "summary": summary,
        "kills": kills,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    outside = not out.resolve().parent.is_relative_to(CHECKOUT)
    payload = portable(payload, {"data root": work, "results dir": out.resolve().parent if outside else None})
    out.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    progress(f"{len(kills)} kill(s) ({soak.misses} miss(es)) over {len(runs)} run(s): {len(passed)} passed; "
             f"median resume {summary['resume_s_median']} s; reference run {reference_s} s; wrote {out}")
    for r in runs:
        for failure in r["failures"][:5]:
            print(f"  run {r['run']}: {failure[:400]}")
    for failure in reference_failures:
        print(f"  reference: {failure[:400]}")
    print("soak: PASSED" if ok else "soak: FAILED")
    if ok and not args.keep and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
