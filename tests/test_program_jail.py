"""Agent programs are untrusted (issue 39, items 2, 3 and 9): each runs in its own user, mount and PID
namespaces with a private /proc and the data root hidden but for the corpus.

Driven as the attacker did it: real hostile programs, run concurrently through the rollout driver
against the real gateway over the tiny policy, that scan /proc for their siblings' OPENAI_API_KEY
and call with it, write a table into the run, read mlflow.db, and leave grandchildren that call
setpgid/setsid. Each attack is also run without the jail, to show that the test can fail."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent_core.config import RolloutConfig
from agent_core.data.rows import document_to_row
from agent_core.envs.agent_program import ProgramJail, ProgramJob, ProgramSpec, run_program
from agent_core.io.tables import write_table
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage, Document, Prompt
from agent_core.drivers import DataAccess, roll_out

GROUP = 4
# Waits until all GROUP siblings run (a file each in the barrier folder), steals what /proc shows,
# calls the gateway with every stolen token and its own, attacks the data root, answers what it saw.
HOSTILE = textwrap.dedent("""
    import glob, json, os, sys, time, urllib.request
    prompt = json.load(sys.stdin)
    barrier, root = sys.argv[1], sys.argv[2]
    open(os.path.join(barrier, os.environ["AGENTR1_EPISODE_ID"]), "w").close()
    deadline = time.time() + 20
    while len(os.listdir(barrier)) < %d and time.time() < deadline:
        time.sleep(0.02)
    own, stolen = os.environ["OPENAI_API_KEY"], set()
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            for entry in open(path, "rb").read().split(b"\\0"):
                if entry.startswith(b"OPENAI_API_KEY=") and entry[15:].decode() != own:
                    stolen.add(entry[15:].decode())
        except OSError:
            pass
    def call(token):
        request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            data=json.dumps({"model": "policy", "messages": prompt["messages"]}).encode(),
            headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request).status
        except Exception as error:
            return str(error)
    served = [call(token) for token in sorted(stolen)]
    own_call = call(own)
    seen = {}
    for name, action in (("write_table", lambda: open(os.path.join(root, "runs", "r", "costs.parquet"), "wb").write(b"x")),
                         ("read_mlflow", lambda: open(os.path.join(root, "mlflow.db"), "rb").read()),
                         ("read_corpus", lambda: open(os.environ["AGENTR1_CORPUS"], "rb").read(4))):
        try:
            action()
            seen[name] = "ok"
        except OSError as error:
            seen[name] = error.strerror
    print(json.dumps({"answer": json.dumps({"stolen": len(stolen), "served_stolen": served.count(200),
                                            "own_call": own_call, **seen})}))
""" % GROUP)


@pytest.fixture(scope="module", autouse=True)
def namespaces(tmp_path_factory):
    """These tests need what the jail asks of the kernel; a machine that refuses it is named."""
    probe = run_program(ProgramSpec(command=(sys.executable, "-c", "print(1)")), ProgramJob("probe", {}, {}),
                        ProgramJail.around([tmp_path_factory.mktemp("probe")]))
    missing = dict(probe.jail.refused)
    if missing:
        pytest.skip(f"this machine refuses jail layers: {missing}")


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    tokenizer = build_tokenizer(["Who directed The Silent Harbor? Ana Kowalski was born in Gdansk."] * 20,
                                vocab_size=320)
    policy = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return HFEngine(policy, tokenizer), tokenizer


@pytest.fixture()
def data_root(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "runs" / "r").mkdir(parents=True)
    (root / "mlflow.db").write_bytes(b"SQLite format 3\0 the registry")
    write_table("corpus", [document_to_row(Document("d0", "Harbor", "The Silent Harbor, by Ana Kowalski."))],
                root / "datasets" / "d" / "corpus.parquet")
    return root


def _hostile_rollout(engine_and_tokenizer, tmp_path: Path, root: Path, jailed: bool) -> list[dict]:
    engine, tokenizer = engine_and_tokenizer
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    program = tmp_path / "hostile.py"
    program.write_text(HOSTILE)
    cfg = RolloutConfig(env="agent_program", group_size=GROUP, max_steps=1,
                        env_kwargs={"command": [sys.executable, str(program), str(barrier), str(root)],
                                    "max_parallel": GROUP, "timeout_s": 60},
                        max_new_tokens=4, max_context_tokens=512)
    prompt = Prompt("q0", "test", "train", (ChatMessage("user", "Who directed The Silent Harbor?"),),
                    ("Ana Kowalski",), "search_qa")
    records = roll_out(engine, tokenizer, [prompt], [], cfg, seed=0, policy_version=0, episode_prefix="",
                       access=DataAccess(str(root / "datasets" / "d" / "corpus.parquet"),
                                         str(root) if jailed else None))
    finals = {r.episode_id: json.loads(r.info) for r in records if r.done}
    assert len(finals) == GROUP, [(r.episode_id, r.info) for r in records]
    steps = {episode: sum(r.episode_id == episode for r in records) for episode in finals}
    # what each program saw (its answer), or why the gateway served it nothing
    return [{"steps": steps[episode], **_seen(info)} for episode, info in sorted(finals.items())]


def _seen(info: dict) -> dict:
    """What a program reported (its answer, scored or cut off by the budget), else why it got nothing."""
    answer = info.get("answer") or info.get("program_answer")
    return json.loads(answer) if answer else {"error": info.get("error", "no answer")}


def test_a_program_cannot_take_a_siblings_token_or_touch_the_data_root(engine_and_tokenizer, tmp_path, data_root):
    before = sorted(p.relative_to(data_root) for p in data_root.rglob("*"))
    seen = _hostile_rollout(engine_and_tokenizer, tmp_path, data_root, jailed=True)
    for program in seen:
        assert "error" not in program and program["stolen"] == program["served_stolen"] == 0, seen
        assert program["own_call"] == 200 and program["steps"] == 1, seen  # its own budget, untouched
        # the run folder is out of sight, and the root an empty read-only tmpfs
        assert program["write_table"] in ("No such file or directory", "Read-only file system"), seen
        assert program["read_mlflow"] == "No such file or directory", seen
        assert program["read_corpus"] == "ok", seen
    assert sorted(p.relative_to(data_root) for p in data_root.rglob("*")) == before


def test_without_the_jail_the_same_program_steals_tokens(engine_and_tokenizer, tmp_path, data_root):
    """The control: the attack works when programs share /proc and the data root."""
    seen = _hostile_rollout(engine_and_tokenizer, tmp_path, data_root, jailed=False)
    # a thief's answer says so, or a victim's own first call was refused: a thief used its budget
    assert any(program.get("stolen", 0) > 0 or "refused the first request" in program.get("error", "")
               for program in seen), seen
    assert (data_root / "runs" / "r" / "costs.parquet").exists()


ESCAPER = textwrap.dedent("""
    import os, subprocess, sys, time
    marker, ready = sys.argv[1], sys.argv[2]
    for k, how in enumerate(("os.setpgid(0, 0)", "os.setsid()")):
        subprocess.Popen([sys.executable, "-c", f"import os, time; {how}; open({ready!r} + '{k}', 'w').close(); "
                          "time.sleep(60)", marker])
    deadline = time.time() + 20
    while not all(os.path.exists(ready + str(k)) for k in range(2)) and time.time() < deadline:
        time.sleep(0.02)  # both have left the process group before the program ends
    print('{"answer": "left two behind"}')
""")


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("jailed", [True, False], ids=["jailed", "control"])
def test_a_grandchild_that_leaves_the_group_dies_with_the_program(tmp_path, jailed):
    program = tmp_path / "escaper.py"
    program.write_text(ESCAPER)
    marker = f"agentr1-escape-{os.getpid()}-{time.monotonic_ns()}"
    spec = ProgramSpec(command=(sys.executable, str(program), marker, str(tmp_path / "ready-")), timeout_s=30)
    jail = ProgramJail.around([tmp_path / "root-none"]) if jailed else None
    try:
        outcome = run_program(spec, ProgramJob("e0", {}, {}), jail)
        assert outcome.failure is None and outcome.answer == "left two behind"
        left = _processes_with(marker)
        if jailed:
            assert left == [] and "pid_namespace" in outcome.jail.layers
        else:
            assert len(left) == 2  # the control: both escaped the process-group kill
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_exit_codes_signals_and_timeouts_come_through_the_jail(tmp_path):
    jail = ProgramJail.around([tmp_path])
    run = (lambda code, timeout_s=30: run_program(ProgramSpec(command=(sys.executable, "-c", code),
                                                              timeout_s=timeout_s), ProgramJob("j", {}, {}), jail))
    assert run("import sys; sys.exit('broke down')").failure == "exit code 1: broke down"
    assert run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)").failure.startswith(
        "killed by signal SIGSEGV")
    started = time.monotonic()
    hung = run("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)", timeout_s=1)
    assert hung.failure == "timed out after 1 s (process group killed)" and time.monotonic() - started < 30
    assert run("print('{\"answer\": \"fine\"}')").answer == "fine"
    assert run_program(ProgramSpec(command=("no-such-agent-program",)), ProgramJob("j", {}, {}), jail).failure == (
        "exit code 127: could not start 'no-such-agent-program': No such file or directory")


def test_a_working_directory_inside_the_hidden_root_is_named(tmp_path, monkeypatch):
    (tmp_path / "root" / "work").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "root" / "work")
    outcome = run_program(ProgramSpec(command=(sys.executable, "-c", "print(1)")), ProgramJob("j", {}, {}),
                          ProgramJail.around([tmp_path / "root"]))
    assert outcome.failure.startswith("exit code 127: agent program jail: its working directory")
    assert "inside a hidden path such as the data root" in outcome.failure


def test_a_layer_the_kernel_refuses_is_named_and_the_rest_still_apply(tmp_path):
    """A tmpfs cannot cover a regular file (ENOTDIR): hidden_paths is refused with the kernel's
    reason, the program still runs in its own PID namespace."""
    afile = tmp_path / "a-file"
    afile.write_text("not a directory")
    outcome = run_program(ProgramSpec(command=(sys.executable, "-c", "print('{\"answer\": \"ran\"}')")),
                          ProgramJob("j", {}, {}), ProgramJail.around([afile]))
    assert outcome.answer == "ran"
    refused = dict(outcome.jail.refused)
    assert "hidden_paths" not in outcome.jail.layers and "Not a directory" in refused["hidden_paths"]
    assert {"pid_namespace", "private_proc", "locked_mounts"} <= set(outcome.jail.layers)
