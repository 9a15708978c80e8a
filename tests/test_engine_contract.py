"""One contract for every engine (docs/architecture.md §6), run against `hf` and `vllm` on the same tiny checkpoint.

Same token ids in; out: one generation per prompt in order, valid ids, finite log-probs, finish
reasons that agree with the stop tokens and the budget; a seeded call is reproducible and samples
each prompt from its own seed, whatever other prompts share the call; the log-probs
the trainer recomputes for the sampled tokens match the engine's; greedy outputs of the two engines
agree. The vllm half starts a real vLLM server (`make vllm`), so it is marked slow (CI runs it in
`make test-slow`); it also covers in-place weight reload, a tied-embedding checkpoint and a dead
server. The missing-virtualenv error is checked in the default suite.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agent_core.config import VLLMConfig
from agent_core.io.checkpoints import save_policy
from agent_core.rollout.chat import encode_conversation, eos_token_ids
from agent_core.rollout.engine import FINISH_REASONS, SamplingParams, concurrent_calls
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine
from agent_core.rollout.vllm_server import VLLMNotInstalledError, VLLMServerError, vllm_python
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.scoring import score_logprobs
from agent_core.types import ChatMessage

TEXTS = [
    "Who directed The Silent Harbor? <search>The Silent Harbor director</search>",
    "<information>Doc 1: The Silent Harbor was directed by Ana Kowalski.</information>",
    "Where was Ana Kowalski born? <answer>Gdansk</answer>",
] * 20
QUESTIONS = ("Who directed The Silent Harbor?", "Where?", "Where was Ana Kowalski born, and when was she born?",
             "Doc 1: The Silent Harbor")
MAX_LEN = 256


def _vllm_missing() -> str | None:
    try:
        vllm_python(VLLMConfig())
    except VLLMNotInstalledError as error:
        return str(error)
    return None


ENGINE_NAMES = ["hf", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])]


def _save_tiny(directory: Path, *, seed: int, tied: bool = False, sharpen: float = 20.0) -> Path:
    tokenizer = build_tokenizer(TEXTS, vocab_size=320)
    # head size 32: the smallest vLLM's CPU attention supports
    model = build_tiny_policy(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        # a fresh model's logits are nearly uniform; sharper ones make greedy comparisons robust to float noise
        model.lm_head.weight.mul_(sharpen)
    return save_policy(model, tokenizer, directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("contract") / "policy", seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from agent_core.io.checkpoints import load_policy

    model, tokenizer = load_policy(checkpoint)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    _, tokenizer = reference
    return [encode_conversation(tokenizer, [ChatMessage("user", q)]) for q in QUESTIONS]


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def engine(request, checkpoint):
    if request.param == "vllm" and _vllm_missing():
        pytest.fail(_vllm_missing())  # the slow suite promises the vllm half runs: never skip silently
    built = ENGINES.get(request.param)(checkpoint, EngineOptions(max_batch_size=8, max_model_len=MAX_LEN))
    yield built
    close_engine(built)


def _check_valid(generations, n_prompts: int, max_new_tokens: int, stop_ids, vocab_size: int) -> None:
    assert len(generations) == n_prompts
    for gen in generations:
        assert 1 <= len(gen.token_ids) == len(gen.logprobs) <= max_new_tokens
        assert all(0 <= t < vocab_size for t in gen.token_ids)
        assert all(lp <= 1e-6 and lp == lp and lp > -1e4 for lp in gen.logprobs)
        assert gen.finish_reason in FINISH_REASONS
        assert not set(gen.token_ids[:-1]) & set(stop_ids)  # nothing kept after the first stop token
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] in stop_ids
        else:
            assert len(gen.token_ids) == max_new_tokens


def test_sampled_outputs_are_valid_and_seeded_calls_reproducible(engine, prompts, reference):
    _, tokenizer = reference
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, stop_token_ids=eos_token_ids(tokenizer))
    first = engine.generate(prompts, params)
    _check_valid(first, len(prompts), 24, params.stop_token_ids, len(tokenizer))
    assert engine.generate(prompts, params) == first
    assert engine.generate([], params) == []
    assert concurrent_calls(engine) >= 1


def test_identical_prompts_in_one_call_are_sampled_independently(engine, prompts, reference):
    _, tokenizer = reference
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, stop_token_ids=eos_token_ids(tokenizer))
    group = engine.generate([prompts[1]] * 6, params)  # a GRPO group: one prompt, several samples
    assert len({tuple(g.token_ids) for g in group}) > 1


def test_a_seeded_prompt_samples_the_same_whatever_shares_its_call(engine, prompts, reference):
    """A call split into parts (as a router splits it across replicas), each part given its prompts'
    seeds, samples what the whole call samples."""
    _, tokenizer = reference
    seed = 7
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, stop_token_ids=eos_token_ids(tokenizer))
    whole = engine.generate(prompts, params)
    for rows in ([3, 1], [0], [2]):
        part = engine.generate([prompts[i] for i in rows],
                               replace(params, seed=None, prompt_seeds=tuple(seed + i for i in rows)))
        for i, gen in zip(rows, part):
            assert gen.token_ids == whole[i].token_ids and gen.finish_reason == whole[i].finish_reason, i
            assert torch.allclose(torch.tensor(gen.logprobs), torch.tensor(whole[i].logprobs), atol=2e-4), i
    with pytest.raises(ValueError, match="prompt_seeds"):
        engine.generate(prompts, replace(params, prompt_seeds=(seed,)))


def test_generation_ends_on_a_given_stop_token_and_keeps_it(engine, prompts, reference):
    _, tokenizer = reference
    greedy = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(-1,)))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    stop = greedy.token_ids[4]  # a token greedy decoding emits: stopping on it cuts there
    cut = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,)))[0]
    first = greedy.token_ids.index(stop)
    assert cut.finish_reason == "stop"
    assert cut.token_ids == greedy.token_ids[: first + 1]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_recomputed_logprobs_match_the_engines(engine, prompts, reference, temperature):
    model, tokenizer = reference
    params = SamplingParams(max_new_tokens=20, temperature=temperature, seed=3, stop_token_ids=eos_token_ids(tokenizer))
    generations = engine.generate(prompts, params)
    sequences = [p + g.token_ids for p, g in zip(prompts, generations)]
    scored = score_logprobs(model, sequences, tokenizer.pad_token_id, max_tokens=4096, temperature=temperature)
    for prompt, gen, row in zip(prompts, generations, scored):
        recomputed = torch.tensor(row[len(prompt):])
        assert torch.allclose(recomputed, torch.tensor(gen.logprobs), atol=2e-4), (recomputed, gen.logprobs)


def test_missing_vllm_virtualenv_names_the_command_to_run(tmp_path, checkpoint):
    options = EngineOptions(vllm=VLLMConfig(python=str(tmp_path / "no-venv" / "bin" / "python")))
    with pytest.raises(VLLMNotInstalledError, match="make vllm"):
        ENGINES.get("vllm")(checkpoint, options)


# ---- vLLM only: agreement with hf, weight sync, a dead server -------------------------------------------

@pytest.fixture(scope="module")
def vllm_engine(checkpoint):
    if _vllm_missing():
        pytest.fail(_vllm_missing())
    built = ENGINES.get("vllm")(checkpoint, EngineOptions(max_batch_size=8, max_model_len=MAX_LEN))
    yield built
    close_engine(built)


@pytest.mark.slow
@pytest.mark.vllm
def test_greedy_outputs_of_hf_and_vllm_agree(vllm_engine, checkpoint, prompts):
    hf = ENGINES.get("hf")(checkpoint, EngineOptions(max_batch_size=8))
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(-1,))
    hf_out, vllm_out = hf.generate(prompts, params), vllm_engine.generate(prompts, params)
    assert [g.token_ids for g in vllm_out] == [g.token_ids for g in hf_out]
    for a, b in zip(hf_out, vllm_out):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-4)


def _greedy(name: str, policy_dir: Path, prompts, options: EngineOptions) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy ids and their log-probs (flattened): a stale output layer shows in the log-probs even
    where greedy ids coincide (a tied tiny model tends to repeat its last token)."""
    engine = ENGINES.get(name)(policy_dir, options)
    try:
        out = engine.generate(prompts, SamplingParams(16, temperature=0.0, stop_token_ids=(-1,)))
    finally:
        close_engine(engine)
    return [g.token_ids for g in out], torch.tensor([lp for g in out for lp in g.logprobs])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_new_checkpoints_reach_the_running_server_without_a_restart(tmp_path, prompts, tied):
    from agent_core.rollout.vllm_engine import server_stats, shutdown_servers

    if _vllm_missing():
        pytest.fail(_vllm_missing())
    options = EngineOptions(max_batch_size=8, max_model_len=MAX_LEN)
    dirs = [_save_tiny(tmp_path / f"v{seed}", seed=seed, tied=tied) for seed in (1, 2, 1)]
    shutdown_servers()
    try:
        logprobs = []
        for directory in dirs:
            expected_ids, expected_logprobs = _greedy("hf", directory, prompts, options)
            ids, got_logprobs = _greedy("vllm", directory, prompts, options)
            assert ids == expected_ids, f"vLLM's greedy output differs from transformers' for {directory.name}"
            assert torch.allclose(got_logprobs, expected_logprobs, atol=2e-4), directory.name
            logprobs.append(got_logprobs)
        assert logprobs[0].shape != logprobs[1].shape or not torch.allclose(logprobs[0], logprobs[1])  # weights changed
        (stats,) = server_stats()
        assert stats["reloads"] == 2 and stats["restarts"] == 0
    finally:
        shutdown_servers()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_dead_server_fails_the_call_clearly_and_is_replaced_on_the_next_rollout(tmp_path, prompts):
    from agent_core.rollout.vllm_engine import server_stats, shutdown_servers

    if _vllm_missing():
        pytest.fail(_vllm_missing())
    options = EngineOptions(max_batch_size=8, max_model_len=MAX_LEN)
    directory = _save_tiny(tmp_path / "policy", seed=4)
    shutdown_servers()
    try:
        engine = ENGINES.get("vllm")(directory, options)
        os.killpg(engine.server.process.pid, signal.SIGKILL)
        engine.server.process.wait(timeout=30)
        with pytest.raises(VLLMServerError, match="not running"):
            engine.generate(prompts, SamplingParams(8, temperature=0.0))
        close_engine(engine)
        (ids, logprobs), (hf_ids, hf_logprobs) = (_greedy(name, directory, prompts, options) for name in ("vllm", "hf"))
        assert ids == hf_ids and torch.allclose(logprobs, hf_logprobs, atol=2e-4)
        assert len(server_stats()) == 1
    finally:
        shutdown_servers()
