"""The training flow run in this process with every stage, setup call and library call timed, for
bench/trl_compare.py and bench/memory.py: `run_pipeline` returns the flow's result and a `StageClock`
(wall and CPU seconds by iteration and stage, and events to line up with memory samples taken by
another process). Nothing in the library changes: the flow's stage functions and a few library
calls are wrapped for the run's duration and put back after it."""

from __future__ import annotations

import os
import time
from collections import defaultdict

from bench.common import cpu_seconds, process_tree

# flows.train's stage tasks (module attributes the flow body calls) -> name in the time split
STAGES = {"prepare_data": "prepare", "rollout": "rollout", "label_rewards": "rewards",
          "compute_advantages": "advantages", "train_policy": "train", "log_iteration": "tracking"}

# flows.train's calls before the first and after the last iteration (setup and wrap-up), timed as events
RUN_CALLS = ("_train", "record_config", "prepare_dataset", "init_policy", "start_tracking", "report_run",
             "finish_tracking")
# library calls timed wherever they happen: (module, attribute path, event label); a missing one is skipped
# (the library may have moved it), and its seconds are then reported as null
PROBES = (
    ("agent_core.rollout.vllm_server", "VLLMServer.start", "vllm_server_start"),
    ("agent_core.rollout.vllm_server", "VLLMServer.reload", "vllm_reload"),
    ("agent_core.rollout.hf_engine", "HFEngine.generate", "generate"),
    ("agent_core.rollout.vllm_engine", "VLLMEngine.generate", "generate"),
    ("agent_core.training.trainer", "_accumulate_and_step", "train_compute"),
)


class StageClock:
    """Wall seconds of every stage call, by iteration (stage tasks all take (run, iteration, ...)),
    and `events`: (label, iteration or None, start, end) in unix seconds for the stages
    ("stage:<label>"), flows.train's setup and wrap-up calls (RUN_CALLS) and the PROBES' library
    calls (generate, vLLM server start/reload, the trainer's forward/backward/step), so they can
    be lined up with memory samples taken by another process.
    before_iteration(k), if given, runs before iteration k's first stage, outside its timing.
    CPU seconds: this process's plus those of its live descendants (Prefect's server, a vLLM
    server), except the pids in `exclude_pids` and theirs (e.g. the TRL worker)."""

    def __init__(self, before_iteration=None):
        self.before_iteration = before_iteration
        self.exclude_pids: set[int] = set()
        self.seconds: dict[int, dict[str, float]] = defaultdict(dict)
        self.spans: dict[int, list[float]] = {}  # iteration -> [wall start, wall end, cpu start, cpu end]
        self.events: list[tuple[str, int | None, float, float]] = []
        self.probed: set[str] = set()  # PROBES labels that could be installed

    def cpu_now(self) -> float:
        others = process_tree(os.getpid(), frozenset(self.exclude_pids))[1:]
        return time.process_time() + sum(cpu_seconds(pid) for pid in others)

    def wrap(self, label: str, task):
        def timed(run, iteration, *args, **kwargs):
            if label == "prepare" and self.before_iteration is not None:
                self.before_iteration(iteration)
            started, cpu = time.time(), self.cpu_now()
            try:
                return task(run, iteration, *args, **kwargs)
            finally:
                ended, cpu_end = time.time(), self.cpu_now()
                self.events.append((f"stage:{label}", iteration, started, ended))
                self.seconds[iteration][label] = self.seconds[iteration].get(label, 0.0) + ended - started
                span = self.spans.setdefault(iteration, [started, ended, cpu, cpu_end])
                span[1], span[3] = ended, cpu_end
                if label == "tracking":
                    print(f"bench: pipeline iteration {iteration}: {span[1] - span[0]:.2f} s "
                          f"({', '.join(f'{k} {v:.2f}' for k, v in self.seconds[iteration].items())})", flush=True)
        return timed

    def wrap_call(self, label: str, fn):
        def timed(*args, **kwargs):
            started = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append((label, None, started, time.time()))
        return timed

    def iteration_seconds(self) -> list[float]:
        return [span[1] - span[0] for _, span in sorted(self.spans.items())]

    def iteration_cpu_seconds(self) -> list[float]:
        return [span[3] - span[2] for _, span in sorted(self.spans.items())]

    def within(self, label: str, start: float, end: float) -> float:
        """Seconds of [start, end] during which a `label` call was running (overlapping calls count once)."""
        intervals = sorted((max(s, start), min(e, end)) for name, _, s, e in self.events
                           if name == label and s < end and e > start)
        total, reach = 0.0, start
        for s, e in intervals:
            if e > reach:
                total += e - max(s, reach)
                reach = e
        return total

    def first(self, label: str) -> tuple[float, float] | None:
        found = [(s, e) for name, _, s, e in self.events if name == label]
        return min(found) if found else None

    def probes(self, k: int) -> dict[str, float | None]:
        """Iteration k's seconds in each probed call (None: the probe could not be installed)."""
        start, end = self.spans[k][0], self.spans[k][1]
        labels = dict.fromkeys(label for _, _, label in PROBES)
        return {label: (self.within(label, start, end) if label in self.probed else None) for label in labels}


def _resolve(module_name: str, path: str):
    """(owner object, attribute name) of `module.path`, or None when it does not exist."""
    import importlib

    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return None
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
    return (owner, name) if owner is not None and callable(getattr(owner, name, None)) else None


def run_pipeline(config, before_iteration=None, clock: StageClock | None = None) -> tuple[object, StageClock]:
    """Run the training flow with every stage, setup call and probe timed; returns (TrainResult, clock)."""
    from flows.environment import configure_environment

    configure_environment(config.data_root)  # before prefect is imported
    import flows.train as train_flow
    from agent_core.rollout.engines import shutdown_engines

    clock = clock or StageClock(before_iteration)
    patched = []  # (owner, name, original)
    for name, label in STAGES.items():
        patched.append((train_flow, name, getattr(train_flow, name)))
        setattr(train_flow, name, clock.wrap(label, getattr(train_flow, name)))
    for name in RUN_CALLS:
        patched.append((train_flow, name, getattr(train_flow, name)))
        setattr(train_flow, name, clock.wrap_call(f"run:{name}", getattr(train_flow, name)))
    for module_name, path, label in PROBES:
        target = _resolve(module_name, path)
        if target is None:
            print(f"bench: {module_name}.{path} not found: its seconds ({label}) are not measured", flush=True)
            continue
        owner, name = target
        patched.append((owner, name, owner.__dict__[name] if name in vars(owner) else getattr(owner, name)))
        setattr(owner, name, clock.wrap_call(label, getattr(owner, name)))
        clock.probed.add(label)
    started = time.time()
    try:
        result = train_flow.train(config)
    finally:
        clock.events.append(("run:train", None, started, time.time()))
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
        shutdown_engines()
    return result, clock
