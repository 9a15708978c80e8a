"""No host synchronisation per micro-batch (issue 38 item 5): the trainer's checks (finite outputs and losses,
finite inputs) and the selective LM head's token selection run on the device and are read once per step.

On the CPU nothing waits for a device, but the operations that would (reading a tensor's value on the host,
data-dependent shapes such as `nonzero` and boolean indexing) are the same aten calls, so they are counted
under a dispatch mode: per step they must not grow with the number of micro-batches beyond the one check
transformers' own forward makes (its packed-sequence test of the position ids)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agent_core.training.batches import make_micro_batches
from agent_core.training.scoring import sequence_logprobs
from agent_core.training.settings import PPOSettings
from agent_core.training.trainer import make_optimizer, train_iteration
from test_trainer import PAD, random_steps, tiny_llama

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "index.Tensor_bool", "item"}


class SyncCounter(TorchDispatchMode):
    """Counts aten calls whose CUDA version makes the host wait for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING or (name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) if i is not None)):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _syncs(micro_batch_tokens: int) -> tuple[int, int]:
    """(host syncs, micro-batches) of one update of 12 sequences at this micro-batch size."""
    model = tiny_llama()
    steps = random_steps(3, count=12)
    settings = PPOSettings(epochs=1, mini_batches=1, micro_batch_tokens=micro_batch_tokens, max_logit_elements=2**30)
    counter = SyncCounter()
    with counter:
        [result] = train_iteration(model, make_optimizer(model, lr=1e-3), steps, settings, pad_id=PAD)
    assert not result.skipped
    return counter.count, len(make_micro_batches(steps, max_tokens=micro_batch_tokens, pad_id=PAD))


def _model_syncs() -> int:
    """What one forward of the model itself does (transformers checks its position ids for packed sequences)."""
    model, counter = tiny_llama(), SyncCounter()
    with counter, torch.no_grad():
        model.model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False)
    return counter.count


def test_host_syncs_per_step_do_not_grow_with_micro_batches():
    one_syncs, one = _syncs(4096)
    many_syncs, many = _syncs(16)
    assert one == 1 and many >= 6
    # a fixed number per step (normalizers, metrics, the gradient norm); per micro-batch only the model's own
    assert many_syncs - one_syncs == (many - one) * _model_syncs()


def test_the_counted_selection_gives_the_boolean_selections_values_and_gradients():
    model = tiny_llama()
    batch = make_micro_batches(random_steps(4, count=4), max_tokens=4096, pad_id=PAD)[0]
    positions = batch.action_mask > 0
    count = int(((positions[:, 1:]) & (batch.attention_mask[:, 1:] > 0)).sum())
    results = []
    for position_count in (None, count):
        model.zero_grad()
        logprobs, entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, positions=positions,
                                              position_count=position_count)
        (logprobs.sum() + entropy.sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
