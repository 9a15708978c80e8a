"""Viewer: `agentr1 view`'s page loads against their budgets (issue 42): an episode page of a 12-iteration demo run in under 1 s, the runs page in under 2 s with 50 runs under the data root.

One run is trained (`--config`, default demo: 12 iterations) into a temporary data root and copied
(hard links) to `--runs` run folders in all. The viewer's own server (werkzeug, threaded, as `agentr1
view` serves) answers real HTTP GETs from this process; each page is fetched once to warm up (the
tokenizer loads on the first episode page) and then `--repeats` times, the median used. ratio =
median seconds / budget seconds (goal <= 1). The episode is the last iteration's longest (most
tokens), the worst case of that run.
"""

from __future__ import annotations

import http.client
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from bench.common import Goal, Measurement, Progress, base_parser, parse_args, write_result

NAME = "viewer"
TITLE = "Viewer: page loads of `agentr1 view` against their budgets"
BUDGETS_S = {"episode": 1.0, "runs": 2.0}
QUICK = dict(config="tiny", runs=3, repeats=2)
REPO_ROOT = Path(__file__).resolve().parent.parent


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--config", default="demo", help="the run's config (a shipped name or a file)")
    parser.add_argument("--runs", type=int, default=50, help="run folders under the data root (copies of the one trained)")
    parser.add_argument("--repeats", type=int, default=5, help="timed GETs per page (median used)")
    parser.add_argument("--iterations", type=int, default=None, help="the run's iterations (default: the config's)")
    return parse_args(parser, argv, QUICK)


def build_root(root: Path, config: str, runs: int, progress: Progress,
               iterations: int | None = None) -> tuple[str, int, str]:
    """Train one run and copy it; (run_id, last iteration, its episode with the most tokens)."""
    from flows.environment import configure_environment

    configure_environment(root)  # this data root's Prefect state, before anything imports prefect
    from agent_core.io.query import run_query
    from agent_core.validation import load_config
    from flows.configs_lookup import resolve_config
    from flows.train import train

    progress(f"training one {config} run (the viewer reads its tables)")
    overrides = [f"data_root={root}", "run_id=bench-run"] + ([f"iterations={iterations}"] if iterations else [])
    train(load_config(resolve_config(config), overrides))
    for k in range(1, runs):
        shutil.copytree(root / "runs/bench-run", root / f"runs/bench-run-{k:02d}", copy_function=os.link)
    last = max(int(p.name.split("=")[1]) for p in (root / "runs/bench-run").glob("iteration=*"))
    episode = run_query(root, f"SELECT episode_id FROM steps WHERE run_id = 'bench-run' AND iteration = {last} "
                              "GROUP BY episode_id ORDER BY sum(len(response_ids) + len(prompt_ids)) DESC LIMIT 1"
                        ).column(0)[0].as_py()
    return "bench-run", last, episode


def timed_get(port: int, path: str) -> float:
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", path)
    response = connection.getresponse()
    response.read()
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"GET {path}: HTTP {response.status}")
    return time.perf_counter() - started


def measure(args, progress: Progress) -> list[Measurement]:
    from werkzeug.serving import make_server

    from agent_core.viewer.app import create_app

    with tempfile.TemporaryDirectory(prefix="bench-viewer-") as tmp:
        root = Path(tmp)
        run_id, last, episode = build_root(root, args.config, args.runs, progress, args.iterations)
        server = make_server("127.0.0.1", 0, create_app(root), threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            pages = {"episode": f"/run/{run_id}/iteration/{last}/episode/{urllib.parse.quote(episode)}", "runs": "/"}
            out = []
            for key, path in pages.items():
                timed_get(server.server_address[1], path)  # warm-up
                seconds = [timed_get(server.server_address[1], path) for _ in range(args.repeats)]
                median = statistics.median(seconds)
                progress(f"{key}: median {median:.3f}s over {args.repeats} GETs")
                goal = Goal(f"median seconds to load the {key} page / {BUDGETS_S[key]:g} s", "<=", 1.0)
                ratio = median / BUDGETS_S[key]
                why = "" if goal.met(ratio) else f"the {key} page took {median:.2f}s (GETs: {seconds})"
                out.append(Measurement(key, ratio, goal, {"seconds": [round(s, 4) for s in seconds],
                                                           "median_s": round(median, 4), "path": path,
                                                           "runs": args.runs, "iterations": last + 1}, why))
        finally:
            server.shutdown()
            server.server_close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    measurements = measure(args, progress)
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir",)}
    write_result(NAME, TITLE, measurements, seconds=progress.elapsed, config=config, results_dir=args.results_dir,
                 argv=argv, notes=f"config {args.config}, iterations {args.iterations or 'as configured'}; {args.runs} runs under the data root; median of "
                                  f"{args.repeats} GETs per page after one warm-up.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
