"""The agent_program runner: a program per prompt, its answer from stdout, every fault a failure line."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from agent_core.envs.agent_program import ProgramJob, parse_agent_rewards, parse_answer, run_program, run_programs
from agent_core.envs.program_spec import ProgramSpec


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _spec(script: str, **kwargs) -> ProgramSpec:
    return ProgramSpec.from_env_kwargs({"command": [sys.executable, script], **kwargs})


def _job(key: str = "ep-0", **stdin) -> ProgramJob:
    return ProgramJob(key=key, stdin={"prompt_id": "p0", "messages": [], **stdin}, env={"AGENTR1_EPISODE_ID": key})


def _wait_gone(pgid: int, within_s: float = 5.0) -> bool:
    """True once no process is left in group `pgid` (bounded wait: killed processes need a moment)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_a_good_program_gets_its_stdin_and_env_and_answers(tmp_path):
    script = _script(tmp_path, "good.py", """
        import json, os, sys
        prompt = json.load(sys.stdin)
        print("thinking...")
        print(json.dumps({"answer": prompt["question"] + "|" + os.environ["AGENTR1_EPISODE_ID"]}))
        print("   ")
    """)
    outcome = run_program(_spec(script), _job("ep-7", question="what?"))
    assert outcome.failure is None, outcome.failure
    assert (outcome.key, outcome.answer, outcome.returncode) == ("ep-7", "what?|ep-7", 0)


def test_python_on_path_is_the_trainers_interpreter(tmp_path):
    script = _script(tmp_path, "which.py", """
        import json, sys
        print(json.dumps({"answer": sys.executable}))
    """)
    outcome = run_program(ProgramSpec.from_env_kwargs({"command": ["python", script]}), _job())
    assert outcome.failure is None, outcome.failure
    assert Path(outcome.answer).parent == Path(sys.executable).parent


def test_a_non_zero_exit_names_the_code_and_the_stderr_tail(tmp_path):
    script = _script(tmp_path, "crash.py", """
        import sys
        print('{"answer": "too late"}')
        sys.stderr.write("Traceback...\\nValueError: the agent broke\\n")
        sys.exit(3)
    """)
    outcome = run_program(_spec(script), _job())
    assert outcome.answer is None and outcome.returncode == 3
    assert outcome.failure.startswith("exit code 3: ") and "ValueError: the agent broke" in outcome.failure
    assert "\n" not in outcome.failure
    assert outcome.stderr_tail.endswith("ValueError: the agent broke\n")


def test_a_program_killed_by_a_signal_says_which(tmp_path):
    script = _script(tmp_path, "segv.py", """
        import os, signal
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    outcome = run_program(_spec(script), _job())
    assert outcome.returncode < 0 and outcome.failure.startswith("killed by signal SIGSEGV")


def test_a_hang_is_killed_with_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "pids.json"
    # The program starts a grandchild (same group) that ignores SIGTERM, then hangs itself.
    script = _script(tmp_path, "hang.py", f"""
        import json, os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(json.dumps({{"pgid": os.getpgid(0), "grandchild": child.pid}}))
        time.sleep(600)
    """)
    started = time.monotonic()
    outcome = run_program(_spec(script, timeout_s=1.5), _job())
    assert time.monotonic() - started < 10
    assert outcome.answer is None and outcome.failure == "timed out after 1.5 s (process group killed)"
    ids = json.loads(pid_file.read_text())
    assert ids["pgid"] != os.getpgid(0)  # its own group, not ours
    assert _wait_gone(ids["pgid"]), "processes of the program's group outlived the run"
    with pytest.raises(ProcessLookupError):
        os.kill(ids["grandchild"], 0)


def test_a_clean_exit_still_kills_what_it_left_in_its_group(tmp_path):
    pid_file = tmp_path / "pids.json"
    script = _script(tmp_path, "leaver.py", f"""
        import json, os, subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open({str(pid_file)!r}, "w").write(json.dumps({{"pgid": os.getpgid(0)}}))
        print(json.dumps({{"answer": "done"}}))
    """)
    outcome = run_program(_spec(script, timeout_s=20), _job())
    assert outcome.answer == "done" and outcome.failure is None
    assert _wait_gone(json.loads(pid_file.read_text())["pgid"])


@pytest.mark.parametrize("body, reason", [
    ("print('I think the answer is Paris')", "no JSON answer on the last stdout line: 'I think the answer is Paris'"),
    ("pass", "no JSON answer: stdout was empty"),
    ("print('{\"result\": \"Paris\"}')", "not a JSON object with a string \"answer\""),
    ("print('{\"answer\": 42}')", "not a JSON object with a string \"answer\""),
    ("print('[\"Paris\"]')", "not a JSON object with a string \"answer\""),
    ("import sys; sys.stdout.buffer.write(b'\\xff\\xfe{garbage\\n')", "no JSON answer on the last stdout line"),
])
def test_no_json_answer_is_a_failure_with_the_line_quoted(tmp_path, body, reason):
    outcome = run_program(_spec(_script(tmp_path, "bad.py", body)), _job())
    assert outcome.answer is None and outcome.returncode == 0
    assert reason in outcome.failure and "\n" not in outcome.failure


def test_huge_output_is_cut_to_its_end_and_the_answer_survives(tmp_path):
    script = _script(tmp_path, "flood.py", """
        import json, sys
        for _ in range(200):
            sys.stdout.write("x" * 50_000 + "\\n")   # 10 MB, far past the pipe's buffer
            sys.stderr.write("e" * 50_000 + "\\n")
        print(json.dumps({"answer": "survived"}))
    """)
    outcome = run_program(_spec(script, max_output_bytes=100_000, timeout_s=30), _job())
    assert outcome.failure is None, outcome.failure
    assert outcome.answer == "survived"
    assert len(outcome.stderr_tail) <= 2048


def test_huge_output_without_an_answer_says_it_was_cut(tmp_path):
    script = _script(tmp_path, "flood.py", "import sys\nsys.stdout.write('y' * 3_000_000)\n")
    outcome = run_program(_spec(script, max_output_bytes=10_000, timeout_s=30), _job())
    assert "no JSON answer" in outcome.failure and "stdout over 10000 bytes" in outcome.failure
    assert len(outcome.failure) < 1000


def test_a_program_that_never_reads_a_big_stdin_does_not_block(tmp_path):
    script = _script(tmp_path, "deaf.py", "print('{\"answer\": \"ok\"}')\n")
    outcome = run_program(_spec(script, timeout_s=20), _job(blob="z" * 2_000_000))
    assert outcome.answer == "ok", outcome.failure


def test_a_command_that_does_not_exist_is_a_failure(tmp_path):
    spec = ProgramSpec.from_env_kwargs({"command": [str(tmp_path / "no-such-agent")]})
    outcome = run_program(spec, _job())
    assert outcome.returncode is None and outcome.failure.startswith("could not start")


def test_max_parallel_bounds_how_many_run_at_once(tmp_path):
    # Each run marks itself running with a file, counts the others' marks, waits, then unmarks.
    marks = tmp_path / "running"
    marks.mkdir()
    script = _script(tmp_path, "counted.py", f"""
        import json, os, sys, time
        key = os.environ["AGENTR1_EPISODE_ID"]
        mark = os.path.join({str(marks)!r}, key)
        open(mark, "w").close()
        seen = 0
        for _ in range(20):
            seen = max(seen, len(os.listdir({str(marks)!r})))
            time.sleep(0.02)
        os.remove(mark)
        print(json.dumps({{"answer": str(seen)}}))
    """)
    jobs = [_job(f"ep-{index}") for index in range(7)]
    done: list[str] = []
    lock = threading.Lock()

    def on_done(outcome):
        with lock:
            done.append(outcome.key)

    outcomes = run_programs(_spec(script, max_parallel=2, timeout_s=30), jobs, on_done=on_done)
    assert [outcome.key for outcome in outcomes] == [job.key for job in jobs]  # job order
    assert all(outcome.failure is None for outcome in outcomes), [outcome.failure for outcome in outcomes]
    assert max(int(outcome.answer) for outcome in outcomes) <= 2
    assert sorted(done) == sorted(job.key for job in jobs)  # once each


def test_one_bad_program_does_not_spoil_the_others(tmp_path):
    script = _script(tmp_path, "mixed.py", """
        import json, os, sys
        if os.environ["AGENTR1_EPISODE_ID"] == "ep-1":
            sys.exit(2)
        print(json.dumps({"answer": "fine"}))
    """)
    outcomes = run_programs(_spec(script), [_job("ep-0"), _job("ep-1"), _job("ep-2")])
    assert [outcome.answer for outcome in outcomes] == ["fine", None, "fine"]
    assert outcomes[1].failure.startswith("exit code 2")


def test_parse_answer_takes_the_last_non_empty_line():
    assert parse_answer('{"answer": "first"}\nlog line\n{"answer": "last"}\n\n') == ("last", None)
    assert parse_answer('{"answer": "first"}\nlog line\n')[0] is None


@pytest.mark.parametrize("kwargs, message", [
    ({}, "env_kwargs.command is required"),
    ({"command": "python agent.py"}, "env_kwargs.command must be a non-empty list of non-empty strings"),
    ({"command": []}, "env_kwargs.command must be a non-empty list"),
    ({"command": ["python", None]}, "env_kwargs.command must be a non-empty list"),
    ({"command": ["python", True]}, "env_kwargs.command must be a non-empty list"),
    ({"command": ["python", ""]}, "env_kwargs.command must be a non-empty list"),
    ({"command": ["python"], "timeout_s": -1}, "env_kwargs.timeout_s must be a positive number"),
    ({"command": ["python"], "timeout_s": float("inf")}, "env_kwargs.timeout_s must be a positive number"),
    ({"command": ["python"], "timeout_s": True}, "env_kwargs.timeout_s must be a positive number"),
    ({"command": ["python"], "max_parallel": 0}, "env_kwargs.max_parallel must be an int >= 1"),
    ({"command": ["python"], "max_output_bytes": 1.5}, "env_kwargs.max_output_bytes must be an int >= 1"),
    ({"command": ["python"], "timeout": 5}, "unknown key(s) 'timeout'; valid keys: command, timeout_s"),
])
def test_bad_env_kwargs_are_one_line_errors_naming_the_key(kwargs, message):
    with pytest.raises(ValueError) as raised:
        ProgramSpec.from_env_kwargs(kwargs)
    text = str(raised.value)
    assert message in text and "\n" not in text and text.startswith("env 'agent_program'")


def test_good_env_kwargs_make_a_spec():
    spec = ProgramSpec.from_env_kwargs({"command": ["python", "a.py"], "timeout_s": 5, "max_parallel": 8})
    assert spec == ProgramSpec(command=("python", "a.py"), timeout_s=5.0, max_parallel=8)
    # YAML reads `[agent.py, --max-turns, 4]` with an int in it: numbers are argv as written
    assert ProgramSpec.from_env_kwargs({"command": ["a.py", "--max-turns", 4, 0.5]}).command == (
        "a.py", "--max-turns", "4", "0.5")


def test_agent_rewards_are_read_from_the_answer_line_and_checked():
    assert parse_agent_rewards('{"answer": "x", "agent_rewards": {"solver": 1, "planner": -0.25}}') == (
        {"solver": 1.0, "planner": -0.25}, None)
    assert parse_agent_rewards('{"answer": "x"}') == ({}, None)
    for bad in ('{"answer": "x", "agent_rewards": {"solver": "high"}}', '{"answer": "x", "agent_rewards": [1]}',
                '{"answer": "x", "agent_rewards": {"solver": true}}', '{"answer": "x", "agent_rewards": {"solver": 1e200}}',
                '{"answer": "x", "agent_rewards": {"solver": -100.5}}'):
        rewards, problem = parse_agent_rewards(bad)
        assert rewards == {} and problem.startswith("agent_rewards must map agent names to numbers in [-100, 100]"), bad
    assert parse_agent_rewards('{"answer": "x", "agent_rewards": {"solver": -100}}') == ({"solver": -100.0}, None)
