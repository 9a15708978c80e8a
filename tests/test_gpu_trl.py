"""bench/gpu.py's `trl_vs_ours` row (bench/gpu_trl.py): its --quick run times both sides, and a
TRL that is not there (no interpreter, or one where TRL does not import) is a skipped row with the
reason, never a crash."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from bench.gpu_trl import KEY, trl_grad_accum, trl_python, trl_row
from bench.trl_side import TRL_PYTHON

REPO = Path(__file__).resolve().parent.parent
GPU_MACHINE_LACKS = ("prefect", "duckdb", "mlflow", "pandera", "vllm", "ray")


@pytest.fixture
def no_trl_settings(monkeypatch):
    monkeypatch.delenv("TRL_SITE", raising=False)
    monkeypatch.delenv("TRL_PYTHON", raising=False)
    return monkeypatch


def test_missing_trl_interpreter_is_a_skipped_row_with_the_reason(no_trl_settings, tmp_path):
    no_trl_settings.setenv("TRL_PYTHON", str(tmp_path / "no-python"))
    m = trl_row(None, None, None, Namespace(), None, print)  # returns before it builds anything
    assert m.key == KEY and m.met is None and not math.isfinite(m.ratio)
    assert "TRL's interpreter not found" in m.skipped and "make trl" in m.skipped


def test_trl_site_that_is_no_folder_is_named(no_trl_settings, tmp_path):
    no_trl_settings.setenv("TRL_SITE", str(tmp_path / "absent"))
    assert trl_python() == f"TRL_SITE is not a folder: {tmp_path / 'absent'}"
    no_trl_settings.setenv("TRL_SITE", str(tmp_path))
    side = trl_python()
    assert side.python == Path(sys.executable) and side.pythonpath == str(tmp_path)
    assert str(tmp_path) not in side.source  # recorded in the results: no machine path


def test_trl_that_does_not_import_is_a_skipped_row(no_trl_settings, tmp_path):
    """This Python with a TRL_SITE whose `trl` fails to import, as a site missing a wheel would."""
    from bench.gpu_workload import TINY, shaped_tokenizer
    from bench.workload import synthetic_task

    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'datasets'\")\n")
    no_trl_settings.setenv("TRL_SITE", str(tmp_path))
    task = synthetic_task(0, small=True)
    args = Namespace(updates=1, group_size=2, new_tokens=8, context=2048, prompts=2, seed=0)
    m = trl_row(TINY, shaped_tokenizer(task, TINY.vocab), task, args, __import__("torch").device("cpu"), print)
    assert m.skipped == "TRL does not import (this Python with $TRL_SITE): ModuleNotFoundError: No module named " \
                        "'datasets'"


def test_trl_micro_batches_hold_at_most_32_completions():
    assert [trl_grad_accum(n) for n in (4, 32, 64, 256, 48)] == [1, 1, 2, 8, 3]


@pytest.mark.slow
@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason="TRL's virtualenv is not built (make trl)")
def test_quick_trl_row_times_both_sides_without_the_modules_a_gpu_machine_lacks(tmp_path):
    out = tmp_path / "gpu.json"
    code = ("import json, sys\nfrom bench import gpu\n"
            f"assert gpu.main(['--quick', '--only', 'trl', '--out', {str(out)!r}]) == 0\n"
            f"loaded = {{m.split('.')[0] for m in sys.modules}} & set({GPU_MACHINE_LACKS!r})\n"
            "print('LOADED', json.dumps(sorted(loaded)))")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TRL_SITE", "TRL_PYTHON")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert json.loads(done.stdout.split("LOADED", 1)[1]) == []
    (row,) = json.loads(out.read_text())["measurements"]
    assert row["key"] == KEY and not row["skipped"] and "error" not in row["details"], row
    details = row["details"]
    assert details["trl_seconds_per_iteration"] > 0 and details["our_seconds_per_iteration"] > 0
    assert math.isfinite(row["ratio"]) and row["ratio"] > 0
    assert len(details["ours"]["iteration_seconds"]) == len(details["trl"]["step_seconds"]) == 2
    assert details["settings"]["prompts"] == 2 and details["settings"]["group_size"] == 2
    assert details["prompt_tokens_match"], details["prompt_tokens_total"]
    assert all(0 < n <= 2 * 2 * 8 for n in details["ours"]["generated_tokens"])
    assert "trl" in details["trl"]["distributions"] and details["trl_python"] == ".venv-trl"
