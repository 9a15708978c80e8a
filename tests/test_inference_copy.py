"""The hf engine's bf16 inference copy (agent_core/rollout/inference_copy.py, rollout.hf.dtype): made from the
trainer's resident module, refreshed in place before each rollout, equal to the weights the trainer's bf16
autocast uses, and freed with the run's resources. bf16 runs on the CPU too, so all of it is tested here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent_core.config import HFEngineConfig, PipelineConfig
from agent_core.io.checkpoints import load_policy
from agent_core.io.layout import RunLayout
from agent_core.rollout import engines
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine
from agent_core.rollout.inference_copy import InferenceCopy, cast_parameters, inference_dtype
from agent_core.run_resources import RunResources
from agent_core.training import resident
from agent_core.training.precision import autocast
from agent_core.training.scoring import score_logprobs
from test_device_placement import nothing_kept, policy_dir  # noqa: F401  (fixtures: a tiny saved policy, a clean resident store)
from test_resident_policy import _tables, _train

BF16 = EngineOptions(hf=HFEngineConfig(dtype="bfloat16"))


def _same_as_autocast_weights(copy: torch.nn.Module, trainer: torch.nn.Module) -> None:
    """Every parameter of the copy is the trainer's parameter rounded to bf16 (what autocast multiplies
    with); buffers (rotary frequencies) are the trainer's own, unrounded."""
    for (name, ours), theirs in zip(copy.named_parameters(), trainer.parameters()):
        assert ours.dtype == torch.bfloat16, name
        assert torch.equal(ours, theirs.detach().to(torch.bfloat16)), name
    for (name, ours), theirs in zip(copy.named_buffers(), trainer.buffers()):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name


def test_the_dtype_setting_resolves_by_device():
    assert inference_dtype("auto", torch.device("cpu")) == torch.float32
    assert inference_dtype("auto", torch.device("cuda")) == torch.bfloat16  # the trainer's autocast there
    assert inference_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        inference_dtype("float8", torch.device("cpu"))


def test_autocast_multiplies_with_exactly_the_copys_weights():
    """Why a bf16 copy is the right one: under bf16 autocast a Linear rounds its fp32 weight to bf16."""
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer_out = layer(x)
    copy = cast_parameters(torch.nn.Linear(16, 8), torch.bfloat16)
    copy.load_state_dict({k: v.to(torch.bfloat16) for k, v in layer.state_dict().items()})
    assert torch.equal(trainer_out, copy(x.to(torch.bfloat16)))


def test_a_refresh_copies_in_place_and_a_copy_in_use_is_never_overwritten(policy_dir):
    trainer, _ = load_policy(policy_dir)
    copies = InferenceCopy(torch.bfloat16)
    first = copies.refresh(trainer)
    _same_as_autocast_weights(first, trainer)
    assert copies.refresh(trainer) is None  # still in use by an engine
    copies.release()
    with torch.no_grad():  # an update
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    pointers = [p.data_ptr() for p in first.parameters()]
    second = copies.refresh(trainer)
    assert second is first and [p.data_ptr() for p in second.parameters()] == pointers  # no new allocation
    _same_as_autocast_weights(second, trainer)
    assert copies.refreshes == 2
    copies.close()
    assert copies.module is None


def test_the_engine_samples_from_a_copy_kept_in_step_with_the_trainer(tmp_path, policy_dir):
    """Through the run's resources, as a run does it: iteration 0 trains and offers its module, the rollout's
    engine samples from the bf16 copy; iteration 1 trains the same module, the next engine gets the same copy
    refreshed to the new weights; the trainer's module stays fp32 and is never lent."""
    run = RunLayout(tmp_path, "r1")
    for k in (0, 1):
        _tables(run, k, "grpo")
    with RunResources(PipelineConfig()) as resources:
        checkpoint = Path(_train(run, 0, policy_dir, "grpo", keep=True))
        trainer = resident.held(resident.POLICY).objects[0]
        engine = ENGINES.get("hf")(checkpoint, BF16)
        assert engine.model is not trainer and resident.lent() == 0  # the trainer's module is free to train
        _same_as_autocast_weights(engine.model, trainer)
        copy, prompt = engine.model, [[1, 5, 9, 13, 2]]
        generated = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1))[0]
        close_engine(engine)
        # the engine's log-probs are those of the weights the trainer's bf16 autocast uses (bf16 noise apart)
        with autocast(torch.device("cpu"), "bf16"):  # how the trainer computes them with precision bf16
            scored = score_logprobs(trainer, [prompt[0] + generated.token_ids], 0, 4096, 1.0, starts=[len(prompt[0])])
        assert scored[0][len(prompt[0]):] == pytest.approx(generated.logprobs, abs=0.05)

        checkpoint = Path(_train(run, 1, checkpoint, "grpo", keep=True))
        assert resident.held(resident.POLICY).objects[0] is trainer  # trained in place, fp32 throughout
        assert all(p.dtype == torch.float32 for p in trainer.parameters())
        engine = ENGINES.get("hf")(checkpoint, BF16)
        assert engine.model is copy  # the same copy, refreshed
        _same_as_autocast_weights(engine.model, trainer)
        close_engine(engine)
        assert len(resources._copies) == 1
    assert engines._lender is None and not resources._copies  # freed with the run


def test_without_a_lender_the_engine_loads_and_casts(policy_dir):
    engine = ENGINES.get("hf")(policy_dir, BF16)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    reference, _ = load_policy(policy_dir)
    _same_as_autocast_weights(engine.model, reference)
    close_engine(engine)
    fp32 = ENGINES.get("hf")(policy_dir, EngineOptions())  # auto on the CPU: float32
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
