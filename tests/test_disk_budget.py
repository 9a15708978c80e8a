"""The disk budget and disk-full handling (issue 56, items 4-5), fast parts: the estimates, the check (one
line with the numbers, nothing written), the run's margin (a context manager, also on the background
writer thread, set by RunResources), the `=enospc` failpoint, full-disk errors found under wrappers, and the
command's one line. The real runs are tests/test_disk_full.py (slow)."""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import flows.cli as cli
from agent_core.config import PipelineConfig
from agent_core.failpoints import FAILPOINT_ENV, failpoint
from agent_core.io import background, disk_budget, run_status
from agent_core.io.atomic import atomic_file
from agent_core.io.checkpoints import save_policy
from agent_core.io.disk_budget import (
    MIB,
    Budget,
    DiskBudgetError,
    disk_full_cause,
    ensure_room,
    margin_for_run,
    module_bytes,
    optimizer_bytes,
)
from agent_core.io.ledger import LedgerRow
from agent_core.io.optimizer_state import save_optimizer_state
from agent_core.io.tables import rows_of, write_table, write_tables
from agent_core.run_resources import RunResources
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.io.config_files import save_config
from agent_core.io.layout import DataRoot
from flows.cli import main as cli_main

Usage = namedtuple("Usage", "total used free")
TEXTS = ["who directed the film", "the answer is", "search for the city of the director"]


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_tokenizer(TEXTS, vocab_size=300)
    return build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tokenizer


def _free(monkeypatch, free_bytes: int) -> None:
    """The filesystem the budget asks about has `free_bytes` free."""
    usage = Usage(10 * free_bytes, 9 * free_bytes, free_bytes)
    monkeypatch.setattr(disk_budget.shutil, "disk_usage", lambda path: usage)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _stepped_adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    return optimizer


# ---- the estimates ---------------------------------------------------------------------------------


def test_the_estimates_cover_what_is_then_written(policy, tmp_path):
    model, tokenizer = policy
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert params <= module_bytes(model) - disk_budget.CHECKPOINT_SLACK_BYTES <= params * 1.01  # + a few buffers
    written = sum(f.stat().st_size for f in save_policy(model, tokenizer, tmp_path / "ckpt").iterdir())
    assert written <= module_bytes(model)

    optimizer = _stepped_adam(model)
    moments = 2 * params  # Adam: exp_avg and exp_avg_sq per parameter
    assert moments <= optimizer_bytes(optimizer) - disk_budget.OPTIMIZER_SLACK_BYTES <= moments * 1.01
    assert save_optimizer_state(optimizer, tmp_path / "optimizer.pt").stat().st_size <= optimizer_bytes(optimizer)


def test_a_fresh_optimizer_has_only_its_slack_to_write():
    optimizer = torch.optim.Adam(torch.nn.Linear(4, 4).parameters())
    assert optimizer_bytes(optimizer) == disk_budget.OPTIMIZER_SLACK_BYTES


# ---- the check -------------------------------------------------------------------------------------


def test_too_little_room_is_one_line_with_the_numbers_and_what_to_do(tmp_path, monkeypatch):
    _free(monkeypatch, 540 * MIB)
    target = tmp_path / "runs" / "x" / "iteration=3" / "checkpoint"  # not there yet: its nearest folder is asked
    with margin_for_run(256 * MIB, run_id="x"), pytest.raises(DiskBudgetError) as caught:
        ensure_room(target, 812 * MIB, "checkpoint")
    message = str(caught.value)
    assert message == (f"not enough disk for iteration 3's checkpoint at {target}: needs 812 MiB (+256 MiB margin), "
                       "540 MiB free; free space with `agentr1 prune --run-id x` or lower checkpoints.keep_last, "
                       "or set checkpoints.disk_margin_mb")
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC  # disk-full handlers catch it
    assert caught.value.filename == str(target) and "\n" not in message
    assert not (tmp_path / "runs").exists()


def test_exactly_enough_room_passes_and_outside_a_run_the_advice_names_no_run(tmp_path, monkeypatch):
    _free(monkeypatch, 300 * MIB)
    with margin_for_run(100 * MIB):
        ensure_room(tmp_path / "t.parquet", 200 * MIB, "steps table")
        with pytest.raises(DiskBudgetError, match=r"needs 200 MiB \(\+100 MiB margin\), 300 MiB free; "
                                                  r"free space on that disk, or set"):
            ensure_room(tmp_path / "t.parquet", 200 * MIB + 1, "steps table")


def test_small_sizes_keep_a_decimal():
    assert disk_budget._mib(int(1.5 * MIB)) == "1.5 MiB" and disk_budget._mib(0) == "0 MiB"
    assert disk_budget._mib(13_000) == "13 KiB" and disk_budget._mib(1) == "1 KiB"


# ---- the margin: a context manager, the default outside a run --------------------------------------


def test_the_margin_holds_inside_its_block_only_and_nests():
    default = disk_budget.current()
    assert default == Budget(disk_budget.DEFAULT_MARGIN_BYTES) == Budget(256 * MIB, None)
    with margin_for_run(7 * MIB, "r1") as budget:
        assert disk_budget.current() == budget == Budget(7 * MIB, "r1")
        with pytest.raises(RuntimeError), margin_for_run(0, "r2"):
            assert disk_budget.current() == Budget(0, "r2")
            raise RuntimeError("the block failed")
        assert disk_budget.current() == Budget(7 * MIB, "r1")
    assert disk_budget.current() == default
    with pytest.raises(ValueError, match="must be >= 0"), margin_for_run(-1):
        pass


def test_the_background_writer_writes_under_the_margin_of_who_queued_the_job():
    seen = []
    try:
        with margin_for_run(3 * MIB, "r1"):
            background.submit("budget probe", lambda: seen.append(disk_budget.current()))
        background.submit("default probe", lambda: seen.append(disk_budget.current()))
        background.wait()
    finally:
        background.close()
    assert seen == [Budget(3 * MIB, "r1"), Budget(disk_budget.DEFAULT_MARGIN_BYTES)]


def test_the_run_s_resources_set_its_margin_and_put_the_default_back():
    config = PipelineConfig(run_id="r1", checkpoints={"disk_margin_mb": 7})
    with RunResources(config):
        assert disk_budget.current() == Budget(7 * MIB, "r1")
    assert disk_budget.current() == Budget(disk_budget.DEFAULT_MARGIN_BYTES)


# ---- the switch: with no room left every write path refuses, writing nothing ------------------------


def test_every_checked_write_refuses_when_the_margin_eats_the_disk_and_writes_nothing(policy, tmp_path):
    """Fails if the margin does nothing: a margin of all the free space must stop each write path."""
    model, tokenizer = policy
    optimizer = _stepped_adam(model)
    ledger = rows_of([LedgerRow("train", "grpo", "cpu", 2, 1.5, 3.0, None, "USD")], run_id="r1", iteration=0)
    writes = {
        "checkpoint": lambda: save_policy(model, tokenizer, tmp_path / "iteration=0" / "checkpoint"),
        "optimizer state": lambda: save_optimizer_state(optimizer, tmp_path / "iteration=0" / "optimizer.pt"),
        "table": lambda: write_table("ledger", ledger, tmp_path / "iteration=0" / "ledger.parquet"),
        "tables": lambda: write_tables(("ledger", ledger, tmp_path / "iteration=0" / "ledger.parquet")),
    }
    (tmp_path / "iteration=0").mkdir()
    with margin_for_run(shutil.disk_usage(tmp_path).free + 1, "r1"):
        for what, write in writes.items():
            with pytest.raises(DiskBudgetError, match="not enough disk for iteration 0's"):
                write()
            assert _files(tmp_path) == ["iteration=0"], what
    with margin_for_run(0, "r1"):  # and with room, the same writes go through
        for write in writes.values():
            write()
    assert _files(tmp_path / "iteration=0") == sorted(
        ["checkpoint", *[f"checkpoint/{f.name}" for f in (tmp_path / "iteration=0" / "checkpoint").iterdir()],
         "optimizer.pt", "ledger.parquet"])


# ---- the =enospc failpoint and atomic writes on a full disk -----------------------------------------


def test_the_enospc_failpoint_raises_at_its_visit_naming_the_file(monkeypatch, tmp_path):
    monkeypatch.setattr("agent_core.failpoints._counts", {})
    monkeypatch.setenv(FAILPOINT_ENV, "probe:point@2=enospc")
    failpoint("probe:point", tmp_path / "a")
    with pytest.raises(OSError) as caught:
        failpoint("probe:point", tmp_path / "b")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "b")
    failpoint("probe:point")  # the third visit passes
    monkeypatch.setenv(FAILPOINT_ENV, "probe:other=nospace")
    with pytest.raises(ValueError, match="unknown action 'nospace'; valid: kill, hang, enospc"):
        failpoint("probe:other")


def test_without_an_action_the_failpoint_still_kills_at_its_visit():
    program = ("from agent_core.failpoints import failpoint\n"
               "failpoint('probe:point'); print('first', flush=True)\n"
               "failpoint('probe:point'); print('second', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          env={**os.environ, FAILPOINT_ENV: "probe:point@2"}, cwd=Path(__file__).parent.parent)
    assert done.returncode == -signal.SIGKILL and done.stdout == "first\n", done.stderr


@pytest.mark.parametrize("moment", ["during the write", "temp_written"])
def test_a_full_disk_mid_write_leaves_the_old_file_and_no_temporary(monkeypatch, tmp_path, moment):
    monkeypatch.setattr("agent_core.failpoints._counts", {})
    target = tmp_path / "steps.parquet"
    target.write_bytes(b"old")
    monkeypatch.setenv(FAILPOINT_ENV, "write_table:steps.parquet:temp_written=enospc")
    with pytest.raises(OSError) as caught, atomic_file(target, failpoint_prefix="write_table:steps.parquet") as sink:
        sink.write(b"new, half")
        if moment == "during the write":  # a bare write() on a full disk names no file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)  # named either way
    assert target.read_bytes() == b"old" and _files(tmp_path) == ["steps.parquet"]


def test_a_full_disk_while_a_checkpoint_is_staged_leaves_the_old_one_and_no_staging(policy, monkeypatch, tmp_path):
    model, tokenizer = policy
    old = save_policy(model, tokenizer, tmp_path / "checkpoint")
    before = {f.name: f.read_bytes() for f in old.iterdir()}
    monkeypatch.setattr("agent_core.failpoints._counts", {})
    monkeypatch.setenv(FAILPOINT_ENV, "save_policy:staged=enospc")
    with pytest.raises(OSError, match="No space left on device") as caught:
        save_policy(model, tokenizer, tmp_path / "checkpoint")
    assert caught.value.filename == str(tmp_path / "checkpoint")
    assert {f.name: f.read_bytes() for f in old.iterdir()} == before
    assert _files(tmp_path) == ["checkpoint", *[f"checkpoint/{name}" for name in sorted(before)]]


def test_a_full_disk_in_a_library_s_words_is_raised_as_enospc_naming_the_checkpoint(policy, monkeypatch, tmp_path):
    model, tokenizer = policy

    def full(*args, **kwargs):  # how safetensors (Rust) reports it: no OSError, no file
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                           'message: "No space left on device" })')
    monkeypatch.setattr(model, "save_pretrained", full)
    with pytest.raises(OSError) as caught:
        save_policy(model, tokenizer, tmp_path / "checkpoint")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "checkpoint")
    assert _files(tmp_path) == []


# ---- a full disk under wrappers, and the command's one line -----------------------------------------


def _wrapped(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as error:
            raise outer from error
    except BaseException as raised:
        return raised


def test_a_full_disk_is_found_under_wrappers_and_nothing_else_is():
    enospc = OSError(errno.ENOSPC, "No space left on device", "/d/runs/r1/iteration=0/optimizer.pt")
    background_error = _wrapped(enospc, RuntimeError("background write failed: ... No space left on device"))
    assert disk_full_cause(background_error) is enospc  # the OSError, not the wrapper's words
    sqlite = _wrapped(Exception("(sqlite3.OperationalError) database or disk is full"), RuntimeError("MLflow"))
    assert "database or disk is full" in str(disk_full_cause(sqlite))
    assert disk_full_cause(DiskBudgetError("not enough disk", "/d")) is not None
    others = (ValueError("bad"), OSError(errno.EACCES, "Permission denied", "/d"), _wrapped(KeyError(1), ValueError()))
    for other in others:
        assert disk_full_cause(other) is None


def _failing_train(error: BaseException):
    def train(config):
        run = DataRoot(Path(config.data_root)).run(config.run_id)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run.config_path)  # the run recorded its config, then the disk filled
        raise error
    return train


@pytest.fixture
def no_prefect(monkeypatch):
    monkeypatch.setattr(cli, "configure_environment", lambda data_root: None)
    monkeypatch.setattr(cli, "start_temporary_server", lambda: None)


@pytest.mark.parametrize("error, expected", [
    (_wrapped(OSError(errno.ENOSPC, "No space left on device", "/d/optimizer.pt"), RuntimeError("background")),
     "run r1 stopped: no space left on device writing /d/optimizer.pt; free space (`agentr1 prune --run-id r1` "
     "frees old checkpoints), then continue with `agentr1 resume --run-id r1 --data-root "),
    (DiskBudgetError("not enough disk for iteration 0's checkpoint at /d: needs 1 MiB (+0 MiB margin), 0 MiB free; "
                     "free space with `agentr1 prune --run-id r1` or lower checkpoints.keep_last", "/d"),
     "run r1 stopped: not enough disk for iteration 0's checkpoint at /d: needs 1 MiB (+0 MiB margin), 0 MiB free; "
     "free space with `agentr1 prune --run-id r1` or lower checkpoints.keep_last; then continue with "
     "`agentr1 resume --run-id r1 --data-root "),
    (OSError(errno.ENOSPC, "No space left on device"),  # an injected one at MLflow's failpoints names no file
     "run r1 stopped: no space left on device under "),
])
def test_a_run_stopped_by_a_full_disk_is_one_line_exit_1_with_the_resume(tmp_path, capsys, monkeypatch, no_prefect,
                                                                          error, expected):
    monkeypatch.setattr("flows.train.train", _failing_train(error))
    root = tmp_path / "data"
    assert cli_main(["train", "--config", "tiny", "--run-id", "r1", "--data-root", str(root)]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err + captured.out, captured.err
    assert lines[0].startswith(f"agentr1: error: {expected}") and lines[0].endswith(f"{root.resolve()}`"), lines[0]


def test_a_status_json_the_full_disk_refuses_does_not_hide_the_error_being_handled(tmp_path, monkeypatch):
    run = DataRoot(tmp_path).run("r1")
    run.run_dir.mkdir(parents=True)

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(run_status, "write_text_atomic", full)
    assert run_status.record_run_failure(run, "OSError: [Errno 28] No space left on device", 1) == "killed"
    monkeypatch.setattr(run_status, "write_text_atomic", lambda path, text: (_ for _ in ()).throw(PermissionError()))
    with pytest.raises(PermissionError):  # any other failure to record is still raised
        run_status.record_run_failure(run, "x", 1)


def test_any_other_error_of_a_run_is_not_called_a_full_disk(tmp_path, monkeypatch, no_prefect):
    monkeypatch.setattr("flows.train.train", _failing_train(RuntimeError("something else")))
    with pytest.raises(RuntimeError, match="something else"):
        cli_main(["train", "--config", "tiny", "--run-id", "r1", "--data-root", str(tmp_path / "data")])


def test_a_full_disk_in_another_command_is_one_line_too(tmp_path, capsys, monkeypatch):
    def query(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/d/out.parquet")
    monkeypatch.setitem(cli.COMMANDS, "query", query)
    assert cli_main(["query", "select 1", "--data-root", str(tmp_path)]) == 1
    assert capsys.readouterr().err == ("agentr1: error: no space left on device writing /d/out.parquet; free space, "
                                       "then run the command again\n")


def test_log_lines_of_a_full_disk_keep_their_line_and_lose_their_traceback():
    stream = io.StringIO()
    logger = logging.getLogger("test_disk_budget.quiet")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with disk_budget.disk_full_tracebacks_dropped(logger):
            for error in (OSError(errno.ENOSPC, "No space left on device"), ValueError("other")):
                try:
                    raise error
                except Exception as raised:
                    logger.error("Task run failed with exception: %r", raised, exc_info=True)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            logger.error("after the block", exc_info=True)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "Task run failed with exception: OSError(28, 'No space left on device')"
    assert lines[1] == "Task run failed with exception: ValueError('other')" and lines[2].startswith("Traceback")
    assert "after the block" in stream.getvalue() and stream.getvalue().count("Traceback") == 2
    assert handler.filters == []
