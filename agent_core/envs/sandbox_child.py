"""The sandbox's child side: run as `python -I -S sandbox_child.py SPEC` by `agent_core.envs.sandbox`.

Standard library only (the child interpreter has no site-packages and cannot import the project):
it applies the isolation layers to itself, reports them on the status socket, closes it, then runs
the model's program from `main.py` in its working directory. See `agent_core/envs/sandbox.py` for
what each layer guarantees and why the status channel is gone before the program starts.
"""

import ctypes
import json
import math
import os
import platform
import signal
import sys

MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_OPEN_FILES = 64
MAX_TASKS_IN_NAMESPACE = 32
MAX_FILES = 4096  # inodes of the scratch tmpfs, directories included
MEMORY_EXIT_CODE = 121  # exit status after an uncaught MemoryError (sandbox.py reads it)
_NEWNS, _NEWUSER, _NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_LANDLOCK_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}  # create, add_rule, restrict
_READ_ONLY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/share/zoneinfo")
_READ_ONLY_FILES = ("/etc/ld.so.cache", "/dev/zero", "/dev/random", "/dev/urandom")
_WRITABLE_FILES = ("/dev/null",)


def _syscall(number: int, *args) -> int:
    return _LIBC.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))


def _prctl(option: int, *arguments) -> int:
    padded = (*arguments, 0, 0, 0, 0)[:4]
    return _LIBC.prctl(ctypes.c_int(option), *(ctypes.c_ulong(a) if isinstance(a, int) else a for a in padded))


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    wanted, workdir, status_fd = set(spec["layers"]), os.getcwd(), spec["status_fd"]
    read_dirs, read_files = _interpreter_read_paths()
    was_root = os.geteuid() == 0
    source = _read_program()  # before a tmpfs mounted on the working directory hides main.py
    applied = _enter_namespaces(wanted, workdir, spec["disk_mb"])
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG; after unshare, which clears it
    if os.getppid() != spec["parent_pid"]:
        os._exit(137)  # the caller died before we could notice it
    if "no_capabilities" in wanted and _drop_capabilities():
        applied.append("no_capabilities")
    _prctl(38, 1)  # PR_SET_NO_NEW_PRIVS: required for Landlock and seccomp
    applied += _apply_landlock(wanted, workdir, read_dirs, read_files)
    if "rlimits" in wanted:
        limit_tasks = "netns" in applied and not was_root
        _apply_rlimits(spec["timeout_s"], spec["memory_mb"], spec["disk_mb"], limit_tasks)
        applied.append("rlimits")
    if "seccomp" in wanted and _apply_seccomp():
        applied.append("seccomp")
    program = _compile_program(source)
    if "audit_hook" in wanted:
        _install_audit_hook(workdir, read_dirs, read_files)
        applied.append("audit_hook")
    _report_layers(status_fd, applied)
    if program is None:
        sys.exit(1)  # a syntax error, already printed
    _run_program(program)


def _report_layers(status_fd: int, applied: list[str]) -> None:
    """Send the one status line, wait for the caller's go, close the socket. The caller closes its
    end before the go, so once the program runs no descriptor, here or in /proc, reaches the channel:
    the program cannot add to or change what the caller learns from it."""
    os.write(status_fd, ("layers " + ",".join(applied) + "\n").encode())
    go = os.read(status_fd, 1)
    os.close(status_fd)
    if go != b"1":
        os._exit(137)  # the caller gave up (its timeout) or died


def _read_program() -> str:
    with open("main.py", encoding="utf-8") as file:
        return file.read()


def _enter_namespaces(wanted: set[str], workdir: str, disk_mb: int) -> list[str]:
    """netns: a new user + network namespace. tmpfs: also a mount namespace whose working directory is
    a private tmpfs of disk_mb (the kernel refuses writes past it: ENOSPC) and MAX_FILES inodes."""
    if not wanted & {"netns", "tmpfs"}:
        return []
    uid, gid = os.geteuid(), os.getegid()
    flags = _NEWUSER | ("netns" in wanted) * _NEWNET | ("tmpfs" in wanted) * _NEWNS
    if _LIBC.unshare(ctypes.c_int(flags)) != 0:
        return []
    applied = ["netns"] if "netns" in wanted else []
    if "tmpfs" in wanted:
        if _mount_scratch(workdir, disk_mb, uid, gid):
            applied.append("tmpfs")
        # The uid map the tmpfs needed would let capabilities in this namespace act on the caller's
        # files (root's, for a root caller). A nested, unmapped user namespace takes that back: as
        # without the tmpfs, the program is "nobody" with capabilities over nothing outside.
        if _LIBC.unshare(ctypes.c_int(_NEWUSER)) != 0 and not _drop_capabilities():
            os._exit(137)
    return applied


def _mount_scratch(workdir: str, disk_mb: int, uid: int, gid: int) -> bool:
    try:  # a tmpfs creates files only for a uid mapped in the namespace that mounted it
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    except OSError:
        return False
    if _LIBC.mount(b"none", b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None) != 0:
        return False  # nothing mounted here may reach the caller's namespace
    options = f"size={disk_mb * 1024 * 1024},nr_inodes={MAX_FILES},mode=0700".encode()
    if _LIBC.mount(b"tmpfs", workdir.encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC),
                   options) != 0:
        return False
    os.chdir(workdir)  # the old working directory is the one beneath the mount
    return True


def _interpreter_read_paths() -> tuple[list[str], list[str]]:
    dirs, files = [], list(_READ_ONLY_FILES)
    for path in [*sys.path, *_READ_ONLY_DIRS]:
        real = os.path.realpath(path)
        (dirs if os.path.isdir(real) else files if os.path.isfile(real) else []).append(real)
    return sorted(set(dirs)), [f for f in dict.fromkeys(files) if os.path.exists(f)]


def _drop_capabilities() -> bool:
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words, all empty
    return _LIBC.capset(header, data) == 0


# Landlock access rights (linux/landlock.h); ABI 1 has the first 13 filesystem ones.
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_FS_ABI1, _LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = (1 << 13) - 1, 1 << 13, 1 << 14, 1 << 15
_LL_TCP_BIND_CONNECT = 0b11
_LL_SCOPE_UNIX_AND_SIGNALS = 0b11  # abstract UNIX sockets, signals


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _apply_landlock(wanted: set[str], workdir: str, read_dirs: list[str], read_files: list[str]) -> list[str]:
    numbers = _LANDLOCK_SYSCALLS.get(platform.machine())
    abi = _syscall(numbers[0], None, 0, 1) if numbers else -1  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return []
    fs_all = _LL_FS_ABI1 | (abi >= 2) * _LL_REFER | (abi >= 3) * _LL_TRUNCATE | (abi >= 5) * _LL_IOCTL_DEV
    layers = {"landlock_fs": (fs_all, 0, 0), "landlock_net": (0, _LL_TCP_BIND_CONNECT, 0),
              "landlock_scope": (0, 0, _LL_SCOPE_UNIX_AND_SIGNALS)}
    minimum_abi = {"landlock_fs": 1, "landlock_net": 4, "landlock_scope": 6}
    chosen = [name for name in layers if name in wanted and abi >= minimum_abi[name]]
    attr = _RulesetAttr(*(sum(layers[name][i] for name in chosen) for i in range(3)))
    if not chosen:
        return []
    ruleset = _syscall(numbers[0], ctypes.byref(attr), ctypes.sizeof(attr), 0)
    if ruleset < 0:
        return []
    try:
        if attr.handled_access_fs:
            read_dir, write_file = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR, _LL_READ_FILE | _LL_WRITE_FILE
            rules = [(workdir, fs_all), *((d, read_dir) for d in read_dirs), *((f, _LL_READ_FILE) for f in read_files),
                     *((f, write_file | (abi >= 3) * _LL_TRUNCATE) for f in _WRITABLE_FILES)]
            for path, access in rules:
                _add_landlock_rule(numbers[1], ruleset, path, access)
        if _syscall(numbers[2], ruleset, 0) != 0:
            return []
    finally:
        os.close(ruleset)
    return chosen


def _add_landlock_rule(add_rule_syscall: int, ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this machine lacks grants nothing
    try:
        rule = _PathBeneathAttr(access, fd)
        _syscall(add_rule_syscall, ruleset, 1, ctypes.byref(rule), 0)  # LANDLOCK_RULE_PATH_BENEATH
    finally:
        os.close(fd)


def _apply_rlimits(timeout_s: float, memory_mb: int, disk_mb: int, limit_tasks: bool) -> None:
    import resource

    cpu_s = math.ceil(timeout_s) + 1
    file_bytes = min(MAX_FILE_BYTES, disk_mb * 1024 * 1024)
    limits = {resource.RLIMIT_CPU: (cpu_s, cpu_s + 1), resource.RLIMIT_FSIZE: (file_bytes,) * 2,
              resource.RLIMIT_NOFILE: (MAX_OPEN_FILES,) * 2, resource.RLIMIT_CORE: (0, 0),
              resource.RLIMIT_AS: (memory_mb * 1024 * 1024,) * 2}
    if limit_tasks:
        limits[resource.RLIMIT_NPROC] = (MAX_TASKS_IN_NAMESPACE,) * 2
    for kind, (soft, hard) in limits.items():
        current_hard = resource.getrlimit(kind)[1]
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(kind, (soft, hard))


# x86_64 syscalls that return EPERM: process creation and exec, sockets, reaching into other
# processes, namespaces, mounts, and kernel objects a sandboxed program never needs.
_SECCOMP_DENIED_X86_64 = {
    "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "socket": 41, "ptrace": 101,
    "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438, "pidfd_send_signal": 424,
    "tkill": 200, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "unshare": 272, "setns": 308,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "open_by_handle_at": 304, "bpf": 321, "userfaultfd": 323, "perf_event_open": 298,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250, "add_key": 248,
    "request_key": 249, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "sethostname": 170,
    "setdomainname": 171, "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
    "iopl": 172, "ioperm": 173, "quotactl": 179, "syslog": 103, "uselib": 134, "vhangup": 153,
}
_CLONE, _CLONE3, _KILL, _TGKILL = 56, 435, 62, 234
_CLONE_THREAD = 0x10000
# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LOAD, _AND, _JUMP_IF_EQUAL, _JUMP_IF_AT_LEAST, _RETURN = 0x20, 0x54, 0x15, 0x35, 0x06
_ALLOW, _KILL_PROCESS, _EPERM, _ENOSYS = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
_CLONE_NAMESPACES = 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


def _apply_seccomp() -> bool:
    if platform.machine() != "x86_64":
        return False
    pid = os.getpid()
    # seccomp_data: nr at offset 0, arch at 4, args[0] at 16. Each (code, jump if true, jump if false, k).
    program = [(_LOAD, 0, 0, 4), (_JUMP_IF_EQUAL, 1, 0, 0xC000003E), (_RETURN, 0, 0, _KILL_PROCESS),  # x86_64 only
               (_LOAD, 0, 0, 0), (_JUMP_IF_AT_LEAST, 0, 1, 0x40000000), (_RETURN, 0, 0, _EPERM)]  # no x32 ABI
    for number in _SECCOMP_DENIED_X86_64.values():
        program += [(_JUMP_IF_EQUAL, 0, 1, number), (_RETURN, 0, 0, _EPERM)]
    program += [(_JUMP_IF_EQUAL, 0, 1, _CLONE3), (_RETURN, 0, 0, _ENOSYS)]
    program += _allow_if_first_argument(_CLONE, (_CLONE_THREAD,), mask=_CLONE_THREAD | _CLONE_NAMESPACES)
    program += _allow_if_first_argument(_KILL, (pid, 0), mask=None)
    program += _allow_if_first_argument(_TGKILL, (pid,), mask=None)
    program.append((_RETURN, 0, 0, _ALLOW))
    filters = (ctypes.c_uint64 * len(program))(*(c | jt << 16 | jf << 24 | k << 32 for c, jt, jf, k in program))
    fprog = (ctypes.c_uint64 * 2)(len(program), ctypes.addressof(filters))  # struct sock_fprog, padded
    return _prctl(22, 2, ctypes.byref(fprog)) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _allow_if_first_argument(number: int, values: tuple[int, ...], mask: int | None) -> list[tuple]:
    """BPF: for syscall `number`, allow iff (arg0 & mask) is one of `values`, else EPERM."""
    body = [(_LOAD, 0, 0, 16)] + ([(_AND, 0, 0, mask)] if mask is not None else [])  # arg0, low 32 bits
    body += [(_JUMP_IF_EQUAL, len(values) - i, 0, value) for i, value in enumerate(values)]
    body += [(_RETURN, 0, 0, _EPERM), (_RETURN, 0, 0, _ALLOW)]
    return [(_JUMP_IF_EQUAL, 0, len(body), number), *body]


def _compile_program(source: str):
    """The code object, or None after printing the syntax error."""
    try:
        return compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as exc:
        import traceback

        traceback.print_exception(type(exc), exc, None)
        return None


_DENIED_EVENT_PREFIXES = (
    "socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.system",
    "os.startfile", "pty.", "syslog.",
)
_WRITE_EVENTS = {  # audit event -> positions of the paths it changes
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
}
_READ_EVENTS = {"os.listdir": (0,), "os.scandir": (0,), "os.getxattr": (0,), "os.listxattr": (0,)}
_WRITE_OPEN_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _install_audit_hook(workdir: str, read_dirs: list[str], read_files: list[str]) -> None:
    # Everything the hook calls is bound now, so a program rebinding os.* cannot redirect it.
    realpath, fsdecode, getpid = os.path.realpath, os.fsdecode, os.getpid
    read_roots, read_exact = (workdir, *read_dirs), frozenset((*read_files, *_WRITABLE_FILES))
    write_exact = frozenset(_WRITABLE_FILES)

    def allowed(path, roots: tuple[str, ...], exact: frozenset) -> bool:
        if isinstance(path, int):
            return True  # a descriptor this hook (or Landlock) already let the program open
        real = realpath(fsdecode(path if path is not None else "."))
        return real in exact or any(real == root or real.startswith(root + "/") for root in roots)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_DENIED_EVENT_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed (no subprocesses, sockets or ctypes)")
        if event in ("os.kill", "os.killpg") and args[0] not in (0, getpid()):
            raise PermissionError(f"sandbox: {event} of another process is not allowed")
        if event == "open":
            path, mode, flags = (*args, None, None)[:3]  # io.open_code's event has no flags
            writing = bool(flags and flags & _WRITE_OPEN_FLAGS) or any(c in str(mode or "") for c in "wax+")
            paths = (path,)
            roots, exact = ((workdir,), write_exact) if writing else (read_roots, read_exact)
        elif event in _WRITE_EVENTS:
            paths, (roots, exact) = [args[i] for i in _WRITE_EVENTS[event]], ((workdir,), write_exact)
        elif event in _READ_EVENTS:
            paths, (roots, exact) = [args[i] for i in _READ_EVENTS[event]], (read_roots, read_exact)
        else:
            return
        for path in paths:
            if not allowed(path, roots, exact):
                raise PermissionError(f"sandbox: {event} {path!r} is outside the working directory")

    sys.addaudithook(hook)


def _run_program(program) -> None:
    import builtins
    import traceback  # now: after a MemoryError there may be no memory left to import it
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__file__="main.py", __builtins__=builtins)
    sys.modules["__main__"] = main  # the program is __main__ (pickle, dataclasses), not this bootstrap
    try:
        exec(program, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - report whatever the program raised, like python does
        out_of_memory = isinstance(exc, MemoryError)
        if out_of_memory:
            main.__dict__.clear()  # free what the program holds so the traceback can be printed
        try:
            report = traceback.TracebackException(type(exc), exc, exc.__traceback__.tb_next)  # skip this frame
            _hide_bootstrap_frames(report, traceback.StackSummary, set())
            sys.stderr.writelines(report.format())
        except MemoryError:
            os.write(2, b"MemoryError\n")
        sys.exit(MEMORY_EXIT_CODE if out_of_memory else 1)


def _hide_bootstrap_frames(report, stack_summary, seen: set) -> None:
    """Drop this file's frames (the audit hook raising) from a traceback and its chained ones."""
    if report is None or id(report) in seen:
        return
    seen.add(id(report))
    report.stack = stack_summary.from_list([frame for frame in report.stack if frame.filename != __file__])
    _hide_bootstrap_frames(report.__cause__, stack_summary, seen)
    _hide_bootstrap_frames(report.__context__, stack_summary, seen)


if __name__ == "__main__":
    _child_main(sys.argv[1])
