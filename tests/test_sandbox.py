"""The python sandbox (agent_core.envs.sandbox); every test is a real subprocess run.

Each attack is first shown to work on this machine with every layer off (`layers=()`), so a
"denied" below proves isolation rather than a missing file, server or binary. The default
sandbox (every layer this machine has) must stop each attack; where this machine has a kernel
layer, that layer alone must stop it too (those per-layer runs skip when the layer is missing;
the default runs never skip).
"""

from __future__ import annotations

import os
import socket
import textwrap
import threading
import time

import pytest

from agent_core.envs.sandbox import (
    MEMORY_EXIT_CODE,
    SANDBOX_LAYERS,
    TRUNCATION_MARKER,
    SandboxResult,
    run_python,
    sandbox_layers,
)

ATTEMPT = """
import os, socket, subprocess, sys
def attempt(name, action):
    try:
        value = action()
    except OSError as exc:
        print("DENIED", name, type(exc).__name__)
    else:
        print("ALLOWED", name, repr(value)[:300])
"""


def attempts(body: str, layers=None, **limits) -> tuple[dict[str, str], SandboxResult]:
    """Run ATTEMPT + body; {attempt name: "ALLOWED"/"DENIED"} and the result."""
    result = run_python(ATTEMPT + textwrap.dedent(body), layers=layers, **limits)
    verdicts = {line.split()[1]: line.split()[0] for line in result.stdout.splitlines()
                if line.startswith(("ALLOWED ", "DENIED "))}
    return verdicts, result


def layer_or_skip(layer: str | None) -> tuple[str, ...] | None:
    if layer is not None and layer not in sandbox_layers():
        pytest.skip(f"this machine has no {layer} layer (has: {', '.join(sandbox_layers())})")
    return None if layer is None else (layer,)


# ---- running code ---------------------------------------------------------------------------------


def test_prints_and_exit_codes():
    ok = run_python("print('hello', 6 * 7)\nprint('é😀')")
    assert (ok.stdout, ok.stderr, ok.exit_code) == ("hello 42\né😀\n", "", 0)
    assert not ok.timed_out and ok.killed_by is None and not ok.truncated
    assert ok.tool_text() == "hello 42\né😀"
    failed = run_python("import sys\nprint('partial')\nsys.exit(3)")
    assert (failed.exit_code, failed.killed_by) == (3, None)
    assert failed.tool_text() == "partial\nexit code 3"


def test_exception_gives_the_programs_traceback_and_exit_code_1():
    result = run_python("x = 1\ny = x / 0\n")
    assert result.exit_code == 1 and result.killed_by is None and result.stdout == ""
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"main.py\", line 2, in <module>")
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "sandbox.py" not in result.stderr  # the bootstrap's own frames are not the model's business
    assert result.tool_text().startswith("stderr:\nTraceback") and result.tool_text().endswith("exit code 1")


def test_a_blocked_call_reports_the_programs_line_not_the_sandbox():
    result = run_python("open('/etc/passwd').read()")
    assert 'File "main.py", line 1' in result.stderr and "sandbox.py" not in result.stderr
    assert "PermissionError" in result.stderr and result.exit_code == 1


def test_syntax_error():
    result = run_python("def f(:\n    pass")
    assert result.exit_code == 1 and "SyntaxError" in result.stderr and 'File "main.py", line 1' in result.stderr


def test_infinite_loop_is_stopped_by_the_timeout_keeping_earlier_output():
    started = time.monotonic()
    result = run_python("print('started', flush=True)\nwhile True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + 5
    assert result.timed_out and result.killed_by == "timeout" and 1.0 <= result.seconds < 6
    assert result.stdout == "started\n"
    assert result.tool_text() == "started\ntimed out after 1s"


def test_allocating_2_gb_under_a_256_mb_limit_fails_with_memory_error():
    result = run_python("data = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert "allocated" not in result.stdout
    assert result.killed_by == "memory" and result.exit_code == MEMORY_EXIT_CODE and not result.timed_out
    assert result.stderr.rstrip().endswith("MemoryError")
    assert result.tool_text().endswith("killed: memory limit (256 MB)")


def test_output_is_capped_without_blocking_on_a_flood():
    result = run_python("import sys\nprint('x' * 20_000_000)\nprint('y' * 300, file=sys.stderr)",
                        max_output_chars=100)
    assert result.stdout == "x" * 100 + TRUNCATION_MARKER
    assert result.stderr == "y" * 100 + TRUNCATION_MARKER
    assert result.truncated and result.exit_code == 0 and result.seconds < 5
    assert not run_python("print('x' * 100)", max_output_chars=101).truncated


def test_files_in_the_working_directory_work_and_the_directory_is_removed():
    code = """
    import os
    with open('notes.txt', 'w') as file:
        file.write('kept for this run')
    os.mkdir('sub'); os.chmod('sub', 0)  # cleanup must cope with a directory the program locked
    print(open('notes.txt').read())
    print(os.getcwd()); print(os.environ['HOME']); print(os.environ['TMPDIR'])
    """
    result = run_python(textwrap.dedent(code))
    printed, cwd, home, tmpdir = result.stdout.splitlines()
    assert printed == "kept for this run" and result.exit_code == 0
    assert cwd == home == tmpdir and os.path.isabs(cwd)
    assert not os.path.exists(cwd)
    assert cwd != run_python("import os; print(os.getcwd())").stdout.strip()  # a fresh directory per call


def test_parent_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2-do-not-leak")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('SANDBOX_TEST_SECRET'))")
    assert result.stdout.splitlines() == ["['HOME', 'LANG', 'PATH', 'TMPDIR']", "None"]


def test_threads_still_work():
    code = "from concurrent.futures import ThreadPoolExecutor\nwith ThreadPoolExecutor(4) as pool:\n" \
           "    print(sum(pool.map(lambda x: x * x, range(100))))"
    assert run_python(code).stdout == "328350\n"


def test_concurrent_calls_are_independent():
    results: dict[int, SandboxResult] = {}

    def run(i: int) -> None:
        results[i] = run_python(f"import os\nopen('mine', 'w').write('{i}')\nprint(open('mine').read(), os.getcwd())")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i].stdout.split()[0] for i in range(4)] == ["0", "1", "2", "3"]
    assert len({results[i].stdout.split()[1] for i in range(4)}) == 4


# ---- isolation ---------------------------------------------------------------------------------------


def filesystem_attacks(tmp_path) -> str:
    secret = tmp_path / "secret.txt"
    secret.write_text("the-test-secret")
    return f"""
    attempt("read_passwd", lambda: open("/etc/passwd").read())
    attempt("read_secret", lambda: open({str(secret)!r}).read())
    attempt("write_outside", lambda: open({str(tmp_path / "written.txt")!r}, "w").write("pwned"))
    attempt("list_root", lambda: os.listdir("/"))
    """


def test_attacks_work_without_the_sandbox(tmp_path):
    """The control: with every layer off, each attack below succeeds on this machine."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)
    body = filesystem_attacks(tmp_path) + f"""
    attempt("connect", lambda: socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), timeout=5).close())
    attempt("subprocess", lambda: subprocess.run(["ls"], capture_output=True).returncode)
    attempt("system", lambda: os.system("echo SHELL-RAN"))
    attempt("signal_test_process", lambda: os.kill({os.getpid()}, 0))
    """
    with server:
        verdicts, result = attempts(body, layers=())
        server.accept()[0].close()
    assert set(verdicts.values()) == {"ALLOWED"} and len(verdicts) == 8, result.stdout + result.stderr
    assert "SHELL-RAN" in result.stdout
    assert "the-test-secret" in result.stdout and (tmp_path / "written.txt").read_text() == "pwned"


@pytest.mark.parametrize("layer", [None, "landlock_fs", "audit_hook"])
def test_no_filesystem_access_outside_the_working_directory(tmp_path, layer):
    verdicts, result = attempts(filesystem_attacks(tmp_path), layers=layer_or_skip(layer))
    assert verdicts == dict.fromkeys(["read_passwd", "read_secret", "write_outside", "list_root"], "DENIED"), result
    assert "the-test-secret" not in result.stdout
    assert not (tmp_path / "written.txt").exists()


@pytest.mark.parametrize("layer", [None, "netns", "landlock_net", "seccomp", "audit_hook"])
def test_no_tcp_connection_to_a_listening_local_server(layer):
    layers = layer_or_skip(layer)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(5)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the server is really there
        server.accept()[0].close()
        verdicts, result = attempts(f"""
        attempt("connect", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=3).close())
        """, layers=layers)
        assert verdicts == {"connect": "DENIED"}, result
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the server either


@pytest.mark.parametrize("layer", [None, "seccomp", "audit_hook"])
def test_no_subprocesses_or_forks(layer):
    verdicts, result = attempts("""
    def fork_and_reap():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        return os.waitpid(pid, 0)
    attempt("subprocess", lambda: subprocess.run(["ls"], capture_output=True).returncode)
    attempt("fork", fork_and_reap)
    attempt("system", lambda: os.system("echo SHELL-RAN"))  # without the hook it returns an error code
    """, layers=layer_or_skip(layer))
    assert verdicts["subprocess"] == verdicts["fork"] == "DENIED", result
    assert "SHELL-RAN" not in result.stdout


def test_a_fork_loop_is_stopped_at_the_first_fork():
    # Bounded even if isolation broke: at most 100 sleeping children, which die with the run.
    code = "import os, time\nfor _ in range(100):\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)"
    started = time.monotonic()
    result = run_python(code, timeout_s=5.0)
    assert not result.timed_out and time.monotonic() - started < 5
    assert result.exit_code == 1 and "PermissionError" in result.stderr and 'line 3' in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="the kernel never enforces RLIMIT_NPROC for uid 0")
def test_rlimit_nproc_caps_tasks_in_the_namespace():
    if "netns" not in sandbox_layers():
        pytest.skip("RLIMIT_NPROC is only set in a user namespace, which this machine refuses")
    code = """
    import os, time
    forked = 0
    for _ in range(200):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(2); os._exit(0)
        forked += 1
    print(forked)
    """
    result = run_python(textwrap.dedent(code), layers=("rlimits", "netns"))
    assert 0 < int(result.stdout) < 32


@pytest.mark.parametrize("layer", [None, "landlock_scope", "seccomp", "audit_hook"])
def test_no_signals_to_processes_outside(layer):
    verdicts, result = attempts(f'attempt("signal_test_process", lambda: os.kill({os.getpid()}, 0))',
                                layers=layer_or_skip(layer))
    assert verdicts == {"signal_test_process": "DENIED"}, result


def test_a_left_behind_process_is_killed_with_the_run():
    """Even with every layer off, a child the program leaves running dies with the run."""
    result = run_python("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\nprint(pid)", layers=())
    orphan = int(result.stdout)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(orphan):
        time.sleep(0.05)
    assert not _alive(orphan)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped
    except FileNotFoundError:
        return False


# ---- layers and arguments ----------------------------------------------------------------------------


def test_layers_are_reported():
    available = sandbox_layers()
    assert {"rlimits", "audit_hook"} <= set(available) <= set(SANDBOX_LAYERS)
    assert run_python("pass").layers == available
    assert run_python("pass", layers=("rlimits", "audit_hook")).layers == ("rlimits", "audit_hook")
    assert run_python("pass", layers=()).layers == ()


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="unknown sandbox layer.*'landlok'.*valid: rlimits, netns"):
        run_python("pass", layers=("landlok",))
    with pytest.raises(ValueError, match="memory_mb must be an int >= 64"):
        run_python("pass", memory_mb=8)
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        run_python("pass", timeout_s=0)
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")


def test_tool_text_when_there_is_no_output():
    result = SandboxResult(stdout="", stderr="", exit_code=0, timed_out=False, killed_by=None, seconds=0.1,
                           truncated=False, layers=(), timeout_s=5.0, memory_mb=512)
    assert result.tool_text() == "(no output)"
    killed = SandboxResult(stdout="", stderr="", exit_code=-11, timed_out=False, killed_by="signal", seconds=0.1,
                           truncated=False, layers=(), timeout_s=5.0, memory_mb=512)
    assert killed.tool_text() == "killed by signal SIGSEGV"


def test_the_python_tool_is_registered_and_runs_in_the_sandbox():
    from agent_core.envs.tools import TOOLS, execute_call, make_tool

    assert "python" in TOOLS
    tool = make_tool("python", {"timeout_s": 1.0, "max_output_chars": 50}, resources=None)
    assert tool.timeout_s > 1.0  # the sandbox's own timeout must fire first
    outcome = execute_call({"python": tool}, "python", {"code": "print(6 * 7)"}, default_timeout_s=30)
    assert outcome.ok and outcome.text == "42" and outcome.info["exit_code"] == 0
    assert outcome.info["sandbox_layers"] == list(sandbox_layers())
    slow = execute_call({"python": tool}, "python", {"code": "while True: pass"}, default_timeout_s=30)
    assert slow.ok and slow.text == "timed out after 1s" and slow.info["killed_by"] == "timeout"
    with pytest.raises(ValueError, match="memory_mb"):
        make_tool("python", {"memory_mb": 1}, resources=None)
