"""The agent program's jail: run as `python -I -S program_jail.py SPEC` by `agent_core.envs.agent_program`.

Standard library only. New user, mount, PID and network namespaces: `hide` paths under an empty tmpfs
(`expose` bound back), every mount read-only, a private /dev, a tmpfs `scratch`. The namespace's init
mounts /proc, forwards the loopback's gateway port to the gateway's Unix socket, locks it all in a
nested namespace as uid 65534 and runs the program; when it exits every process left dies with the
init. The status line (layers applied, why any was refused) goes to `status_fd`, closed before the
program starts. Layers: docs/architecture.md §6, attacks: docs/reliability.md.
"""

import ctypes
import errno
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys
import threading

_NEWNS, _NEWUSER, _NEWPID, _NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE = 1 << 14, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> the mount flag a read-only remount must keep (the kernel refuses to clear a
# flag the caller's namespace inherited locked)
_KEPT_FLAGS = ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
               (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME))
LAYERS = ("pid_namespace", "hidden_paths", "read_only_root", "private_dev", "scratch", "private_proc",
          "network", "no_unix_sockets", "unprivileged", "locked_mounts")
# mount_setattr(2): the same number on every architecture (new syscalls are unified)
_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 442, -100, 0x8000, 1, 2
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_NOBODY = 65534  # the program's uid and gid inside its namespace: no capabilities after exec
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
# seccomp: (audit arch, socket(2), io_uring_setup(2)) by machine; classic BPF opcodes (linux/filter.h)
_SYSCALLS = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
_LOAD, _JUMP_IF_EQUAL, _JUMP_IF_AT_LEAST, _RETURN = 0x20, 0x15, 0x35, 0x06
_ALLOW, _EACCES = 0x7FFF0000, 0x00050000 | errno.EACCES
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


def _map_ids(uid: int, gid: int, inside_uid: int | None = None, inside_gid: int | None = None) -> None:
    """Map our own ids (files keep their owners), seen inside as `inside_*` (default: the same)."""
    inside_uid = uid if inside_uid is None else inside_uid
    inside_gid = gid if inside_gid is None else inside_gid
    for name, text in (("setgroups", "deny"), ("uid_map", f"{inside_uid} {uid} 1"),
                       ("gid_map", f"{inside_gid} {gid} 1")):
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


def _read_only_root() -> None:
    """Every mount read-only and nosuid, recursively (the checkout, the venv, the data root, /tmp)."""
    attr = struct.pack("QQQQ", _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
    _check(_LIBC.syscall(_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, attr, len(attr)), "mount_setattr /")


def _private_dev() -> None:
    """A tmpfs /dev holding only the harmless character devices (no disks: a device node is writable
    on a read-only mount) and a writable, size-capped /dev/shm."""
    handles = [(name, os.open(f"/dev/{name}", os.O_PATH)) for name in _DEVICES if os.path.exists(f"/dev/{name}")]
    _mount("tmpfs", "/dev", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name, handle in handles:
        os.close(os.open(f"/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(f"/proc/self/fd/{handle}", f"/dev/{name}", None, _MS_BIND)
        os.close(handle)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm", 0o1777)
    _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64m,mode=1777")


def _scratch(path: str, size_mb: int) -> None:
    """The program's one writable place: a size-capped tmpfs that ends with its namespace."""
    _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size_mb}m,mode=0777")
    os.mkdir(os.path.join(path, "home"), 0o777)


def _layer(status: dict, name: str, apply, *args) -> bool:
    try:
        apply(*args)
    except OSError as error:
        status["refused"][name] = str(error)
        return False
    status["layers"].append(name)
    return True


def _unshare_outer(spec: dict, status: dict) -> None:
    """The user, mount, PID and network namespaces; where only the network one is refused (a container's
    policy), the others still: the program then shares the host's network, and `status` says why."""
    if not spec.get("host_network"):
        try:
            return _unshare(_NEWUSER | _NEWNS | _NEWPID | _NEWNET, "unshare(user, mount, pid, network namespaces)")
        except OSError as error:
            status["refused"]["network"] = str(error)
            spec["host_network"] = True
    _unshare(_NEWUSER | _NEWNS | _NEWPID, "unshare(user, mount, pid namespaces)")


def _enter(spec: dict, status: dict) -> bool:
    """The outer namespaces and the mounts; False (and why, in `status`) if none could be made."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare_outer(spec, status)
        _map_ids(uid, gid)
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the caller's namespace
    except OSError as error:
        status["refused"] = {layer: str(error) for layer in LAYERS}
        return False
    status["layers"].append("pid_namespace")
    def hide_all() -> None:
        for hidden in spec["hide"]:
            _hide(hidden, [p for p in spec["expose"] if p == hidden or p.startswith(hidden.rstrip("/") + "/")])
    _layer(status, "hidden_paths", hide_all)
    _layer(status, "read_only_root", _read_only_root)
    _layer(status, "private_dev", _private_dev)
    if spec.get("scratch"):
        _layer(status, "scratch", _scratch, spec["scratch"], spec.get("scratch_mb", 256))
    return True


def _init(spec: dict, status: dict, status_fd: int, result_fd: int) -> None:
    """pid 1 of the new namespace: private /proc, its network, locked mounts, then the program; its
    wait status goes to `result_fd` and the init exits, taking every other process of the namespace."""
    _LIBC.prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    _layer(status, "private_proc", _private_proc)
    listener = None
    if not spec.get("host_network"):
        try:
            listener = _loopback_with_gateway(spec.get("gateway_port"))
            status["layers"].append("network")
        except OSError as error:
            status["refused"]["network"] = str(error)
    uid, gid = os.geteuid(), os.getegid()
    try:  # mounts copied into a less privileged namespace are locked: the program cannot unmount them
        _unshare(_NEWUSER | _NEWNS, "unshare(nested user, mount namespaces)")
        _map_ids(uid, gid, _NOBODY, _NOBODY)
        os.setresgid(_NOBODY, _NOBODY, _NOBODY)
        os.setresuid(_NOBODY, _NOBODY, _NOBODY)  # no capabilities left, even in its own namespaces
        status["layers"] += ["unprivileged", "locked_mounts"]
    except OSError as error:
        status["refused"]["locked_mounts"] = status["refused"]["unprivileged"] = str(error)
    if spec.get("host_network"):
        pass  # the user let it reach the host's network: its Unix sockets too
    elif _filter_works():
        status["layers"].append("no_unix_sockets")
    else:
        status["refused"]["no_unix_sockets"] = f"seccomp refused, or no filter for {os.uname().machine}"
    _report(status_fd, status)
    for forwarded in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(forwarded, lambda number, _frame: _forward(number))
    program = _start(spec)
    if listener is not None:
        threading.Thread(target=_serve_gateway, args=(listener, spec["gateway_socket"]), daemon=True).start()
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


def _deny_unix_sockets() -> bool:
    """A seccomp filter: socket(AF_UNIX) fails with EACCES (the host's pathname sockets, Ray's or another
    run's gateway, stay out of reach on the read-only file system), and io_uring, which could make one
    past the filter, is refused; socketpair(2) is left alone. False where it cannot be installed."""
    numbers = _SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return False
    arch, socket_call, io_uring_setup = numbers
    # seccomp_data: nr at offset 0, arch at 4, args[0] at 16; each (code, jump if true, jump if false, k)
    program = [(_LOAD, 0, 0, 4), (_JUMP_IF_EQUAL, 0, 7, arch), (_LOAD, 0, 0, 0),
               (_JUMP_IF_AT_LEAST, 4, 0, 0x40000000),  # x86's x32 numbers: refused whole
               (_JUMP_IF_EQUAL, 3, 0, io_uring_setup), (_JUMP_IF_EQUAL, 0, 3, socket_call),
               (_LOAD, 0, 0, 16), (_JUMP_IF_EQUAL, 0, 1, socket.AF_UNIX),
               (_RETURN, 0, 0, _EACCES), (_RETURN, 0, 0, _ALLOW)]
    filters = (ctypes.c_uint64 * len(program))(*(c | jt << 16 | jf << 24 | k << 32 for c, jt, jf, k in program))
    fprog = (ctypes.c_uint64 * 2)(len(program), ctypes.addressof(filters))  # struct sock_fprog, padded
    if _LIBC.prctl(ctypes.c_int(38), ctypes.c_ulong(1), 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return _LIBC.prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.byref(fprog), 0, 0) == 0  # SECCOMP_MODE_FILTER


def _filter_works() -> bool:
    """Whether the program's filter installs here: tried in a child that exits at once (the init
    itself keeps making Unix sockets for its gateway forwarder)."""
    child = os.fork()
    if child == 0:
        os._exit(0 if _deny_unix_sockets() else 1)
    _, wait_status = os.waitpid(child, 0)
    return os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) == 0


def _private_proc() -> None:
    """This namespace's own /proc (siblings' environments, so their tokens, are out of sight), with the
    kernel's knobs read-only: a uid mapped to the host's root may write /proc/sys otherwise."""
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for knob in (path for path in ("/proc/sys", "/proc/sysrq-trigger") if os.path.exists(path)):
        _mount(knob, knob, None, _MS_BIND)
        _remount_read_only(knob)


def _loopback_with_gateway(port: int | None) -> socket.socket | None:
    """Bring up this network namespace's loopback (its only interface) and listen on the gateway's
    port there; None when there is no gateway to forward to."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(control, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(control, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))
    if not port:
        return None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)  # before the program starts: its first connection waits in the backlog
    return listener


def _serve_gateway(listener: socket.socket, gateway_socket: str) -> None:
    """Each connection to the namespace's gateway port, piped to the gateway's Unix socket."""
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(gateway_socket)
        except OSError:
            client.close()
            upstream.close()
            continue
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    for end, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
        try:
            end.shutdown(how)
        except OSError:
            pass


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
    if not spec.get("host_network"):
        _deny_unix_sockets()
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
