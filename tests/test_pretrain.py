"""Induction pretraining (agent_core/training/pretrain.py): `copy_batch` builds span + separator +
the same span; `induction_pretrain` teaches a tiny from-scratch policy to copy (held-out copy
accuracy, measured here independently of the trainer's own numbers, rises from chance while the
unpredictable first half stays at chance), trains in place only when steps > 0, refuses bad
arguments; and `init_policy` (tasks/init_policy.py) runs it exactly when policy.pretrain_steps > 0."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from agent_core.config import DataConfig, PolicyConfig
from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.io.checkpoints import load_tokenizer
from agent_core.io.layout import DataRoot
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.pretrain import PretrainResult, copy_batch, induction_pretrain

SPAN = 10


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster than contending for the CI machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    task = generate_synthetic_qa(seed=0, num_films=20, num_people=12, num_cities=5, num_countries=3)
    return build_tokenizer([d.text for d in task.documents], vocab_size=320)


def _ordinary(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _model(tokenizer, seed: int = 0):
    return build_tiny_policy(tokenizer, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=seed)


def _accuracy(model, tokenizer, seed: int = 1234) -> tuple[float, float]:
    """Teacher-forced greedy accuracy on fresh copy batches: (on the repeat, on the random first half)."""
    batch = copy_batch(torch.tensor(_ordinary(tokenizer)), tokenizer.eos_token_id, 128, SPAN,
                       torch.Generator().manual_seed(seed))
    with torch.no_grad():
        predicted = model(input_ids=batch).logits.argmax(-1)
    repeat = (predicted[:, SPAN:-1] == batch[:, SPAN + 1:]).float().mean()  # after the separator
    noise = (predicted[:, :SPAN - 1] == batch[:, 1:SPAN]).float().mean()  # unpredictable tokens
    return float(repeat), float(noise)


def test_copy_batch_is_a_span_a_separator_and_the_span_again():
    pool = torch.tensor([5, 6, 7, 8, 9, 40, 41])
    batch = copy_batch(pool, 99, batch_size=6, span=4, generator=torch.Generator().manual_seed(0))
    assert batch.shape == (6, 9) and batch.dtype == torch.long
    assert torch.equal(batch[:, 4], torch.full((6,), 99))
    assert torch.equal(batch[:, :4], batch[:, 5:])
    assert set(batch[:, :4].flatten().tolist()) <= set(pool.tolist())
    again = copy_batch(pool, 99, 6, 4, torch.Generator().manual_seed(0))
    other = copy_batch(pool, 99, 6, 4, torch.Generator().manual_seed(1))
    assert torch.equal(batch, again) and not torch.equal(batch, other)


def test_pretraining_teaches_the_model_to_copy(tokenizer):
    model = _model(tokenizer)
    chance = 1 / len(_ordinary(tokenizer))
    before, _ = _accuracy(model, tokenizer)
    result = induction_pretrain(model, _ordinary(tokenizer), tokenizer.eos_token_id, steps=300, lr=3e-3,
                                max_span=12, seed=0)
    after, noise_after = _accuracy(model, tokenizer)
    assert before < 0.03
    assert after > 0.1 and after > before + 0.08  # measured on batches the training never drew
    assert noise_after < 0.03 + 5 * chance  # the gain is copying, not guessing the noise
    assert isinstance(result, PretrainResult) and result.steps == 300 and result.final_accuracy > 0.1
    assert not model.training  # handed back in eval mode


def test_zero_steps_leave_the_parameters_unchanged_and_steps_change_them(tokenizer):
    untouched, trained = _model(tokenizer), _model(tokenizer)
    original = {k: v.clone() for k, v in untouched.state_dict().items()}
    result = induction_pretrain(untouched, _ordinary(tokenizer), tokenizer.eos_token_id, steps=0)
    assert result.steps == 0
    assert all(torch.equal(original[k], v) for k, v in untouched.state_dict().items())
    induction_pretrain(trained, _ordinary(tokenizer), tokenizer.eos_token_id, steps=2, batch_size=4, max_span=6)
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(original[k], v)]
    assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed


@pytest.mark.parametrize("kwargs", [dict(steps=-1), dict(steps=1, batch_size=0), dict(steps=1, min_span=0),
                                    dict(steps=1, min_span=5, max_span=4)])
def test_bad_arguments_are_refused(tokenizer, kwargs):
    with pytest.raises(ValueError, match="induction_pretrain"):
        induction_pretrain(_model(tokenizer), _ordinary(tokenizer), tokenizer.eos_token_id, **kwargs)


def test_fewer_than_two_token_ids_are_refused(tokenizer):
    with pytest.raises(ValueError, match="at least two token ids"):
        induction_pretrain(_model(tokenizer), [7], tokenizer.eos_token_id, steps=1)


def test_init_policy_pretrains_the_tiny_policy_only_when_pretrain_steps_is_positive(tmp_path, monkeypatch):
    import tasks.init_policy as stage
    from tasks.prepare_data import prepare_dataset

    calls = []

    def spy(model, token_ids, separator_id, **kwargs):
        calls.append((list(token_ids), separator_id, kwargs))
        return induction_pretrain(model, token_ids, separator_id, **kwargs)

    monkeypatch.setattr(stage, "induction_pretrain", spy)
    dataset = prepare_dataset.fn(str(tmp_path), DataConfig(num_films=8, num_people=6, num_cities=3, num_countries=2))
    sizes = dict(vocab_size=320, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=16, seed=3)
    weights = {}
    for steps in (0, 3):
        run = DataRoot(tmp_path).run(f"steps{steps}")
        directory = stage.init_policy.fn(run, dataset, PolicyConfig(**sizes, pretrain_steps=steps, pretrain_lr=2e-3))
        weights[steps] = load_file(f"{directory}/model.safetensors")
    assert len(calls) == 1  # not called for pretrain_steps=0
    token_ids, separator, kwargs = calls[0]
    tokenizer = load_tokenizer(run.initial_policy_dir)
    assert (kwargs["steps"], kwargs["lr"], kwargs["seed"]) == (3, 2e-3, 3) and separator == tokenizer.eos_token_id
    special = set(tokenizer.all_special_ids)
    assert not set(token_ids) & special and len(token_ids) == len(tokenizer) - len(special)
    fresh = build_tiny_policy(tokenizer, **{k: v for k, v in sizes.items() if k != "vocab_size"}).state_dict()
    assert all(torch.equal(weights[0][k], fresh[k]) for k in weights[0])  # steps=0: the untrained model
    assert any(not torch.equal(weights[0][k], weights[3][k]) for k in weights[0])
