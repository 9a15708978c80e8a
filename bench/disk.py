"""Disk: what one run leaves on disk with checkpoint retention's defaults and what it would without
retention (every file, as `checkpoints.keep_all`), and the seconds the prune stage adds to an iteration (issue 56).

The config is trained into a temporary data root (or `--data-root`, where a run already trained there
is resumed, i.e. only measured). A run's disk is its run folder plus its MLflow artifacts (registered
versions), counted like `du`: each inode once, so a registered version hard-linked to the run's
checkpoint costs nothing extra. Rows: `smollm2` (goal: a 6-iteration seed of configs/smollm2.yaml
<= 2.5 GB with the defaults; ratio = bytes / 2.5 GB); `<config>_without_retention`: the same plus
what retention pruned (the sizes its tombstones recorded), i.e. `keep_all` (no goal; `--keep-all`
trains a second run with `checkpoints.keep_all=true` and measures it instead); and `prune_share`
(the prune stage's seconds / the iteration's other stages', from the manifests; goal <= 0.01).
By default the SmolLM2 recipe's files at a fraction of its work: the same model, checkpoints,
optimizer states, warm start, dev evaluations and registrations, with fewer prompts, samples and
steps and the hf engine (`--full` runs the recipe as it is: ~20 min on 2 cores and vLLM).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from agent_core.io.tombstones import SUFFIX
from bench.common import Goal, Measurement, Progress, base_parser, parse_args, write_result

NAME = "disk"
TITLE = "Disk: a run's files with checkpoint retention, and what pruning costs"
GOAL_BYTES = 2.5e9
# the recipe's files at a fraction of its work (the data, the number of iterations and evaluations stay)
SHRINK = ("data.prompts_per_iteration=2", "rollout.group_size=2", "rollout.engine=hf", "warm_start.prompts=16",
          "dev_eval.prompts=4")
QUICK = dict(config="tiny", iterations=3)
REPO_ROOT = Path(__file__).resolve().parent.parent
STAGE_KINDS = ("initial_policy", "warm_start_policy", "checkpoint", "optimizer.pt", "critic", "tables", "other")


def arguments(argv: list[str] | None):
    parser = base_parser(__doc__)
    parser.add_argument("--config", default="smollm2", help="the run's config (a shipped name or a file)")
    parser.add_argument("--iterations", type=int, default=6, help="RL iterations of each run")
    parser.add_argument("--full", action="store_true", help="the config as it is (default: --set " + " ".join(SHRINK) + ")")
    parser.add_argument("--keep-all", action="store_true", help="also train a run with checkpoints.keep_all=true")
    parser.add_argument("--data-root", default=None, help="a data root to keep (default: a temporary one, removed)")
    return parse_args(parser, argv, QUICK)


def train_run(root: Path, config: str, run_id: str, overrides: list[str], progress: Progress) -> None:
    from agent_core.validation import load_config
    from flows.configs_lookup import resolve_config
    from flows.train import train

    progress(f"training {run_id}: --config {config} " + " ".join(f"--set {o}" for o in overrides))
    train(load_config(resolve_config(config), [f"data_root={root}", f"run_id={run_id}", *overrides]))


def run_disk(root: Path, run_id: str) -> dict[str, int]:
    """Bytes of the run folder and of its MLflow artifacts together (each inode once), and by part."""
    from agent_core.io.disk_use import disk_uses, inode_blocks

    run_dir, artifacts = root / "runs" / run_id, _artifact_dirs(root, run_id)
    _, added = disk_uses([run_dir, *artifacts])
    parts = {kind: 0 for kind in STAGE_KINDS}
    for path in sorted(run_dir.rglob("*")):
        if path.is_file():
            kind = next((k for k in STAGE_KINDS[:-2] if k in path.relative_to(run_dir).parts
                         or path.name == k), "tables" if path.suffix == ".parquet" else "other")
            parts[kind] += path.stat().st_blocks * 512
    return {"total": sum(added), "run_folder": added[0], "mlflow_artifacts": sum(added[1:]),
            **{f"run_folder.{k}": v for k, v in parts.items()},
            "files_in_artifacts": sum(len(inode_blocks(a)) for a in artifacts),
            "pruned": sum(stone.bytes for path in run_dir.rglob(f"*{SUFFIX}") if (stone := _tombstone(path)))}


def _tombstone(path: Path):
    from agent_core.io.tombstones import read_tombstone

    return read_tombstone(path.with_name(path.name.removesuffix(SUFFIX)))


def _artifact_dirs(root: Path, run_id: str) -> list[Path]:
    """The MLflow runs' artifact folders of pipeline run `run_id` (found by their agentr1.run_id tag)."""
    from agent_core.io.tracking import Tracker

    from agent_core.io.layout import DataRoot

    data_root = DataRoot(root)
    tracker = Tracker(data_root.mlflow_tracking_uri, data_root.mlflow_artifacts.resolve().as_uri())
    found = []
    for experiment in tracker.client.search_experiments():
        for mlflow_run in tracker.client.search_runs([experiment.experiment_id], f"tags.`agentr1.run_id` = '{run_id}'"):
            found.append(Path(mlflow_run.info.artifact_uri.removeprefix("file://")))
    return found


def prune_share(root: Path, run_id: str) -> tuple[float, float]:
    """(seconds of every prune stage, seconds of every stage of every iteration) the manifests recorded."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.ledger import stage_seconds

    run = DataRoot(root).run(run_id)
    pairs = [pair for k in run.iterations() for pair in stage_seconds(run, k)]
    return sum(s for stage, s in pairs if stage == "prune"), sum(s for stage, s in pairs if stage != "prune")


def measure(args, progress: Progress) -> tuple[list[Measurement], str]:
    from flows.environment import configure_environment

    overrides = [f"iterations={args.iterations}", *([] if args.full or args.config != "smollm2" else SHRINK)]
    with tempfile.TemporaryDirectory(prefix="bench-disk-") as tmp:
        root = Path(args.data_root or tmp)
        configure_environment(root)  # this data root's Prefect state, before anything imports prefect
        train_run(root, args.config, "defaults", overrides, progress)
        defaults = run_disk(root, "defaults")
        keep_all = {"total": defaults["total"] + defaults["pruned"], "kept": defaults["total"],  # what retention
                    "pruned": defaults["pruned"]}  # let go, back (the sizes its tombstones recorded)
        if args.keep_all:
            train_run(root, args.config, "keep-all", [*overrides, "checkpoints.keep_all=true"], progress)
            keep_all = run_disk(root, "keep-all")
        pruning, stages = prune_share(root, "defaults")
    progress(f"defaults {defaults['total'] / 1e9:.3f} GB, without retention {keep_all['total'] / 1e9:.3f} GB; "
             f"pruning {pruning:.2f}s of {stages:.0f}s")
    key = args.config.removesuffix(".yaml")
    goal = Goal(f"bytes of a {args.iterations}-iteration run with the defaults / 2.5 GB", "<=", 1.0) if key == "smollm2" else None
    ratio = defaults["total"] / GOAL_BYTES
    why = "" if goal is None or goal.met(ratio) else _why(defaults)
    share_goal = Goal("prune stage seconds / the iteration's stage seconds", "<=", 0.01)
    share = pruning / stages if stages else float("nan")
    rows = [Measurement(key, ratio, goal, defaults, why),
            Measurement(f"{key}_{'keep_all' if args.keep_all else 'without_retention'}", keep_all["total"] / GOAL_BYTES,
                        None, keep_all),
            Measurement("prune_share", share, share_goal, {"prune_seconds": round(pruning, 3),
                                                          "stage_seconds": round(stages, 1)},
                        "" if share_goal.met(share) else f"pruning took {pruning:.2f}s of {stages:.0f}s")]
    notes = (f"config {args.config}, {args.iterations} iterations" + ("" if args.full or key != "smollm2"
             else ", --set " + " ".join(SHRINK)) + f"; defaults vs {'keep_all' if args.keep_all else 'without retention (+ tombstoned bytes)'}: "
             f"{defaults['total'] / 1e9:.3f} vs "
             f"{keep_all['total'] / 1e9:.3f} GB")
    return rows, notes


def _why(parts: dict[str, int]) -> str:
    largest = sorted(((v, k) for k, v in parts.items() if k.startswith("run_folder.")), reverse=True)[:4]
    return "largest parts: " + ", ".join(f"{k.removeprefix('run_folder.')} {v / 1e9:.2f} GB" for v, k in largest)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    progress = Progress(NAME)
    measurements, notes = measure(args, progress)
    config = {k: v for k, v in vars(args).items() if k not in ("results_dir",)}
    write_result(NAME, TITLE, measurements, seconds=progress.elapsed, config=config, results_dir=args.results_dir,
                 argv=argv, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
