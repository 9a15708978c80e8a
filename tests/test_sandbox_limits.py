"""The python sandbox's status channel and its total disk cap (issue 29); every test is a real run.

A program must not be able to change what the caller reports about it: it writes forged status
lines to every descriptor it can reach, signals itself with SIGXCPU, and the caller still reports
what happened. And the files one call writes are capped in total (the tmpfs layer), not only each
file: many files past the cap stop with ENOSPC and a "disk full" line, with at most the cap stored.
"""

from __future__ import annotations

import signal
import textwrap

import pytest

from agent_core.envs.sandbox import DEFAULT_DISK_MB, run_python, sandbox_layers
from tests.test_sandbox import attempts

# Written to every descriptor the program finds: what the old status pipe understood ("memory"),
# an empty and a made-up layer list, and a timeout claim.
FORGE = """
import os
payload = b"memory\\nlayers \\nlayers rlimits\\ntimeout\\nkilled_by timeout\\n"
written = []
for fd in range(1024):
    try:
        os.write(fd, payload)
        written.append(fd)
    except OSError:
        pass
try:
    names = os.listdir("/proc/self/fd")
except OSError:
    names = []
for name in names:
    try:
        with open("/proc/self/fd/" + name, "wb", buffering=0) as file:
            file.write(payload)
        written.append("proc/" + name)
    except OSError:
        pass
print("\\nWROTE", written, flush=True)
"""


@pytest.fixture(params=["default", "no_layers"])
def layers(request) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """(the layers argument, the layers the run must report): the default sandbox, and none at all
    (the program may then do anything, yet the channel is already gone)."""
    return (None, sandbox_layers()) if request.param == "default" else ((), ())


def test_writing_to_every_descriptor_does_not_change_the_status(layers):
    wanted, reported = layers
    result = run_python(FORGE, layers=wanted)
    wrote = result.stdout.rsplit("WROTE", 1)[-1]
    assert "1" in wrote and "2" in wrote, result  # the program did write: its stdout and stderr at least
    assert (result.exit_code, result.killed_by, result.timed_out) == (0, None, False), result
    assert result.layers == reported
    assert result.tool_text().endswith("killed_by timeout")  # its own stderr: the caller added no reason


def test_a_forged_status_then_a_real_timeout_is_reported_as_the_timeout(layers):
    wanted, reported = layers
    result = run_python(FORGE + "\nwhile True:\n    pass\n", layers=wanted, timeout_s=1.0)
    assert result.killed_by == "timeout" and result.timed_out and result.layers == reported, result


def test_a_program_signalling_itself_with_sigxcpu_does_not_look_timed_out():
    """SIGXCPU is what RLIMIT_CPU sends; the caller counts it as a timeout only if the kernel's CPU
    seconds for the child reached the limit."""
    result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)", timeout_s=5.0)
    assert result.exit_code == -signal.SIGXCPU and "rlimits" in result.layers
    assert (result.killed_by, result.timed_out) == ("signal", False), result
    assert result.tool_text() == "killed by signal SIGXCPU"


def test_the_program_never_runs_if_the_handshake_misses_the_timeout():
    result = run_python("print('ran')", timeout_s=0.001)  # no interpreter starts in a millisecond
    assert result.timed_out and result.killed_by == "timeout" and result.stdout == "" and result.layers == ()


# ---- the total disk cap ------------------------------------------------------------------------------


def tmpfs_or_skip(*others: str) -> tuple[str, ...]:
    """Skips where this machine refuses user namespaces (there is no total cap there, see sandbox.py);
    where it has them (the netns layer), the tmpfs must be there too: these tests then fail without it."""
    if "netns" not in sandbox_layers():
        pytest.skip("this machine refuses user namespaces: no tmpfs, so no total disk cap")
    missing = [layer for layer in others if layer not in sandbox_layers()]
    if missing:
        pytest.skip(f"this machine has no {', '.join(missing)} layer")
    return ("tmpfs", *others)


# Writes 1 MB files until 3 * the cap or an error; then, in any case, the bytes and blocks its files hold.
MANY_FILES = """
import os
try:
    for i in range(3 * {disk_mb}):
        with open("f%03d" % i, "wb") as file:
            file.write(b"x" * 2**20)
finally:
    files = [os.stat(name) for name in os.listdir(".") if name.startswith("f")]
    print("HELD", len(files), sum(f.st_size for f in files), sum(f.st_blocks * 512 for f in files), flush=True)
"""


def _held(result) -> tuple[int, int, int]:
    line = next(line for line in result.stdout.splitlines() if line.startswith("HELD "))
    files, size, blocks = map(int, line.split()[1:])
    return files, size, blocks


def test_the_control_many_files_exceed_the_cap_without_the_tmpfs():
    result = run_python(MANY_FILES.format(disk_mb=4), layers=(), disk_mb=4)
    assert result.exit_code == 0 and _held(result)[:2] == (12, 12 * 2**20), result


@pytest.mark.parametrize("layer", [None, "tmpfs"])
def test_many_files_past_the_total_cap_stop_with_disk_full_and_at_most_the_cap_held(layer):
    alone = tmpfs_or_skip()
    layers = alone if layer else None
    cap = 8 * 2**20
    result = run_python(MANY_FILES.format(disk_mb=8), disk_mb=8, layers=layers)
    files, size, blocks = _held(result)
    # The kernel refuses the write that would pass the cap, so there is no file's slack: at most the
    # cap is held (8 whole files and the 9th, empty, whose write failed).
    assert 8 <= files <= 9 and cap - 2**20 <= size <= cap and blocks <= cap, result
    assert result.exit_code == 1 and result.stderr.rstrip().endswith("OSError: [Errno 28] No space left on device")
    assert result.disk_full == "size"
    assert "disk full: tried to write more than 8 MB in total (the limit for one call)" in result.tool_text()


def test_the_default_cap_and_the_file_count_cap():
    tmpfs_or_skip()
    result = run_python(MANY_FILES.format(disk_mb=DEFAULT_DISK_MB))
    assert result.disk_full == "size" and _held(result)[1] <= DEFAULT_DISK_MB * 2**20, result
    assert f"tried to write more than {DEFAULT_DISK_MB} MB in total" in result.tool_text()
    many = run_python("for i in range(5000):\n    open(str(i), 'w').close()")
    assert many.disk_full == "files" and "No space left on device" in many.stderr, many
    assert "disk full: tried to create more than 4096 files" in many.tool_text()
    fine = run_python("open('a', 'wb').write(b'x' * 2**20)")
    assert fine.disk_full is None and fine.exit_code == 0 and fine.tool_text() == "(no output)"


REMOUNT = """
import ctypes, os
def remount():
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.getcwd().encode()
    if libc.umount2(here, 2) == 0:  # MNT_DETACH
        return "unmounted"
    if libc.unshare(0x20000) != 0:  # a mount namespace of its own, then a bigger tmpfs
        raise OSError(ctypes.get_errno(), "unshare")
    if libc.mount(b"tmpfs", here, b"tmpfs", 0, b"size=1g") != 0:
        raise OSError(ctypes.get_errno(), "mount")
    return "remounted"
attempt("remount", remount)
"""


@pytest.mark.parametrize("others, verdict", [
    ((), "ALLOWED"),  # the control: the tmpfs alone does not stop ctypes
    (None, "DENIED"), (("seccomp",), "DENIED"), (("landlock_fs",), "DENIED"), (("no_capabilities",), "DENIED"),
    (("audit_hook",), "DENIED"),
])
def test_the_program_cannot_unmount_or_replace_its_tmpfs(others, verdict):
    chosen = tmpfs_or_skip(*(others or ()))
    layers = None if others is None else chosen
    verdicts, result = attempts(textwrap.dedent(REMOUNT), layers=layers)
    assert verdicts == {"remount": verdict}, result
    assert "unmounted" not in result.stdout  # never: the mount belongs to a namespace it has no capability in
