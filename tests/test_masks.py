"""Masks: the action mask of a step, and the loss/advantage masks on and off (DESIGN.md §3)."""

from __future__ import annotations

import pytest
import torch

from agent_core.algos.masks import Masks, action_mask_for_step, derive_masks, predicted_token_mask


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


def test_masks_off_cover_every_predicted_real_token():
    masks = derive_masks(ACTION, ATTENTION, use_loss_mask=False, use_advantage_mask=False)
    expected = [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]  # no first token (no context), no padding
    assert masks.loss_mask.tolist() == expected
    assert masks.advantage_mask.tolist() == expected


def test_loss_and_advantage_masks_switch_independently():
    # The paper's middle ablation: advantage mask off, loss mask on.
    masks = derive_masks(ACTION, ATTENTION, use_loss_mask=True, use_advantage_mask=False)
    assert masks.loss_mask.tolist() == ACTION.float().tolist()
    assert masks.advantage_mask.tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]


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
