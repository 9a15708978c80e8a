"""The agent program's jail: run as `python -I -S program_jail.py SPEC` by `agent_core.envs.agent_program`.

Standard library only. It enters a new user + mount + PID namespace, hides each `hide` path under
an empty read-only tmpfs (the data root: other runs, mlflow.db, this run's tables) with each
`expose` path bound back read-only (the corpus), and forks the namespace's init. The init mounts a
private /proc (siblings' environments, and so their tokens, are out of sight), nests one more user +
mount namespace so that none of these mounts can be undone, then runs the program and waits for it.
When the program exits the init exits with its status and the kernel kills every process left in
the namespace, whatever it called (setsid, setpgid, double forks). See docs/reliability.md.

The status line (JSON: layers applied, why each missing one was refused) goes to `status_fd`, which
is closed before the program starts; a layer the kernel refuses is left out and the rest still apply.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import struct
import sys

_NEWNS, _NEWUSER, _NEWPID = 0x00020000, 0x10000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE = 1 << 14, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> the mount flag a read-only remount must keep (the kernel refuses to clear a
# flag the caller's namespace inherited locked)
_KEPT_FLAGS = ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
               (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME))
LAYERS = ("pid_namespace", "hidden_paths", "private_proc", "locked_mounts")
START_FAILED = 127  # the program could not be started (its stderr says why)

_LIBC = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _unshare(flags: int, what: str) -> None:
    _check(_LIBC.unshare(ctypes.c_int(flags)), what)


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    encode = (lambda text: None if text is None else text.encode())
    _check(_LIBC.mount(encode(source), target.encode(), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _map_ids(uid: int, gid: int) -> None:
    """Map our own ids, so files keep their owners and the program keeps its uid."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)


def _remount_read_only(target: str) -> None:
    flags = os.statvfs(target).f_flag
    kept = sum(mount_flag for stat_flag, mount_flag in _KEPT_FLAGS if flags & stat_flag)
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)


def _hide(hidden: str, exposed: list[str]) -> None:
    """An empty read-only tmpfs over `hidden`, with each path of `exposed` beneath it bound back
    read-only at its own path (opened before the tmpfs covers it, bound through /proc/self/fd)."""
    handles = [(path, os.open(path, os.O_PATH)) for path in exposed]
    _mount("tmpfs", hidden, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=1m,nr_inodes=4096,mode=0755")
    for path, handle in handles:
        is_dir = os.path.isdir(f"/proc/self/fd/{handle}")
        os.makedirs(path if is_dir else os.path.dirname(path), exist_ok=True)
        if not is_dir:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o444))
        _mount(f"/proc/self/fd/{handle}", path, None, _MS_BIND | _MS_REC)
        _remount_read_only(path)
        os.close(handle)
    _remount_read_only(hidden)


def _enter(spec: dict, status: dict) -> bool:
    """The outer namespaces and the hidden paths; False (and why, in `status`) if none could be made."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare(_NEWUSER | _NEWNS | _NEWPID, "unshare(user, mount, pid namespaces)")
        _map_ids(uid, gid)
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the caller's namespace
    except OSError as error:
        status["refused"] = {layer: str(error) for layer in LAYERS}
        return False
    status["layers"].append("pid_namespace")
    try:
        for hidden in spec["hide"]:
            _hide(hidden, [p for p in spec["expose"] if p == hidden or p.startswith(hidden.rstrip("/") + "/")])
        status["layers"].append("hidden_paths")
    except OSError as error:
        status["refused"]["hidden_paths"] = str(error)
    return True


def _init(spec: dict, status: dict, status_fd: int, result_fd: int) -> None:
    """pid 1 of the new namespace: private /proc, locked mounts, then the program; its wait status
    goes to `result_fd` and the init exits, taking every other process of the namespace with it."""
    _LIBC.prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    try:
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        status["layers"].append("private_proc")
    except OSError as error:
        status["refused"]["private_proc"] = str(error)
    uid, gid = os.geteuid(), os.getegid()
    try:  # mounts copied into a less privileged namespace are locked: the program cannot unmount them
        _unshare(_NEWUSER | _NEWNS, "unshare(nested user, mount namespaces)")
        _map_ids(uid, gid)
        status["layers"].append("locked_mounts")
    except OSError as error:
        status["refused"]["locked_mounts"] = str(error)
    _report(status_fd, status)
    for forwarded in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(forwarded, lambda number, _frame: _forward(number))
    program = _start(spec)
    while True:  # reap adopted orphans until the program itself ends
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if pid == program:
            os.write(result_fd, struct.pack("i", wait_status))
            os._exit(0)


_PROGRAM = [0]


def _forward(number: int) -> None:
    if _PROGRAM[0]:
        try:
            os.kill(_PROGRAM[0], number)
        except ProcessLookupError:
            pass


def _start(spec: dict) -> int:
    pid = os.fork()
    if pid:
        _PROGRAM[0] = pid
        return pid
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    try:
        os.chdir(spec["cwd"])
    except OSError as error:
        _fail(f"agent program jail: its working directory {spec['cwd']!r} is out of reach "
              f"(inside a hidden path such as the data root?): {error.strerror}")
    try:
        os.execvpe(spec["argv"][0], spec["argv"], os.environ)
    except OSError as error:
        _fail(f"could not start {spec['argv'][0]!r}: {error.strerror}")


def _fail(line: str) -> None:
    os.write(2, (line + "\n").encode())
    os._exit(START_FAILED)


def _report(status_fd: int, status: dict) -> None:
    try:
        os.write(status_fd, (json.dumps(status) + "\n").encode())
    except OSError:
        pass
    os.close(status_fd)


def _main(spec: dict) -> None:
    status_fd = spec["status_fd"]
    status = {"layers": [], "refused": {}}
    if not _enter(spec, status):
        _report(status_fd, status)
        _start_in_place(spec)
    result_read, result_write = os.pipe()  # not inherited by the program (O_CLOEXEC)
    init = os.fork()
    if init == 0:
        os.close(result_read)
        _init(spec, status, status_fd, result_write)
    os.close(status_fd)
    os.close(result_write)
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, lambda *_: None)  # the program gets its group's signals itself
    _wait(init)
    packed = _read_all(result_read)
    wait_status = struct.unpack("i", packed)[0] if len(packed) == 4 else (signal.SIGKILL & 0x7F)
    _exit_like(wait_status)


def _start_in_place(spec: dict) -> None:
    """No namespace could be made: run the program as this process (the caller said so already)."""
    try:
        os.chdir(spec["cwd"])
        os.execvpe(spec["argv"][0], spec["argv"], os.environ)
    except OSError as error:
        _fail(f"could not start {spec['argv'][0]!r}: {error.strerror}")


def _wait(pid: int) -> None:
    while True:
        try:
            os.waitpid(pid, 0)
            return
        except InterruptedError:
            continue
        except ChildProcessError:
            return


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 64):
        chunks.append(chunk)
    return b"".join(chunks)


def _exit_like(wait_status: int) -> None:
    """End this process the way the program ended: its exit code, or death by its signal."""
    if os.WIFSIGNALED(wait_status):
        number = os.WTERMSIG(wait_status)
        signal.signal(number, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the program's crash, not ours, to dump
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal that does not kill (SIGCHLD, ...)
    os._exit(os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else 1)


if __name__ == "__main__":
    try:
        _main(json.loads(sys.argv[1]))
    except OSError as error:
        if error.errno == errno.EPIPE:
            os._exit(1)
        raise
