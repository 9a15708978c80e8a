"""Tool containment in the real agent loop (issue 7): whatever a tool does, only its own episode sees it.

Each test runs `run_episodes` with scripted actions, one case per episode (the engine double reads
the case from the prompt), and checks that the misbehaving episodes get an error or truncated
observation and go on, and that the others finish untouched. The python tool runs in the real
sandbox; the per-call and per-tool limits of execute_call are tested on their own in test_tools.py.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter

import pytest

from agent_core.envs import tools as tools_module
from agent_core.envs.base import EnvStep
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.sandbox import sandbox_layers
from agent_core.envs.tool_env import ToolEnv
from agent_core.envs.tools import Tool, ToolResult, abandoned_calls, function_tool
from agent_core.io.tables import write_table
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.rollout.records import json_text
from agent_core.training.model import build_tokenizer
from agent_core.types import ChatMessage, Prompt


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["print(6 * 7)", "import os, socket", "<tool_call>{\"name\": \"x\"}</tool_call>"], 300)


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class CaseEngine:
    """Step n of the episode whose prompt says "case=c" is scripts[c][n]; after the script, an answer."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts

    def generate(self, prompts, params):
        generations = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            script = self.scripts[re.search(r"case=(\w+)", text).group(1)]
            step = text.count("<|im_start|>assistant") - 1
            action = script[step] if step < len(script) else "<answer>done</answer>"
            ids = self.tokenizer.encode(action, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            generations.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return generations


def _roll(tokenizer, scripts, make, *, env_workers=8, max_steps=4, limit_s=60.0) -> dict[str, list]:
    """Each case's steps. Runs on a thread joined with a time limit: a stalled rollout fails the test
    instead of hanging the suite."""
    prompts = [Prompt(f"p-{case}", "test", "train", (ChatMessage("user", f"case={case}"),), ("done",), "tool_env")
               for case in scripts]
    settings = LoopSettings(group_size=1, max_steps=max_steps, max_context_tokens=8192, policy_version=0,
                            env_workers=env_workers, straggler_wait_s=0.05)
    sampling = SamplingParams(max_new_tokens=512, stop_token_ids=eos_token_ids(tokenizer))
    result: dict = {}

    def run() -> None:
        try:
            result["steps"] = run_episodes(CaseEngine(tokenizer, scripts), tokenizer, prompts, make, sampling, settings)
        except BaseException as error:  # noqa: BLE001 - re-raised on the test's thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"the rollout did not finish within {limit_s} s"
    if "error" in result:
        raise result["error"]
    by_case: dict[str, list] = {}
    for step in result["steps"]:
        by_case.setdefault(step.prompt_id[2:], []).append(step)
    return by_case


def _calls(step) -> list[dict]:
    return json.loads(step.tool_calls)


# ---- hung tools ------------------------------------------------------------------------------------


class Hang(Tool):
    name = "hang_forever"
    description = "Never returns until the test ends."
    parameters = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}

    def __init__(self, release: threading.Event):
        self.release = release
        super().__init__()

    def execute(self, arguments):
        self.release.wait()  # ignores every timeout: only the end of the test lets it go
        return "released"


@function_tool
def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: What to repeat.
    """
    return text


def test_hung_tool_calls_never_stall_other_episodes_and_their_threads_are_bounded(tokenizer, monkeypatch):
    monkeypatch.setattr(tools_module, "MAX_ABANDONED_CALLS_PER_TOOL", 4)
    release = threading.Event()
    hang = Hang(release)
    scripts = {f"stuck{i}": [_call("hang_forever", who=f"s{i}")] * 3 for i in range(4)}
    scripts |= {f"ok{i}": [_call("echo", text=f"hi{i}-{n}") for n in range(3)] for i in range(4)}
    make = lambda prompt: ToolEnv([hang, echo], "hermes", tool_timeout_s=0.25)  # noqa: E731
    try:
        started = time.monotonic()
        # two env workers for four episodes whose every call hangs: held workers would stall everything
        by_case = _roll(tokenizer, scripts, make, env_workers=2, max_steps=5)
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert all(len(steps) == 4 and steps[-1].termination == "answered" for steps in by_case.values())
    for i in range(4):
        assert [_calls(s)[0]["ok"] for s in by_case[f"ok{i}"][:3]] == [True] * 3
        assert f"hi{i}-2" in by_case[f"ok{i}"][2].observation_text
    kinds = Counter(_calls(s)[0]["error_kind"] for i in range(4) for s in by_case[f"stuck{i}"][:3])
    # 4 abandoned threads at most (one more if two calls started together), then refused at once
    assert 4 <= kinds["timeout"] <= 5 and kinds["timeout"] + kinds["unavailable"] == 12, kinds
    assert elapsed < 20, elapsed  # ~5 timeouts of 0.25 s on two workers; nothing waited for the hung threads
    deadline = time.monotonic() + 10
    while abandoned_calls("hang_forever") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned_calls("hang_forever") == 0  # released threads give their slots back


# ---- model-written code in the real sandbox -----------------------------------------------------------


def _sandbox_cases(port: int, outside: str) -> dict[str, tuple[str, str]]:
    """case -> (program, what its observation must show)."""
    denied = "except OSError as error:\n    print('DENIED', type(error).__name__)"
    return {
        "segfault": ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "killed by signal SIGSEGV"),
        "memory": ("x = bytearray(2**31)", "killed: memory limit (256 MB)"),
        "forever": ("while True:\n    pass", "timed out after 3s"),
        "network": (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n{denied}",
                    "DENIED"),
        "escape": (f"try:\n    open({outside!r}, 'w').write('pwned')\n{denied}", "DENIED"),
        "exits": ("import os\nprint('bye', flush=True)\nos._exit(3)", "bye\nexit code 3"),
        "floods": ("print('x' * 10**6)", "[truncated]"),
        "own_dir": ("open('f', 'w').write('kept')\nprint(open('f').read())", "kept"),  # its private temp dir
        "fine": ("print(6 * 7)", "42"),
    } | ({"disk": ("for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)",  # 100 MB in 1 MB files
                   "disk full: tried to write more than 64 MB in total")}
         if "tmpfs" in sandbox_layers() else {})  # no total cap without user namespaces


def test_model_code_that_crashes_hangs_or_escapes_is_contained_by_the_sandbox(tokenizer, tmp_path):
    outside = tmp_path / "escaped.txt"
    # 3 s, not 1: on busy cores (CI load ~8) a sandboxed interpreter can take over 1 s to start, and
    # the memory case then timed out before it could hit its memory limit
    python = {"name": "python", "kwargs": {"timeout_s": 3.0, "memory_mb": 256, "max_output_chars": 1000}}
    resources = EnvResources()
    with socket.create_server(("127.0.0.1", 0)) as server:
        cases = _sandbox_cases(server.getsockname()[1], str(outside))
        # after its bad program, each episode runs a good one: the episode and the tool go on
        scripts = {case: [_call("python", code=code), _call("python", code="print('next')")]
                   for case, (code, _) in cases.items()}
        by_case = _roll(tokenizer, scripts, lambda p: make_env("tool_env", {"tools": [python]}, resources),
                        env_workers=4)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the server
    assert not outside.exists()
    for case, (_, shown) in cases.items():
        first, second, last = by_case[case]
        assert shown in first.observation_text, (case, first.observation_text)
        assert _calls(first)[0]["ok"] and not first.done  # the tool worked: the program failed
        assert "next" in second.observation_text and last.termination == "answered"
    assert len(by_case["floods"][0].observation_text) < 1200
    assert json.loads(by_case["segfault"][0].info)["tool_info"][0]["killed_by"] == "signal"
    if "disk" in cases:
        assert json.loads(by_case["disk"][0].info)["tool_info"][0]["disk_full"] == "size"


# ---- tools that raise, flood, return garbage; a broken env -------------------------------------------


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def _weird_info() -> ToolResult:
    cycle: dict = {}
    cycle["self"] = cycle
    return ToolResult(text="lone \ud800 surrogate", info={(1, 2): float("nan"), "cycle": cycle, "big": 10**5000})


MISBEHAVING = {
    "raises": lambda: (_ for _ in ()).throw(_Unprintable()),
    "exits": lambda: (_ for _ in ()).throw(SystemExit(3)),
    "floods": lambda: "x" * 10_000_000,
    "garbage": lambda: object(),
    "weird_info": _weird_info,
}


class Misbehaving(Tool):
    description = "Misbehaves."
    parameters = {"type": "object", "properties": {}}

    def __init__(self, name: str):
        super().__init__(name=name)

    def execute(self, arguments):
        return MISBEHAVING[self.name]()


def test_tools_that_raise_flood_or_return_garbage_only_touch_their_own_step(tokenizer, tmp_path):
    tools = [Misbehaving(name) for name in MISBEHAVING] + [echo]
    scripts = {name: [_call(name)] for name in MISBEHAVING} | {"fine": [_call("echo", text="still here")]}
    scripts["lone_key"] = ['<tool_call>{"\\ud800": 1}</tool_call>']  # json.loads makes a lone surrogate
    scripts["deep"] = [_call("echo", text=json.loads("[" * 900 + "]" * 900))]  # deeper than asdict can copy
    by_case = _roll(tokenizer, scripts, lambda prompt: ToolEnv(tools, "hermes", max_result_chars=500))
    assert all([s.step_idx for s in steps] == [0, 1] and steps[1].termination == "answered"
               for steps in by_case.values())
    first = {case: steps[0] for case, steps in by_case.items()}
    kinds = {case: (_calls(step) or [{}])[0].get("error_kind") for case, step in first.items()}
    assert kinds == {"raises": "exception", "exits": "exception", "floods": None, "garbage": "exception",
                     "weird_info": None, "fine": None, "lone_key": None, "deep": "bad_arguments"}
    assert "could not be read" in first["raises"].observation_text
    assert "SystemExit: 3" in first["exits"].observation_text
    flood = first["floods"].observation_text
    assert len(flood) < 700 and "[truncated 9999500 chars]" in flood
    assert "returned object" in first["garbage"].observation_text
    assert "lone \ufffd surrogate" in first["weird_info"].observation_text
    weird = json.loads(first["weird_info"].info)["tool_info"][0]  # NaN, a tuple key, a cycle, a 5000-digit int
    assert weird["[1, 2]"] == "nan" and weird["big"] == "<int of 16610 bits>" and '"..."' in json.dumps(weird["cycle"])
    assert "missing_name" in first["lone_key"].parse_error and "\ufffd" in first["lone_key"].parse_error
    assert "still here" in first["fine"].observation_text
    rows = [{"run_id": "r", "iteration": 0, **vars(s)} for steps in by_case.values() for s in steps]
    write_table("steps", rows, tmp_path / "steps.parquet")  # every JSON column and text is storable


class _BrokenEnv:
    """Answers per case: a non-EnvStep, a NaN reward, done without a valid termination, bytes for
    text, dicts for ToolCalls, or fine."""

    observation_role = "user"

    def __init__(self, prompt):
        self.case = prompt.prompt_id[2:]

    def reset(self, prompt):
        return prompt.messages

    def step(self, action_text):
        return {
            "none": None,
            "nan_reward": EnvStep(observation="x", reward=float("nan"), done=False),
            "bad_termination": EnvStep(observation="", reward=0.0, done=True, termination="finished"),
            "not_text": EnvStep(observation=b"bytes", reward=0.0, done=False),
            "bad_calls": EnvStep(observation="x", reward=0.0, done=False, tool_calls=({"name": "search"},)),
        }.get(self.case, EnvStep(observation="", reward=0.0, done=True, termination="answered"))


def test_an_env_answering_with_garbage_ends_only_its_own_episode(tokenizer):
    cases = ["none", "nan_reward", "bad_termination", "not_text", "bad_calls", "fine"]
    by_case = _roll(tokenizer, {case: ["<answer>a</answer>"] for case in cases}, _BrokenEnv)
    endings = {case: (steps[-1].termination, json.loads(steps[-1].info).get("error", ""))
               for case, steps in by_case.items()}
    assert endings.pop("fine") == ("answered", "")
    assert all(termination == "error" and error for termination, error in endings.values()), endings
    assert "not EnvStep" in endings["none"][1] and "'finished'" in endings["bad_termination"][1]


def test_json_text_stores_what_json_dumps_refuses():
    deep = json.loads("[" * 900 + "]" * 900)
    text = json_text({(1, 2): float("inf"), "deep": deep, "s": "\udfff", "ok": [1, "é"]})
    value = json.loads(text)
    assert value["[1, 2]"] == "inf" and value["s"] == "\ufffd" and value["ok"] == [1, "é"]
    assert "NaN" not in json_text({"x": float("nan")}) and json_text({"a": 1}) == '{"a": 1}'
