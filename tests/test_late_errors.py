"""Late errors and misleading words (issue 39, items 10-11), driven as the attacker drove them: real
`agentr1` invocations (a subprocess, or the CLI's main() with real files). Each bad input is one line
naming the problem, exit code 2, no traceback, and it comes before a Prefect server is started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import flows.cli as cli
from agent_core.io.layout import DataRoot
from agent_core.io.locks import lock_is_held
from flows.cli import main as cli_main
from test_early_errors import recorded_run

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = REPO_ROOT / "configs" / "tiny.yaml"

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@pytest.fixture
def no_server(monkeypatch):
    """Fail the test if a command got as far as configuring Prefect (which starts its server)."""
    def started(*args, **kwargs):
        raise AssertionError("the command configured Prefect before rejecting its input")
    monkeypatch.setattr(cli, "configure_environment", started)


def _agentr1(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO_ROOT, timeout=timeout)


def _one_line(err: str, *expected: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("agentr1: using the shipped config")]
    assert len(lines) == 1 and lines[0].startswith("agentr1: error: "), err
    assert "Traceback" not in err, err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _one_line_error(capsys, *expected: str) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out
    return _one_line(captured.err, *expected)


# ---- item 10: late errors ----------------------------------------------------------------------------


def test_a_run_id_that_climbs_out_of_runs_is_refused_even_in_a_dry_run(tmp_path):
    done = _agentr1("train", "--config", "tiny", "--run-id", "../x", "--dry-run", "--data-root", str(tmp_path / "d"))
    assert done.returncode == 2  # was 0, the config printed with run_id: ../x
    _one_line(done.stderr, "--run-id: invalid run id '../x'")
    assert done.stdout == "" and not (tmp_path / "d").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("run_id", ["a/b", "/tmp/abs", "..", ".hidden"])
def test_a_run_id_must_be_one_safe_folder_name(tmp_path, capsys, no_server, run_id):
    assert cli_main(["train", "--config", "tiny", "--run-id", run_id, "--data-root", str(tmp_path / "d")]) == 2
    _one_line_error(capsys, f"--run-id: invalid run id {run_id!r}")
    assert not (tmp_path / "d").exists()


def test_rerun_of_an_iteration_the_run_does_not_have_fails_before_prefect(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    recorded_run(root)
    assert cli_main(["rerun", "--run-id", "r1", "--iteration", "99", "--stage", "rollout", "--data-root", str(root)]) == 2
    _one_line_error(capsys, "--iteration 99: run 'r1' has iterations 0 to 1 (its config: iterations: 2); "
                            "it has none so far")


def test_rerun_of_a_stage_whose_inputs_are_not_written_yet_names_them(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    run_dir = recorded_run(root)
    (run_dir / "iteration=0").mkdir()
    assert cli_main(["rerun", "--run-id", "r1", "--iteration", "1", "--stage", "label_rewards",
                     "--data-root", str(root)]) == 2
    _one_line_error(capsys, "--iteration 1 --stage label_rewards: run 'r1' has not written what label_rewards "
                            f"reads yet ({run_dir / 'iteration=1' / 'steps.parquet'}, ",
                    "it has iteration 0 so far")


@pytest.mark.parametrize("extra, expected", [
    (["--split", "nope"], "--split 'nope': unknown dataset split; valid splits: train, dev, test"),
    (["--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: does not exist; give a checkpoint folder"),
    (["--checkpoint", str(TINY)], f"--checkpoint {TINY}: is not a folder"),
    (["--iteration", "7"], "--iteration 7: run 'r1' has no checkpoint of iteration 7; it has none yet"),
])
def test_eval_with_a_bad_split_checkpoint_or_iteration_fails_before_prefect(tmp_path, capsys, no_server, extra,
                                                                            expected):
    root = tmp_path / "data"
    recorded_run(root)
    before = sorted(root.rglob("*"))
    assert cli_main(["eval", "--run-id", "r1", "--data-root", str(root), *extra]) == 2
    _one_line_error(capsys, expected)
    assert sorted(root.rglob("*")) == before


class _Stop(Exception):
    pass


def test_a_second_train_of_the_same_run_started_meanwhile_is_refused_at_once(tmp_path, monkeypatch):
    """Two `agentr1 train --run-id same` at once: the first holds the run's lock before its Prefect
    server starts, so the second (a real process, started at that moment) is refused in one line, in
    seconds, and starts nothing (it was: both passed the check, both servers migrated Prefect's database,
    a migration traceback after 16 s)."""
    root = tmp_path / "data"
    lock = DataRoot(root).run("same").lock_path
    seen = {}

    def second_writer(data_root):  # where the first one starts Prefect
        started = time.perf_counter()
        seen["done"] = _agentr1("train", "--config", "tiny", "--run-id", "same", "--data-root", str(root), timeout=60)
        seen["seconds"] = time.perf_counter() - started
        raise _Stop

    monkeypatch.setattr(cli, "configure_environment", second_writer)
    with pytest.raises(_Stop):
        cli_main(["train", "--config", "tiny", "--run-id", "same", "--data-root", str(root)])
    done = seen["done"]
    assert done.returncode == 2, done.stderr[-2000:]
    _one_line(done.stderr, "run 'same' is being written by another process (pid ")
    assert seen["seconds"] < 30
    assert not lock_is_held(lock)  # the first one let go of it when it ended
    assert not (root / "prefect").exists()


def test_a_value_nested_thousands_deep_is_one_line(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    done = _agentr1("train", "--config", "tiny", "--dry-run", "--data-root", str(tmp_path / "d"), "--set", f"seed={deep}")
    assert done.returncode == 2  # was a RecursionError traceback
    _one_line(done.stderr, "override 'seed=[[[[", "nested more than 64 levels deep")
    assert len(done.stderr) < 400


def test_a_config_file_nested_thousands_deep_is_one_line_naming_it(tmp_path, capsys, no_server):
    config = tmp_path / "deep.yaml"
    config.write_text("seed: " + "[" * 5000 + "]" * 5000 + "\n")
    assert cli_main(["train", "--config", str(config), "--data-root", str(tmp_path / "d")]) == 2
    _one_line_error(capsys, f"{config}: a value is nested more than 64 levels deep")


@pytest.mark.parametrize("value, expected", [
    ("/dev/null", "data_root (set by --set data_root=/dev/null): /dev/null is not a folder"),
    ("{afile}/x", "data_root (set by --set data_root={afile}/x): {afile}, above it, is not a folder"),
])
def test_a_data_root_set_to_something_that_is_no_folder_is_named(tmp_path, capsys, monkeypatch, no_server, value,
                                                                  expected):
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "--config", "tiny", "--dry-run", "--set", f"data_root={value.format(afile=afile)}"]) == 2
    _one_line_error(capsys, expected.format(afile=afile))
    assert afile.read_text() == "x"


# ---- item 11: misleading words ------------------------------------------------------------------------


def test_a_missing_plugin_set_by_an_override_blames_the_override(tmp_path, capsys, no_server):
    assert cli_main(["train", "--config", "tiny", "--dry-run", "--data-root", str(tmp_path / "d"),
                     "--set", "plugins=[missing]"]) == 2
    _one_line_error(capsys, "plugins (set by --set plugins=[missing]): ", "cannot import plugin 'missing'")


def test_a_missing_plugin_in_a_file_blames_the_file(tmp_path, capsys, no_server):
    config = tmp_path / "mine.yaml"
    config.write_text("plugins: [missing]\n")
    assert cli_main(["train", "--config", str(config), "--dry-run", "--data-root", str(tmp_path / "d")]) == 2
    _one_line_error(capsys, f"plugins (set by {config}): ", "cannot import plugin 'missing'")


@pytest.mark.parametrize("item", ["trainer.lr=.inf", "trainer.lr=-.inf", "trainer.lr=nan", "rollout.temperature=.inf",
                                  "critic.lr=.inf", "reward.process_weight=.inf"])
def test_infinities_are_refused_like_nan(tmp_path, capsys, no_server, item):
    key = item.partition("=")[0]
    assert cli_main(["train", "--config", "tiny", "--dry-run", "--data-root", str(tmp_path / "d"), "--set", item]) == 2
    line = _one_line_error(capsys, f"{key} (set by --set {item}): got ")
    assert "finite" in line or "greater than or equal to 0" in line, line


def test_the_key_that_means_something_by_inf_still_takes_it(tmp_path, capsys):
    assert cli_main(["train", "--config", "tiny", "--dry-run", "--data-root", str(tmp_path / "d"),
                     "--set", "rollout.straggler_wait_s=.inf"]) == 0
    assert "straggler_wait_s: .inf" in capsys.readouterr().out


def test_a_query_of_an_infinite_date_prints_it_instead_of_a_traceback(tmp_path):
    import pyarrow.parquet as pq

    import schemas
    from test_schemas import SAMPLES

    root = tmp_path / "data"
    (root / "runs" / "r1" / "iteration=0").mkdir(parents=True)
    pq.write_table(schemas.table_from_rows("rewards", SAMPLES["rewards"]()),
                   root / "runs" / "r1" / "iteration=0" / "rewards.parquet")
    sql = ("select 'infinity'::date as d, '-infinity'::timestamp as t, '2020-01-02'::date as ok, "
           "['infinity'::date] as l")
    done = _agentr1("query", "--data-root", str(root), sql)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr  # was an OverflowError traceback
    row = done.stdout.splitlines()[2].split()
    assert row[:3] == ["infinity", "-infinity", "2020-01-02"] and "out of range" in done.stdout, done.stdout


# ---- a run whose files cannot be replaced ---------------------------------------------------------------


def test_resume_when_status_json_is_a_folder_names_it_before_prefect(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    run_dir = recorded_run(root)
    (run_dir / "status.json").mkdir()
    assert cli_main(["resume", "--run-id", "r1", "--data-root", str(root)]) == 2
    _one_line_error(capsys, f"run 'r1' cannot be written: {run_dir / 'status.json'} is a folder where the run "
                            "keeps a file")


def test_train_of_a_run_whose_table_is_a_folder_names_it_before_prefect(tmp_path, capsys, no_server):
    root = tmp_path / "data"
    run_dir = recorded_run(root)
    (run_dir / "iteration=0" / "steps.parquet").mkdir(parents=True)
    assert cli_main(["train", "--config", "tiny", "--run-id", "r1", "--data-root", str(root)]) == 2
    _one_line_error(capsys, f"{run_dir / 'iteration=0' / 'steps.parquet'} is a folder where the run keeps a file")


def _chattr(flag: str, path: Path) -> bool:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("flag, kind", [("+i", "immutable"), ("+a", "append-only")])
@pytest.mark.parametrize("command", ["resume", "rerun"])
def test_a_run_with_an_immutable_table_is_named_before_prefect(tmp_path, capsys, no_server, flag, kind, command):
    """Run as root here, so chmod cannot make a file unwritable; chattr can (even root cannot replace it)."""
    import shutil

    if shutil.which("chattr") is None:
        pytest.skip("no chattr on this machine: an immutable file cannot be made")
    root = tmp_path / "data"
    run_dir = recorded_run(root)
    table = run_dir / "iteration=0" / "prompts.parquet"
    table.parent.mkdir()
    table.write_bytes(b"PAR1")
    (run_dir / "initial_policy").mkdir()
    if not _chattr(flag, table):
        pytest.skip(f"this file system refuses chattr {flag}")
    try:
        argv = (["resume", "--run-id", "r1"] if command == "resume"
                else ["rerun", "--run-id", "r1", "--iteration", "0", "--stage", "rollout"])
        assert cli_main([*argv, "--data-root", str(root)]) == 2
        _one_line_error(capsys, f"run 'r1' cannot be written: {table} is {kind} (chattr {flag})",
                        f"chattr -{flag[1]} {table}")
    finally:
        _chattr(f"-{flag[1]}", table)


# ---- a damaged or unreadable table under agentr1 query -------------------------------------------------


def _query_root(tmp_path: Path) -> tuple[Path, Path]:
    import pyarrow.parquet as pq

    import schemas
    from test_schemas import SAMPLES

    root = tmp_path / "data"
    folder = root / "runs" / "r1" / "iteration=0"
    folder.mkdir(parents=True)
    for name in ("steps", "rewards"):
        pq.write_table(schemas.table_from_rows(name, SAMPLES[name]()), folder / f"{name}.parquet")
    return root, folder / "rewards.parquet"


def _flip_a_footer_bit(path: Path) -> None:
    """Flip one bit of the Parquet footer (its thrift metadata), the first that makes it undecodable."""
    import struct

    import pyarrow.parquet as pq

    data = path.read_bytes()
    footer = struct.unpack("<i", data[-8:-4])[0]
    for offset in range(len(data) - 8 - footer, len(data) - 8):
        flipped = bytearray(data)
        flipped[offset] ^= 0x40
        path.write_bytes(bytes(flipped))
        try:
            pq.read_metadata(path)
        except Exception as error:  # noqa: BLE001 - any decoding error will do
            if "TProtocolException" in str(error):
                return
    raise AssertionError("no bit flip of the footer broke its thrift metadata")


def test_a_footer_bit_flip_names_the_damaged_file(tmp_path):
    root, table = _query_root(tmp_path)
    _flip_a_footer_bit(table)
    done = _agentr1("query", "--data-root", str(root), "select count(*) from rewards")
    assert done.returncode == 2
    # was: `agentr1: error: TProtocolException: Invalid data; available views: ...` naming no file
    _one_line(done.stderr, "view rewards: ", f"TProtocolException: Invalid data in {table} (a damaged table file")
    steps = _agentr1("query", "--data-root", str(root), "select count(*) from steps")
    assert steps.returncode == 0, steps.stderr  # the other views still answer


def test_a_table_this_user_may_not_read_is_a_permission_problem_not_damage(tmp_path):
    """Run as root here: chmod 000 stops a process only without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH,
    so the CLI runs under `setpriv --bounding-set` without them (as a user who is not the file's would)."""
    import shutil

    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv: cannot run the CLI without root's permission override")
    root, table = _query_root(tmp_path)
    table.chmod(0)
    done = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m",
                           "flows.cli", "query", "--data-root", str(root), "select count(*) from rewards"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2
    line = _one_line(done.stderr, "view rewards: ", str(table), "Permission denied",
                     "permission denied: this user may not read that table file")
    assert "damaged" not in line  # was: (a damaged or unreadable table file; ...)


# ---- a manifest whose output climbs out of its folder ----------------------------------------------------


def test_a_manifest_output_with_dot_dot_is_refused_not_followed(tmp_path, caplog):
    """A hand-edited manifest (real files, as the attacker edited them) that points its stage's output at
    an identical copy outside the run: the stage is redone, its output never read from outside."""
    import json
    import shutil

    from agent_core.io.manifests import StageRecord

    root = tmp_path / "data"
    recorded_run(root)
    run = DataRoot(root).run("r1")
    table = Path(run.table_uri(0, "steps"))
    table.parent.mkdir(parents=True)
    table.write_bytes(b"PAR1 the stage's own output PAR1")
    manifest_path = run.manifest_path("rollout", 0)
    StageRecord(manifest_path, "rollout", {}, {"seed": 1}).commit({"steps": table})
    outside = tmp_path / "outside" / "steps.parquet"
    outside.parent.mkdir()
    shutil.copy(table, outside)  # same size and content: the attacker's copy passes every check
    recorded = json.loads(manifest_path.read_text())
    assert recorded["outputs"] == {"steps": "steps.parquet"}
    recorded["outputs"]["steps"] = "../../../../outside/steps.parquet"
    manifest_path.write_text(json.dumps(recorded))

    with caplog.at_level("WARNING", logger="agent_core.io.manifests"):
        check = StageRecord(manifest_path, "rollout", {}, {"seed": 1}).check()
    assert check.outputs is None  # was: {"steps": ".../iteration=0/_manifests/../../../../outside/steps.parquet"}
    assert "climbs out of" in caplog.text and str(manifest_path) in caplog.text


def test_a_file_name_with_escape_codes_in_an_error_is_printed_escaped(tmp_path):
    """A data root is written by whoever can write it (agent programs could, item 3): a folder named with
    terminal escape codes, where the run keeps a table, is named in the error with its codes escaped."""
    root = tmp_path / "data"
    run_dir = recorded_run(root)
    (run_dir / "iteration=0" / "\x1b]0;owned\x07\x1b[2J.parquet").mkdir(parents=True)
    done = _agentr1("resume", "--run-id", "r1", "--data-root", str(root))
    assert done.returncode == 2
    line = _one_line(done.stderr, "is a folder where the run keeps a file", "\\x1b]0;owned\\x07\\x1b[2J.parquet")
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr, line  # was printed raw
