"""The in-process transformers engine (agent_core/rollout/hf_engine.py) on a tiny real Llama."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agent_core.rollout.chat import encode_conversation, eos_token_ids
from agent_core.rollout.engine import FINISH_REASONS, SamplingParams
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage

TEXTS = [
    "Who directed The Silent Harbor? <search>The Silent Harbor director</search>",
    "<information>Doc 1: The Silent Harbor was directed by Ana Kowalski.</information>",
    "Where was Ana Kowalski born? <answer>Gdansk</answer>",
] * 20
QUESTIONS = ("Who directed The Silent Harbor?", "Where?", "Where was Ana Kowalski born, and when was she born?")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=320)


@pytest.fixture(scope="module")
def model(tokenizer):
    policy = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    # A fresh model's logits are nearly uniform (top-2 gaps down to ~1e-4), so float noise from
    # padding could flip a greedy choice; sharper logits make the greedy comparisons robust.
    with torch.no_grad():
        policy.lm_head.weight.mul_(20.0)
    return policy


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [encode_conversation(tokenizer, [ChatMessage("user", q)]) for q in QUESTIONS]


def _teacher_forced_logprobs(model, prompt: list[int], generated: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(generated)[:, None]).squeeze(-1)


def _manual_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]):
    """Plain reference: full forward pass per token (no cache, no padding), argmax, stop on a stop id."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            token = int(logp.argmax())
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token in stop_ids:
                break
    return ids[len(prompt) :], logprobs


def _check_shape(generations, max_new_tokens: int, stop_ids: tuple[int, ...]):
    for gen in generations:
        assert 1 <= len(gen.token_ids) == len(gen.logprobs) <= max_new_tokens
        assert gen.finish_reason in FINISH_REASONS
        assert all(lp <= 0 and lp == lp for lp in gen.logprobs)
        assert not set(gen.token_ids[:-1]) & set(stop_ids)  # nothing kept after the first stop token
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] in stop_ids
        else:
            assert len(gen.token_ids) == max_new_tokens and gen.token_ids[-1] not in stop_ids


def test_sampled_logprobs_equal_a_teacher_forced_forward_pass(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.7, seed=3))
    _check_shape(generations, 24, eos_token_ids(tokenizer))
    for prompt, gen in zip(prompts, generations):
        expected = _teacher_forced_logprobs(model, prompt, gen.token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)


def test_greedy_equals_a_manual_argmax_loop(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    first = engine.generate(prompts, params)
    assert first == engine.generate(prompts, params)
    _check_shape(first, 16, eos_token_ids(tokenizer))
    for prompt, gen in zip(prompts, first):
        ids, logprobs = _manual_greedy(model, prompt, 16, eos_token_ids(tokenizer))
        assert gen.token_ids == ids
        assert gen.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_left_padding_does_not_change_a_prompts_result(model, tokenizer, prompts):
    assert len({len(p) for p in prompts}) == len(prompts)  # really different lengths
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    batched = engine.generate(prompts, params)
    for prompt, gen in zip(prompts, batched):
        alone = engine.generate([prompt], params)[0]
        assert alone.token_ids == gen.token_ids and alone.finish_reason == gen.finish_reason
        assert alone.logprobs == pytest.approx(gen.logprobs, abs=1e-4)


def test_batches_are_split_and_keep_input_order(model, tokenizer, prompts):
    many = [prompts[i % len(prompts)] for i in range(7)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    split = HFEngine(model, tokenizer, max_batch_size=2).generate(many, params)
    whole = HFEngine(model, tokenizer, max_batch_size=64).generate(many, params)
    assert [g.token_ids for g in split] == [g.token_ids for g in whole]
    assert split[0].token_ids == split[3].token_ids == split[6].token_ids


def test_seed_makes_sampling_reproducible_and_leaves_global_rng_alone(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    state = torch.get_rng_state()
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)
    first = engine.generate(prompts, params)
    assert torch.equal(torch.get_rng_state(), state)
    assert engine.generate(prompts, params) == first
    other = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=12))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]


def test_custom_stop_tokens_cut_the_output(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    unused = (tokenizer.pad_token_id,)  # never predicted by this model's greedy path
    free = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=unused))[0]
    assert free.finish_reason == "length"
    stop = free.token_ids[4]
    cut = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,)))[0]
    end = free.token_ids.index(stop) + 1
    assert cut.token_ids == free.token_ids[:end] and cut.finish_reason == "stop"
    assert cut.logprobs == pytest.approx(free.logprobs[:end], abs=1e-5)


def test_model_mode_and_generation_config_are_restored(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    assert engine.model is model
    saved_config = model.generation_config
    model.train()
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=1.0))
    assert model.training and model.generation_config is saved_config
    model.eval()
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert not model.training


def test_bad_requests_fail_clearly(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    assert engine.generate([], SamplingParams(max_new_tokens=4)) == []
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(prompts, SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([prompts[0], []], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, top_p=0.0))


def test_no_hidden_top_k(model, tokenizer, prompts):
    """transformers falls back to top_k=50 unless told otherwise; a hot sampler must reach past it."""
    engine = HFEngine(model, tokenizer)
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=3.0, seed=5))
    ranks = []
    for prompt, gen in zip(prompts, generations):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(-1, torch.tensor(gen.token_ids)[:, None])
        ranks += (logits > chosen).sum(-1).tolist()
    assert max(ranks) >= 50


def test_model_generation_config_does_not_leak_into_sampling(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=9)
    plain = engine.generate(prompts, params)
    saved = model.generation_config
    surprising = type(saved)(**saved.to_dict())
    surprising.top_k, surprising.repetition_penalty, surprising.min_p = 1, 3.0, 0.5
    model.generation_config = surprising
    try:
        assert engine.generate(prompts, params) == plain
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_a_seeded_prompt_samples_the_same_whatever_shares_its_call(model, tokenizer, prompts, temperature, top_p):
    """What a router relies on: a part of a call, given its prompts' seeds, samples what the whole call did."""
    a, b, c = prompts
    engine = HFEngine(model, tokenizer)
    seed = 21
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=seed)
    whole = engine.generate([a, b, c], params)
    assert engine.generate([a, b, c], replace(params, seed=None, prompt_seeds=(seed, seed + 1, seed + 2))) == whole
    alone = engine.generate([b], replace(params, prompt_seeds=(seed + 1,)))  # prompt_seeds overrides seed
    reordered = engine.generate([c, b], replace(params, seed=None, prompt_seeds=(seed + 2, seed + 1)))
    for part, same in ((alone[0], whole[1]), (reordered[1], whole[1]), (reordered[0], whole[2])):
        assert part.token_ids == same.token_ids and part.finish_reason == same.finish_reason
        assert part.logprobs == pytest.approx(same.logprobs, abs=1e-5)


def test_seeded_samples_do_not_depend_on_the_chunking(model, tokenizer, prompts):
    many = [prompts[i % len(prompts)] for i in range(7)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=4)
    split = HFEngine(model, tokenizer, max_batch_size=1).generate(many, params)
    whole = HFEngine(model, tokenizer, max_batch_size=64).generate(many, params)
    assert [g.token_ids for g in split] == [g.token_ids for g in whole]
    for a, b in zip(split, whole):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_prompt_seeds_choose_the_samples(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    first = engine.generate(prompts, replace(params, prompt_seeds=(1, 2, 3)))
    assert engine.generate(prompts, replace(params, prompt_seeds=[1, 2, 3])) == first  # a list is taken as a tuple
    other = engine.generate(prompts, replace(params, prompt_seeds=(4, 5, 6)))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    with pytest.raises(ValueError, match="prompt_seeds holds 2 seeds for 3 prompts"):
        engine.generate(prompts, replace(params, prompt_seeds=(1, 2)))
    with pytest.raises(ValueError, match="prompt_seeds"):
        engine.generate([], replace(params, prompt_seeds=(1,)))


@pytest.mark.parametrize("temperature, top_p", [(1.5, 1.0), (1.5, 0.8)])
def test_seeded_sampling_draws_from_the_tempered_nucleus(model, tokenizer, prompts, temperature, top_p):
    """The per-prompt sampler's first tokens over many seeds follow softmax(logits / T), cut to the top-p nucleus."""
    prompt, n = prompts[0], 3000
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = order[(ordered.cumsum(0) - ordered) < top_p]  # the smallest top set holding top_p of the mass
    expected = torch.zeros_like(probs)
    expected[keep] = probs[keep] / probs[keep].sum()
    engine = HFEngine(model, tokenizer, max_batch_size=1000)
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p, seed=100)
    firsts = torch.tensor([g.token_ids[0] for g in engine.generate([prompt] * n, params)])
    observed = torch.bincount(firsts, minlength=len(probs)).double() / n
    assert set(firsts.tolist()) <= set(keep.tolist())
    assert len(set(firsts.tolist())) > 3  # really a spread, not a near-greedy prompt
    # per token, within ~4.5 standard deviations of a multinomial count
    tolerance = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-3
    assert bool(((observed - expected).abs() <= tolerance).all()), (observed - expected).abs().max()
