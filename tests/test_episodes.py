"""The one episode representation: episodes from rows, the packed-row alignment shared by the
advantages grid and training rows, and the one join of the steps table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from agent_core.algos.episodes import EpisodeStep, build_episode_layout
from agent_core.algos.step_advantages import StepRewardRow, estimate_step_advantages, prepare_episodes
from agent_core.episodes import StepSpan, episodes_from_rows, pack_steps
from agent_core.io.tables import join_steps, write_table
from agent_core.training.batches import TrainStep, choose_layout, episode_sequence
from tests.test_schemas import advantages_rows, steps_rows


@dataclass(frozen=True)
class Row:
    episode_id: str
    group_id: str
    step_idx: int


def test_episodes_come_in_first_seen_order_with_steps_sorted():
    rows = [Row("b", "g2", 1), Row("a", "g1", 0), Row("b", "g2", 0), Row("a", "g1", 1)]
    episodes = episodes_from_rows(rows)
    assert [e.episode_id for e in episodes] == ["b", "a"]
    assert [e.group_id for e in episodes] == ["g2", "g1"]
    assert [[s.step_idx for s in e.steps] for e in episodes] == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match=r"episode 'a': step_idx must run 0..1; got \[0, 2\]"):
        episodes_from_rows([Row("a", "g", 0), Row("a", "g", 2)])
    with pytest.raises(ValueError, match="episode 'a': steps disagree on group_id"):
        episodes_from_rows([Row("a", "g", 0), Row("a", "h", 1)])


def test_packed_row_puts_token_t_at_position_t():
    append_only = [EpisodeStep([1, 2], [10, 11], 0.0), EpisodeStep([1, 2, 10, 11, 90, 91], [12], 1.0)]
    row = pack_steps(append_only)
    assert row.append_only and row.prompt_length == 2
    assert row.token_ids == (1, 2, 10, 11, 90, 91, 12)  # = the last step's prompt + response
    assert row.spans == (StepSpan(2, 4, 6), StepSpan(6, 7, 7))
    for step, span in zip(append_only, row.spans):  # each response sits where its prompt ends
        assert span.start == len(step.prompt_ids)
        assert list(row.token_ids[span.start:span.response_end]) == step.response_ids
    windowed = pack_steps([EpisodeStep([1, 2], [20], 0.0), EpisodeStep([1, 2, 99], [21, 22], 0.5)])
    assert not windowed.append_only and windowed.token_ids == (1, 2, 20, 21, 22)
    assert windowed.spans == (StepSpan(2, 3, 3), StepSpan(3, 5, 5))
    with pytest.raises(ValueError, match="at least one step"):
        pack_steps([])


def test_advantages_grid_and_training_row_share_one_alignment():
    rows = [StepRewardRow("a", "g", 0, [1, 2], [10, 11], 0.0),
            StepRewardRow("a", "g", 1, [1, 2, 10, 11, 90, 91], [12], 1.0),
            StepRewardRow("b", "g", 0, [1, 2], [13, 14, 15], 0.0)]
    batch = prepare_episodes(rows)
    values = torch.arange(batch.layout.input_ids.numel(), dtype=torch.float32).reshape(batch.layout.input_ids.shape)
    results = estimate_step_advantages(batch, estimator="gae", gamma=0.9, lam=0.8, eps=1e-6, norm_by_std=False,
                                       use_advantage_mask=False, values=values)
    by_step = {(r.episode_id, r.step_idx): r for r in results}
    steps = [TrainStep(r.prompt_ids, r.response_ids, [0.0] * len(r.response_ids), by_step[r.episode_id, r.step_idx].advantages,
                       values=by_step[r.episode_id, r.step_idx].values,
                       obs_advantages=by_step[r.episode_id, r.step_idx].obs_advantages,
                       obs_values=by_step[r.episode_id, r.step_idx].obs_values) for r in rows[:2]]
    packed = episode_sequence(steps)
    layout = batch.layout
    width = layout.row_length(0)
    assert packed.input_ids == layout.row_context(0) == layout.input_ids[0, :width].tolist()
    assert packed.action_mask == layout.action_mask[0, :width].tolist()
    assert packed.response_start == len(layout.first_prompt_ids[0])
    # the critic's values went in at grid column t and come back at training position t
    region = range(packed.response_start, width)
    assert [packed.old_values[t] for t in region] == [float(values[0, t]) for t in region]
    assert choose_layout([steps], "packed")[0] == packed


def test_join_steps_keeps_the_steps_order_and_names_missing_rows(tmp_path):
    steps_uri = write_table("steps", steps_rows(), tmp_path / "steps.parquet")
    advantages = advantages_rows()
    advantages_uri = write_table("advantages", advantages, tmp_path / "advantages.parquet")
    joined = join_steps(steps_uri, ["prompt_ids"], "advantages", advantages_uri, ["advantages"])
    assert [(r["episode_id"], r["step_idx"]) for r in joined] == [(r["episode_id"], r["step_idx"]) for r in steps_rows()]
    assert all(r["prompt_ids"] == [1, 2, 3] and r["advantages"] == [0.5, -0.5] for r in joined)
    partial = write_table("advantages", [r for r in advantages if (r["episode_id"], r["step_idx"]) != ("ep-1", 2)],
                          tmp_path / "partial.parquet")
    with pytest.raises(ValueError, match=r"no advantages row for steps \['ep-1/2'\] \(1 steps\)"):
        join_steps(steps_uri, ["prompt_ids"], "advantages", partial, ["advantages"])


def test_join_steps_on_the_steps_trained_leaves_out_steps_without_a_row_but_not_rows_without_a_step(tmp_path):
    steps_uri = write_table("steps", steps_rows(), tmp_path / "steps.parquet")
    advantages = advantages_rows()
    trained = write_table("advantages", [r for r in advantages if r["episode_id"] != "ep-1"], tmp_path / "some.parquet")
    joined = join_steps(steps_uri, ["prompt_ids"], "advantages", trained, ["advantages"], every_step=False)
    assert {r["episode_id"] for r in joined} == {r["episode_id"] for r in advantages} - {"ep-1"}
    assert [(r["episode_id"], r["step_idx"]) for r in joined] == [
        (r["episode_id"], r["step_idx"]) for r in steps_rows() if r["episode_id"] != "ep-1"]
    stray = write_table("advantages", [*advantages, {**advantages[0], "episode_id": "ghost"}], tmp_path / "stray.parquet")
    with pytest.raises(ValueError, match=r"advantages rows \['ghost/0'\] have no row in .*steps.parquet \(1 rows\)"):
        join_steps(steps_uri, ["prompt_ids"], "advantages", stray, ["advantages"], every_step=False)
