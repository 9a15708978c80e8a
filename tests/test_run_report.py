"""The end-of-run report: one PNG per learning curve and the iteration table as markdown."""

from __future__ import annotations

import math

from agent_core.io.run_report import RUN_CURVES, plot_run_curves, run_table_markdown
from agent_core.io.summaries import IterationSummary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def summary(iteration: int, dev_em: float = math.nan, kl: float = 0.01, failed: int = 0) -> IterationSummary:
    return IterationSummary(
        iteration=iteration, episodes=6, failed_episodes=failed, mean_reward=0.1 * iteration, em=0.5, f1=0.5, format_score=1.0,
        steps_per_episode=2.5, tool_calls_per_episode=1.5, generated_tokens=100, loss=0.2, pg_loss=0.2,
        value_loss=math.nan, kl=kl, entropy=3.0, clipfrac=0.0, grad_norm=1.0, train_tokens_per_s=10.0,
        skipped_updates=0, dev_em=dev_em, dev_f1=dev_em,
    )


def test_every_curve_is_a_png_file(tmp_path):
    written = plot_run_curves([summary(0), summary(1, dev_em=0.25)], tmp_path, start_dev_em=0.1)
    assert [p.name for p in written] == [f"{c.stem}.png" for c in RUN_CURVES]
    assert {c.stem for c in RUN_CURVES} >= {"reward", "em", "tool_calls", "turns", "kl", "entropy"}
    assert all(p.read_bytes().startswith(PNG_MAGIC) and p.stat().st_size > 2000 for p in written)


def test_the_table_has_a_row_per_iteration_and_dashes_where_nothing_was_measured():
    text = run_table_markdown("r1", [summary(0), summary(1, dev_em=0.25, failed=2)], start_dev_em=0.125, model="m v2")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| iteration")]
    assert [row.split(" | ")[0] for row in rows] == ["| start", "| 0", "| 1"]
    header = [c.strip() for c in text.splitlines()[4].strip("|").split("|")]
    cells = {row.split(" | ")[0].removeprefix("| "): [c.strip() for c in row.strip("|").split("|")] for row in rows}
    dev = header.index("dev EM")
    assert cells["start"][dev] == "0.125" and cells["0"][dev] == "-" and cells["1"][dev] == "0.250"
    assert cells["1"][header.index("mean reward")] == "0.100" and cells["start"][header.index("loss")] == "-"
    assert "Registered model: m v2" in text
    failed = header.index("failed episodes")
    assert (cells["start"][failed], cells["0"][failed], cells["1"][failed]) == ("-", "0", "2")
