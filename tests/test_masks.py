"""Masks: the action mask of a step, and the loss/advantage masks on and off (docs/architecture.md §3)."""

from __future__ import annotations

import pytest
import torch

from agent_core.algos.masks import (
    Masks,
    action_mask_for_step,
    derive_masks,
    first_action_index,
    grid_advantage_mask,
    predicted_token_mask,
    response_region_mask,
)


def test_action_mask_marks_only_the_response():
    mask = action_mask_for_step(3, 2)
    assert mask.tolist() == [0, 0, 0, 1, 1]
    assert mask.dtype == torch.long
    assert action_mask_for_step(2, 0).tolist() == [0, 0]


@pytest.mark.parametrize("prompt_len, response_len", [(0, 3), (2, -1)])
def test_action_mask_rejects_impossible_lengths(prompt_len, response_len):
    with pytest.raises(ValueError, match="prompt_len|response_len"):
        action_mask_for_step(prompt_len, response_len)


# Two right-padded rows: row 0 = prompt(3) + response(2); row 1 = prompt(2) + response(1) + padding(2).
ACTION = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


def test_masks_on_are_the_action_mask():
    masks = derive_masks(ACTION, ATTENTION, use_loss_mask=True, use_advantage_mask=True)
    assert isinstance(masks, Masks)
    assert masks.loss_mask.dtype == torch.float32 and masks.advantage_mask.dtype == torch.float32
    assert masks.loss_mask.tolist() == ACTION.float().tolist()
    assert masks.advantage_mask.tolist() == ACTION.float().tolist()


# A packed episode (first prompt 2 tokens, action, observation, action) and a step row whose
# response region starts at its prompt suffix (position 2: the previous step's observation).
PACKED_ACTION = torch.tensor([[0, 0, 1, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 0]])
PACKED_ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
REGION = [[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0]]


def test_masks_off_cover_the_response_region_only():
    masks = derive_masks(PACKED_ACTION, PACKED_ATTENTION, use_loss_mask=False, use_advantage_mask=False,
                         response_start=torch.tensor([2, 2]))
    # the observation tokens after the first action (row 0) and the prompt suffix (row 1) count;
    # the first prompt and earlier turns (context only) and padding never do
    assert masks.loss_mask.tolist() == REGION
    assert masks.advantage_mask.tolist() == REGION


def test_the_region_starts_at_the_first_action_token_by_default():
    masks = derive_masks(PACKED_ACTION, PACKED_ATTENTION, use_loss_mask=False, use_advantage_mask=False)
    assert masks.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0]]
    # step rows without an observation prefix: off = on
    off = derive_masks(ACTION, ATTENTION, use_loss_mask=False, use_advantage_mask=False)
    assert off.loss_mask.tolist() == ACTION.float().tolist()
    assert response_region_mask(ATTENTION, torch.tensor([1, 1]), ACTION).tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="response_start must be"):
        derive_masks(ACTION, ATTENTION, use_loss_mask=False, use_advantage_mask=False, response_start=torch.tensor([1]))


def test_loss_and_advantage_masks_switch_independently():
    # The paper's middle ablation: advantage mask off, loss mask on.
    masks = derive_masks(PACKED_ACTION, PACKED_ATTENTION, use_loss_mask=True, use_advantage_mask=False,
                         response_start=torch.tensor([2, 2]))
    assert masks.loss_mask.tolist() == PACKED_ACTION.float().tolist()
    assert masks.advantage_mask.tolist() == REGION
    masks = derive_masks(PACKED_ACTION, PACKED_ATTENTION, use_loss_mask=False, use_advantage_mask=True,
                         response_start=torch.tensor([2, 2]))
    assert masks.loss_mask.tolist() == REGION
    assert masks.advantage_mask.tolist() == PACKED_ACTION.float().tolist()


def test_grid_advantage_mask_and_first_action_index():
    action, real = torch.tensor([[1, 1, 0, 1]]), torch.tensor([[1, 1, 1, 1]])
    assert grid_advantage_mask(action, real, True).tolist() == [[1.0, 1.0, 0.0, 1.0]]
    assert grid_advantage_mask(action, real, False).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert first_action_index([0, 0, 1, 0]) == 2 and first_action_index([0, 0]) == 2


def test_action_mask_never_reaches_padding():
    bad_action = torch.tensor([[0, 1, 1, 1]])  # claims a padding position
    attention = torch.tensor([[1, 1, 1, 0]])
    masks = derive_masks(bad_action, attention, use_loss_mask=True, use_advantage_mask=True)
    assert masks.loss_mask.tolist() == [[0, 1, 1, 0]]


def test_predicted_token_mask_handles_left_padding():
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert predicted_token_mask(attention).tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]


def test_derive_masks_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="action_mask and attention_mask"):
        derive_masks(ACTION, ATTENTION[:, :4], use_loss_mask=True, use_advantage_mask=True)
