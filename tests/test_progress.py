"""Progress of the long loops: the agent loop counts episodes with tokens/s, the trainer counts
micro-batches with the update's loss, and the stage shows it as a bar on a terminal or as periodic
log lines elsewhere ($AGENTR1_PROGRESS)."""

from __future__ import annotations

import io
import logging
from dataclasses import replace

import pytest

import tasks._common as common
from agent_core.progress import BarReporter, LogReporter, report, reporting_to
from agent_core.training.trainer import make_optimizer, train_iteration
from tests.test_agent_loop import ScriptedEngine, _run, task  # noqa: F401  (task is a fixture)
from tests.test_trainer import ITERATION, PAD, full_steps, tiny_llama


class Recorder:
    def __init__(self):
        self.updates: list[tuple[int, int | None, dict]] = []
        self.closed = False

    def update(self, advance, total, stats):
        self.updates.append((advance, total, dict(stats)))

    def close(self):
        self.closed = True


def test_report_without_a_reporter_is_a_no_op_and_the_block_restores_the_previous_one():
    report(3, total=5, loss=1.0)  # nobody listens: nothing happens, nothing raises
    outer, inner = Recorder(), Recorder()
    with reporting_to(outer):
        report(1)
        with reporting_to(inner):
            report(2)
        report(1)
    report(1)
    assert [u[0] for u in outer.updates] == [1, 1] and [u[0] for u in inner.updates] == [2]
    assert outer.closed and inner.closed


def test_log_reporter_logs_at_most_once_per_interval_with_the_last_value_of_each_stat(caplog):
    now = [0.0]
    reporter = LogReporter(logging.getLogger("progress-test"), "rollout iteration 0", "episodes", every_s=10.0,
                           clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="progress-test"):
        for second in range(1, 26):
            now[0] = float(second)
            reporter.update(1, 25, {"tokens/s": float(second)} if second % 2 else {"steps": second})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["rollout iteration 0: 10/25 episodes, tokens/s 9, steps 10",
                     "rollout iteration 0: 20/25 episodes, tokens/s 19, steps 20"]


def test_bar_reporter_draws_the_count_total_and_stats():
    stream = io.StringIO()
    with reporting_to(BarReporter("train iteration 0", "micro-batches", stream=stream)):
        for _ in range(4):
            report(1)
        report(0, update="1/1", loss=0.25)
    final = stream.getvalue().split("\r")[-1]
    assert "train iteration 0" in final and "4 micro-batches" in final and "update 1/1, loss 0.25" in final


def test_the_agent_loop_reports_each_finished_episode_with_tokens_per_second(task):  # noqa: F811
    engine = ScriptedEngine(task[1], ["<search>Quill</search>", "<answer>Paris</answer>"])
    recorder = Recorder()
    with reporting_to(recorder):
        steps = _run(task, engine, group_size=2, prompts=3)
    episodes = len({s.episode_id for s in steps})
    assert episodes == 6 and [u[0] for u in recorder.updates] == [1] * episodes
    assert all(total == episodes for _, total, _ in recorder.updates)
    assert recorder.updates[-1][2]["steps"] == len(steps) and recorder.updates[-1][2]["tokens/s"] > 0


def test_the_trainer_counts_micro_batches_and_reports_each_update_loss_without_changing_the_result():
    steps = full_steps(10)
    settings = replace(ITERATION, epochs=2, mini_batches=3)
    recorder = Recorder()
    model = tiny_llama()
    with reporting_to(recorder):
        results = train_iteration(model, make_optimizer(model, lr=1e-3), steps, settings, pad_id=PAD, seed=7)
    counted = sum(advance for advance, _, _ in recorder.updates)
    assert counted >= len(results) == 6  # at least one micro-batch per update (24-token budget: more)
    update_stats = [stats for advance, _, stats in recorder.updates if advance == 0]
    assert [s["update"] for s in update_stats] == [f"{i}/6" for i in range(1, 7)]
    assert [s["loss"] for s in update_stats] == [r.loss for r in results]
    plain = tiny_llama()
    assert [r.loss for r in train_iteration(plain, make_optimizer(plain, lr=1e-3), steps, settings, pad_id=PAD,
                                            seed=7)] == [r.loss for r in results]


@pytest.mark.parametrize("mode, tty, expected", [
    ("off", True, None), ("log", True, LogReporter), ("bar", False, BarReporter),
    ("auto", True, BarReporter), ("auto", False, LogReporter), ("", False, LogReporter),
])
def test_the_stage_picks_a_bar_on_a_terminal_and_log_lines_elsewhere(monkeypatch, mode, tty, expected):
    monkeypatch.setenv(common.PROGRESS_ENV, mode)
    monkeypatch.setattr(common.sys.stderr, "isatty", lambda: tty, raising=False)
    seen = []
    monkeypatch.setattr(common, "reporting_to", lambda reporter: (seen.append(reporter), reporting_to(reporter))[1])
    with common.stage_progress("rollout", "rollout iteration 0", "episodes"):
        report(1)
    assert [type(r) for r in seen] == ([] if expected is None else [expected])


def test_an_unknown_progress_mode_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv(common.PROGRESS_ENV, "fancy")
    with pytest.raises(ValueError, match="valid: auto, bar, log, off"):
        common.progress_mode()


def test_the_library_info_lines_are_not_hidden_by_the_root_level():
    assert logging.getLogger("agent_core.rollout.agent_loop").getEffectiveLevel() <= logging.INFO
