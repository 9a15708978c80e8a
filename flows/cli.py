"""`agentr1`: the command line. Sets up the embedded environment, then runs flows or queries.

    agentr1 demo                       train on the built-in task with the embedded defaults
    agentr1 train --config FILE        train with a YAML config: a file, or the name of a shipped config (tiny, demo, algos/ppo)
    agentr1 configs                    list the configs shipped with the package, with their paths
    agentr1 resume --run-id R          continue a stopped or crashed run: completed stages are skipped
    agentr1 query "SELECT ..."         SQL over every table of every run (DuckDB)
    agentr1 rerun --run-id R --iteration K --stage S [--set key=value ...]
    agentr1 runs                       list runs and their iterations
    agentr1 audit --run-id R           behaviour health checks over a run's tables; exit 1 when one fails
    agentr1 view [--port 8765]         browse runs, iterations and episodes in a web browser (127.0.0.1)
    agentr1 eval --run-id R [--methods naive_rag,base_tool_call,agent] [--seeds 3] [--greedy] [--limit N]
    agentr1 experiment [--experiment configs/experiment.yaml] [--set key=value ...]
                                       the paper's Tables 3-4 at CPU scale -> docs/results.md + plots
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

from agent_core.config_errors import Override
from agent_core.io.locks import RunInUseError, check_run_free, command_holds_run
from agent_core.io.run_files import check_run_writable
from flows.configs_lookup import resolve_config, shipped_configs
from flows.environment import configure_environment, start_temporary_server
from flows.input_checks import check_eval_inputs, check_rerun_inputs, check_run_id
from flows.prune_command import add_prune_arguments, disk_full_line

DEFAULT_DATA_ROOT = "data"
INTERRUPTED = 130  # the shell's code for a command ended by SIGINT (128 + 2)
DISK_FULL = 1  # a run (or another command) stopped by a full disk or the disk budget: free space, then resume
AUDIT_STOPPED = 3  # train / resume: the audit ended the run early (audit.on_alert: stop); a script must not read "done"


def _version() -> str:
    """The installed distribution's version (a checkout run without installing says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentr1-pipeline")
    except PackageNotFoundError:
        return "(not installed: run `make install`)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentr1", description="RL training pipeline for tool-using LLM agents")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("--data-root", default=None, help=f"tables, Prefect and MLflow state (default: ./{DEFAULT_DATA_ROOT}, or the config's)")
        return cmd

    for name, help_text in (("demo", "train on the built-in task with the embedded defaults"),
                            ("train", "train with a YAML config")):
        cmd = add(name, help_text)
        cmd.add_argument("--config", dest="configs", action="append", default=[], metavar="FILE",
                         help="YAML config file, or the name of a shipped config (`agentr1 configs`: tiny, demo, "
                              "algos/ppo, ...); repeat to layer files, later ones win (default: embedded defaults)")
        cmd.add_argument("--run-id", default=None, help="default: a fresh id")
        cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config value, e.g. --set rollout.group_size=8 (repeatable)")
        cmd.add_argument("--dry-run", action="store_true",
                         help="check the config (keys, values, registered names), print it resolved as YAML, and exit")

    resume = add("resume", "continue a stopped or crashed run from its recorded config; completed stages are skipped")
    resume.add_argument("--run-id", required=True)
    resume.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="change a config value; the stages it affects (and everything after them) rerun")

    query = add("query", "run SQL over all tables of all runs")
    query.add_argument("sql", help="e.g. \"select iteration, avg(reward) from rewards group by 1 order by 1\"")
    query.add_argument("--output", default=None, help="write the result to a .csv or .parquet file instead")
    query.add_argument("--max-rows", type=int, default=50, help="rows printed (default 50)")
    query.add_argument("--force", action="store_true", help="let --output replace an existing file")
    query.add_argument("--timeout", default=None, metavar="SECONDS",
                       help="interrupt the query after this many seconds (Ctrl-C interrupts it too)")
    query.add_argument("--memory-limit", default=None, metavar="SIZE",
                       help="DuckDB's memory limit, e.g. 4GB or 512MiB (default: a quarter of the memory)")

    rerun = add("rerun", "rerun one stage of one iteration from the tables before it")
    rerun.add_argument("--run-id", required=True)
    rerun.add_argument("--iteration", type=int, required=True)
    rerun.add_argument("--stage", required=True, help="prepare_data, rollout, label_rewards, compute_advantages or train")
    rerun.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    add("runs", "list runs: status (running, finished, failed, stopped, killed), iterations done, last dev EM, algorithm")
    add_prune_arguments(add("prune", "delete the checkpoints, optimizer states and model versions a run's "
                            "checkpoints: section lets go (e.g. runs recorded before retention); refuses a run being written"))
    audit = add("audit", "run every health check (the run's audit: section) over a run's tables; exit 1 when one fails")
    audit.add_argument("--run-id", required=True)
    audit.add_argument("--checks", metavar="FILE", help="YAML with more audit checks and thresholds (the keys of an "
                       "audit: section), layered over the run's recorded ones")
    from flows.view_command import add_view_arguments

    add_view_arguments(add("view", "browse runs, iterations and episodes (tokens, loss mask, advantages) in a web browser"))
    sub.add_parser("configs", help="list the configs shipped with the package (usable as --config NAME)",
                   description="list the configs shipped with the package (usable as --config NAME)")
    _add_eval(add("eval", "evaluate methods of a run over a dataset split: EM and F1, mean ± std over seeds"))
    experiment = add("experiment", "baselines, every algorithm and the mask ablations, evaluated -> results page")
    experiment.add_argument("--experiment", default="configs/experiment.yaml", metavar="FILE",
                            help="experiment definition (default: configs/experiment.yaml)")
    experiment.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                            help="pipeline override for every run, e.g. --set iterations=2 (repeatable)")
    return parser


def _add_eval(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--run-id", required=True, help="the run whose dataset, policies and budgets are evaluated")
    which = cmd.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", default=None,
                       help="policy of the 'agent' method: a checkpoint folder, or a registered model "
                            "models:/NAME/VERSION or models:/NAME@ALIAS (@latest, @best) (default: the run's last checkpoint)")
    which.add_argument("--iteration", type=int, default=None, help="the agent runs the run's checkpoint of this iteration")
    cmd.add_argument("--methods", default="naive_rag,base_tool_call,agent", help="comma-separated eval methods")
    cmd.add_argument("--split", default="test", help="dataset split (default: test)")
    cmd.add_argument("--seeds", type=int, default=3, help="number of seeds, 0..N-1 (default 3)")
    mode = cmd.add_mutually_exclusive_group()
    # Sampling is the default: with greedy decoding every seed gives the same answers (std 0).
    mode.add_argument("--sample", dest="greedy", action="store_false", help="sample with each seed (default)")
    mode.add_argument("--greedy", dest="greedy", action="store_true", help="greedy decoding (temperature 0)")
    cmd.set_defaults(greedy=False)
    cmd.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the run's)")
    cmd.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts of the split")
    cmd.add_argument("--eval-id", default=None, help="default: a fresh id")


def _train(args: argparse.Namespace) -> int:
    from agent_core.validation import load_config
    from agent_core.io.layout import new_run_id

    overrides = list(args.overrides)
    if args.data_root:
        overrides.append(Override(f"data_root={args.data_root}", f"--data-root {args.data_root}"))
    run_id = check_run_id(args.run_id) if args.run_id is not None else new_run_id(args.command)
    configs = [resolve_config(name) for name in args.configs]
    config = load_config(configs, [*overrides, f"run_id={run_id}"], runnable=True)
    if args.dry_run:  # nothing is started and nothing is written
        print(config.to_yaml(), end="")
        return 0
    return _run_training(config)


def _resume(args: argparse.Namespace) -> int:
    from agent_core.validation import check_runnable, load_config
    from agent_core.io.layout import DataRoot

    data_root = args.data_root or DEFAULT_DATA_ROOT
    run = DataRoot(Path(data_root)).run(args.run_id)
    if not run.config_path.is_file():
        raise FileNotFoundError(f"run {args.run_id!r} has no config at {run.config_path}: is the run id right? (a run "
                                "stopped before it recorded its config has nothing to resume: start it again with "
                                f"`agentr1 train --run-id {args.run_id}`)")
    overrides = [*args.overrides, f"data_root={data_root}", f"run_id={args.run_id}"]
    config = check_runnable(load_config(run.config_path, overrides), str(run.config_path), overrides,
                            policy_source=not run.has_initial_policy)
    check_run_free(run.lock_path, args.run_id)  # before it says it resumes (_run_training checks it again)
    check_run_writable(run.run_dir, args.run_id)
    print(f"agentr1: resuming run {args.run_id}: stages whose manifests match are skipped", flush=True)
    return _run_training(config)


def _run_training(config) -> int:
    from agent_core.io.layout import DataRoot

    run_id = config.run_id
    # a second writer is refused now, not after the Prefect server started: the command holds the run's
    # lock from here on (the flow's run_lock runs under it)
    run = DataRoot(Path(config.data_root)).run(run_id)
    check_run_free(run.lock_path, run_id)
    check_run_writable(run.run_dir, run_id)  # a status.json folder or an immutable table: named now, not at the end
    with command_holds_run(run.lock_path, run_id):
        return _train_holding_the_lock(config)


def _train_holding_the_lock(config) -> int:
    run_id = config.run_id
    configure_environment(config.data_root)
    print(f"agentr1: run {run_id}: {config.iterations} iterations of "
          f"{config.data.prompts_per_iteration} prompts x {config.rollout.group_size} samples "
          f"({config.algorithm.estimator}, {config.rollout.engine} engine); data root {Path(config.data_root).resolve()}",
          flush=True)
    from agent_core.io.disk_budget import disk_full_tracebacks_dropped
    from flows.train import train  # imported after the environment is set: prefect reads it at import

    started = time.perf_counter()
    try:
        start_temporary_server()  # dies with this process, even a SIGKILLed one
        with disk_full_tracebacks_dropped():  # Prefect's failure lines stay, without a full disk's traceback
            result = train(config)
    except KeyboardInterrupt:  # Ctrl-C: what to type next, not Python's traceback through Prefect
        print(_interrupted(config, time.perf_counter() - started), file=sys.stderr, flush=True)
        return INTERRUPTED
    except Exception as error:  # a full disk, however a stage or Prefect wrapped it: one line and the resume
        line = disk_full_line(config, error)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return DISK_FULL
    _print_result(result, config.data_root, time.perf_counter() - started)
    return AUDIT_STOPPED if result.stopped else 0


def _interrupted(config, seconds: float) -> str:
    """The one line a Ctrl-C during a run prints: the resume command, or (stopped before the run
    recorded its config) that there is nothing to resume."""
    from agent_core.io.layout import DataRoot

    root = Path(config.data_root).resolve()
    if not DataRoot(root).run(config.run_id).config_path.is_file():
        return (f"agentr1: interrupted: run {config.run_id} stopped after {seconds:.0f}s, before it recorded "
                "anything: run the same command again to start it")
    return (f"agentr1: interrupted: run {config.run_id} stopped after {seconds:.0f}s; its finished stages are kept, "
            f"continue it with `agentr1 resume --run-id {config.run_id} --data-root {shlex.quote(str(root))}`")


def _print_result(result, data_root: str, seconds: float) -> None:
    print(f"\nagentr1: run {result.run_id} finished in {seconds:.0f}s")
    print(f"  tables:          {result.run_dir}/iteration=*/<table>.parquet")
    print(f"  MLflow store:    {result.tracking_uri} (run {result.mlflow_run_id})")
    print(f"  registered model: models:/{result.model_name}/{result.model_version} ({result.final_checkpoint}); "
          f"load it with mlflow.pyfunc.load_model, evaluate it with agentr1 eval --checkpoint")
    print(f"  report:          {Path(result.run_dir) / 'report' / 'report.md'} (curves: report/curves/*.png, also in MLflow)")
    print(f"  query:           agentr1 query --data-root {data_root} \"select iteration, count(*), avg(reward) from rewards group by 1 order by 1\"")
    print("\n  iteration  mean reward  train EM  dev EM  steps/episode    loss")
    print(f"  {'start':>9}  {'':>11}  {'':>8}  {_score(result.start_dev_em):>6}")
    for s in result.iterations:
        print(f"  {s.iteration:>9}  {s.mean_reward:>11.3f}  {s.em:>8.3f}  {_score(s.dev_em):>6}  "
              f"{s.steps_per_episode:>13.2f}  {s.loss:>6.3f}")
    print("  (train EM: the iteration's sampled rollouts; dev EM: greedy, held-out dev prompts after the iteration)")
    if result.stopped:
        print(f"\nagentr1: run {result.run_id} stopped early: {result.stopped}; continue it with "
              f"`agentr1 resume --run-id {result.run_id} --data-root {data_root}` (exit code {AUDIT_STOPPED})")


def _score(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def _view(args: argparse.Namespace) -> int:
    from flows.view_command import view_command

    return view_command(args, Path(args.data_root or DEFAULT_DATA_ROOT))


def _query(args: argparse.Namespace) -> int:
    from flows.query_command import query_command

    return query_command(args, Path(args.data_root or DEFAULT_DATA_ROOT))


def _rerun(args: argparse.Namespace) -> int:
    from agent_core.io.layout import DataRoot
    from flows.rerun import STAGES, rerun_stage

    data_root = args.data_root or DEFAULT_DATA_ROOT
    # bad input fails here, in one line, before the Prefect server starts
    if args.stage not in STAGES:
        raise ValueError(f"unknown --stage {args.stage!r}; valid stages: {', '.join(STAGES)}")
    run = DataRoot(Path(data_root)).run(check_run_id(args.run_id))
    if not run.config_path.is_file():
        raise FileNotFoundError(f"no run {args.run_id!r} under {Path(data_root) / 'runs'} (see `agentr1 runs`)")
    check_run_free(run.lock_path, args.run_id)  # a second writer hears that first
    check_rerun_inputs(data_root, args.run_id, args.iteration, args.stage)
    check_run_writable(run.run_dir, args.run_id)
    with command_holds_run(run.lock_path, args.run_id):
        configure_environment(data_root)
        start_temporary_server()
        from agent_core.io.disk_budget import disk_full_tracebacks_dropped

        with disk_full_tracebacks_dropped():  # a full disk: main's one line, Prefect's lines without a traceback
            written = rerun_stage(data_root, args.run_id, args.iteration, args.stage, list(args.overrides))
    print(f"agentr1: reran {args.stage} of run {args.run_id} iteration {args.iteration}: {written}")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from flows.runs_command import runs_command

    return runs_command(Path(args.data_root or DEFAULT_DATA_ROOT))


def _prune(args: argparse.Namespace) -> int:
    from flows.prune_command import prune_command

    return prune_command(Path(args.data_root or DEFAULT_DATA_ROOT), args.run_ids, args.overrides, args.dry_run)


def _audit(args: argparse.Namespace) -> int:
    from flows.audit_command import audit_command

    return audit_command(args.data_root or DEFAULT_DATA_ROOT, args.run_id, args.checks)


def _configs(args: argparse.Namespace) -> int:
    shipped = shipped_configs()
    if not shipped:
        print("agentr1: no shipped configs found (is the package installed with its data?)")
        return 1
    print(f"agentr1: {len(shipped)} configs shipped with the package; use one with `agentr1 train --config NAME` "
          "(repeat --config to layer files, later ones win key by key; copy one to edit it):")
    width = max(map(len, shipped))
    for name, path in shipped.items():
        print(f"  {name:<{width}}  {path}")
        description = _first_comment(path)
        if description:
            print(f"  {'':<{width}}    {description}")
    return 0


def _first_comment(path: Path) -> str:
    """The first line of a config's leading comment (each shipped config starts with one), `...` if it goes on."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "" if not lines else lines[0] + (" ..." if len(lines) > 1 else "")


def _eval(args: argparse.Namespace) -> int:
    data_root = args.data_root or DEFAULT_DATA_ROOT
    if args.seeds < 1 or (args.limit is not None and args.limit < 1):
        raise ValueError(f"--seeds and --limit must be >= 1, got --seeds {args.seeds} --limit {args.limit}")
    # a wrong run id, model, version or alias fails here, before Prefect starts
    check_eval_inputs(data_root, check_run_id(args.run_id), args.split, args.checkpoint, args.iteration)
    configure_environment(data_root)
    start_temporary_server()
    from flows.deployments import evaluate_training_run

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    started = time.perf_counter()
    result = evaluate_training_run(data_root, args.run_id, methods, iteration=args.iteration,
                                   checkpoint=args.checkpoint, split=args.split,
                                   seeds=args.seeds, limit=args.limit, greedy=args.greedy,
                                   temperature=args.temperature, eval_id=args.eval_id)
    print(f"\nagentr1: eval {result.eval_id} of run {args.run_id} ({args.split} split) in {time.perf_counter() - started:.0f}s\n")
    print(result.markdown)
    print(f"  report:       {result.report_path}")
    print(f"  eval tables:  {Path(result.report_path).parent}/<method>/seed=<s>/eval.parquet")
    print(f"  MLflow store: {result.tracking_uri} (experiment agentr1-eval, run {result.mlflow_run_id})")
    print(f"  query:        agentr1 query --data-root {data_root} \"select method, avg(em) from eval group by 1\"")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from agent_core.eval.experiment import load_experiment

    exp, config_dir = load_experiment(args.experiment)
    data_root = args.data_root or DEFAULT_DATA_ROOT
    configure_environment(data_root)
    start_temporary_server()
    from flows.experiment import experiment

    command = "agentr1 " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["experiment"] else f"agentr1 experiment --experiment {args.experiment}"
    result = experiment(exp, str(config_dir), data_root, command, args.overrides)
    print(f"\nagentr1: experiment {result.experiment_id} finished in {result.wall_seconds / 60:.1f} min\n")
    print(result.eval_markdown)
    print(f"  results page: {result.report_path}")
    print(f"  query:        agentr1 query --data-root {data_root} \"select method, avg(em) from eval group by 1\"")
    return 0


COMMANDS = {"demo": _train, "train": _train, "resume": _resume, "query": _query, "rerun": _rerun, "runs": _runs, "prune": _prune,
            "audit": _audit, "eval": _eval,
            "experiment": _experiment, "configs": _configs, "view": _view}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        data_root = getattr(args, "data_root", None)
        if data_root and Path(data_root).exists() and not Path(data_root).is_dir():
            raise ValueError(f"--data-root {data_root} is a file; it must be a folder (or not exist yet)")
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, KeyError, RunInUseError) as error:
        # user errors (config typos, missing runs, bad SQL) get one clear line, not a traceback; a file's
        # or folder's name in it (from a data root anyone may have written) never drives the terminal
        from agent_core.io.run_status import printable

        print(f"agentr1: error: {printable(str(error))}", file=sys.stderr)
        return 2
    except Exception as error:  # a full disk outside a run (rerun, eval, query --output): one line too
        from agent_core.io.disk_budget import disk_full_cause, disk_full_summary
        from agent_core.io.run_status import printable

        if (cause := disk_full_cause(error)) is None:
            raise
        print(f"agentr1: error: {printable(disk_full_summary(cause))}; free space, then run the command again",
              file=sys.stderr)
        return DISK_FULL
    except KeyboardInterrupt:  # outside a run (train and resume say how to resume)
        print(f"agentr1: interrupted: {args.command} stopped", file=sys.stderr, flush=True)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
