"""Placement (issue 30, items 1 and 3's precision): one `device` setting resolved by one function, every
model of a run loaded there, a CUDA device the machine lacks refused at config check in one line, and
the hf engine generating with the trainer's own module (one copy of the weights, no reload).

There is no GPU here: the CUDA paths are tested by their logic, with torch.cuda's two queries
(is_available, device_count) monkeypatched and the loaders recording the device they were asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import agent_core.training.iteration as iteration
import tasks.compute_advantages as compute_advantages
from agent_core.config import ConfigError, PipelineConfig, TrainerConfig
from agent_core.devices import DeviceError, resolve_device
from agent_core.io import background
from agent_core.io.checkpoints import load_policy, load_tokenizer, save_policy
from agent_core.io.layout import RunLayout
from agent_core.rollout import engines
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training import resident
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.precision import autocast, resolve_precision
from flows.cli import main as cli_main
from tasks.train import _result_settings
from test_resident_policy import _tables, _train

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture
def cuda(monkeypatch):
    """A machine that says it has `n` CUDA devices (nothing is ever put on them in these tests)."""
    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return have


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer(["<search>a</search> <answer>b</answer> the quick brown fox"], vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("policy") / "initial")


@pytest.fixture(autouse=True)
def nothing_kept():
    resident.forget()
    yield
    background.wait()
    resident.forget()


# ---- the setting and its resolution --------------------------------------------------------------


def test_auto_is_cuda_where_there_is_one_and_the_cpu_otherwise(cuda):
    cuda(0)
    assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
    cuda(2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")  # an explicit cpu stays on the CPU


def test_a_cuda_device_the_machine_lacks_is_one_line_naming_the_fix(cuda):
    cuda(0)
    with pytest.raises(DeviceError, match=r"device=cuda: this machine has no CUDA device.*set device: auto or cpu"):
        resolve_device("cuda")
    cuda(2)
    with pytest.raises(DeviceError, match=r"device=cuda:3: this machine has 2 CUDA device\(s\) \(cuda:0..cuda:1\)") as e:
        resolve_device("cuda:3")
    assert "\n" not in str(e.value)
    with pytest.raises(DeviceError, match="not a device"):
        resolve_device("gpu")


def test_the_config_key_defaults_to_auto_and_refuses_other_words():
    assert PipelineConfig().device == "auto"
    assert "device" in PipelineConfig.model_fields and PipelineConfig.model_fields["device"].description
    from agent_core.config import parse_config
    with pytest.raises(ConfigError, match="device"):
        parse_config({"device": "gpu0"})


def test_precision_auto_is_bf16_on_cuda_and_todays_fp32_on_the_cpu():
    assert TrainerConfig().precision == "auto"
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("auto", "cuda") == "bf16"
    for explicit in ("fp32", "bf16"):
        assert resolve_precision(explicit, torch.device("cpu")) == resolve_precision(explicit, "cuda") == explicit
    with pytest.raises(ValueError, match="choose one of fp32, bf16"):
        resolve_precision("fp16", "cpu")
    with autocast(torch.device("cpu"), "auto"):  # auto on the CPU: no autocast, as fp32 always was
        assert not torch.is_autocast_enabled("cpu")


def test_the_train_manifest_records_the_precision_used_so_old_cpu_runs_still_resume():
    """Runs recorded before "auto" existed stored precision fp32: on the CPU the default compares equal."""
    assert _result_settings(TrainerConfig(), torch.device("cpu"))["precision"] == "fp32"
    assert _result_settings(TrainerConfig(), torch.device("cuda"))["precision"] == "bf16"
    assert _result_settings(TrainerConfig(precision="fp32"), torch.device("cuda"))["precision"] == "fp32"


# ---- config check through the command line -------------------------------------------------------


@pytest.mark.parametrize("setting, gpus, expected", [
    ("cuda", 0, "this machine has no CUDA device"),
    ("cuda:3", 1, "this machine has 1 CUDA device(s)"),
])
def test_asking_for_a_missing_cuda_device_fails_before_anything_starts(tmp_path, capsys, no_server, cuda, setting,
                                                                      gpus, expected):
    cuda(gpus)
    root = tmp_path / "data"
    assert cli_main(["train", "--config", "tiny", "--data-root", str(root), "--set", f"device={setting}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentr1: error: "), lines
    assert f"device={setting}" in lines[0] and expected in lines[0] and "Traceback" not in lines[0]
    assert not root.exists()


# ---- every model of a run is loaded on the run's device -------------------------------------------


class _Loaded(Exception):
    """Raised by a recording loader once it has seen the device it was asked for."""


def _recording_loader(seen: list):
    def load(directory, *args, device=None, **kwargs):
        seen.append(torch.device(device) if device is not None else None)
        raise _Loaded
    return load


def test_with_cuda_available_auto_puts_the_engine_the_trainer_and_the_reference_on_it(tmp_path, policy_dir,
                                                                                    monkeypatch, cuda):
    seen: list = []
    cuda(1)
    monkeypatch.setattr(engines, "load_policy", _recording_loader(seen))
    monkeypatch.setattr(iteration, "load_policy", _recording_loader(seen))
    monkeypatch.setattr(compute_advantages, "load_policy", _recording_loader(seen))
    with pytest.raises(_Loaded):
        ENGINES.get("hf")(policy_dir, EngineOptions())  # device auto
    run = RunLayout(tmp_path, "r1")
    _tables(run, 0, "grpo")
    with pytest.raises(_Loaded):
        iteration.run_training(iteration.TrainJob(
            iteration=0, steps_uri=run.table_uri(0, "steps"), advantages_uri=run.table_uri(0, "advantages"),
            policy_dir=str(policy_dir), checkpoint_dir=str(tmp_path / "ckpt"), optimizer_in=None,
            optimizer_out=str(tmp_path / "opt.pt"), settings=iteration.PPOSettings(),
            optimization=iteration.Optimization(1e-3, 0.0, 1e-4, "constant", 0, 1), layout="auto",
            max_consecutive_nonfinite=3, carried_nonfinite=0))
    with pytest.raises(_Loaded):
        compute_advantages._reference_logprobs(run, [], 64, 1.0, device=resolve_device("auto"),
                                               policy_dir=str(policy_dir))
    assert seen == [torch.device("cuda")] * 3
    cuda(0)
    seen.clear()
    with pytest.raises(_Loaded):
        ENGINES.get("hf")(policy_dir, EngineOptions(device="auto"))
    assert seen == [torch.device("cpu")]  # no CUDA: today's placement


# ---- one module for the trainer and the engine ---------------------------------------------------


def _prompts(policy: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(policy)
    return [tokenizer.encode(text) for text in ("the quick brown", "<search>a</search>", "fox <answer>")]


def test_the_hf_engine_generates_with_the_trainers_own_module(tmp_path, policy_dir, monkeypatch):
    run = RunLayout(tmp_path, "r1")
    for k in (0, 1):
        _tables(run, k, "grpo")
    checkpoint = Path(_train(run, 0, policy_dir, "grpo", keep=True))
    model = resident.held(resident.POLICY).objects[0]
    modes = resident.training_modes(model)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    engine_loads: list = []
    monkeypatch.setattr(engines, "load_policy", lambda *a, **k: engine_loads.append(a) or load_policy(*a, **k))

    with engines.lending(resident.lend):
        engine = ENGINES.get("hf")(checkpoint, EngineOptions())
        assert engine_loads == [] and resident.lent() == 1
        assert [p.data_ptr() for p in engine.model.parameters()] == [p.data_ptr() for p in model.parameters()]
        shared = engine.generate(_prompts(checkpoint), GREEDY)
        close_engine(engine)
    assert resident.lent() == 0
    # generating left the trainer's module as it was: modes, gradients
    assert resident.training_modes(model) == modes
    for before, p in zip(grads, model.parameters()):
        assert (before is None and p.grad is None) or torch.equal(before, p.grad)

    reloaded = HFEngine(*load_policy(checkpoint)).generate(_prompts(checkpoint), GREEDY)
    assert [g.token_ids for g in shared] == [g.token_ids for g in reloaded]
    for a, b in zip(shared, reloaded):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)

    # the next iteration trains that very module: no reload, the engine's storage
    trainer_loads: list = []
    monkeypatch.setattr(iteration, "load_policy", lambda *a, **k: trainer_loads.append(a) or load_policy(*a, **k))
    _train(run, 1, checkpoint, "grpo", keep=True)
    assert trainer_loads == [] and resident.held(resident.POLICY).objects[0] is model


def test_without_a_lender_the_engine_loads_its_own_copy(tmp_path, policy_dir):
    run = RunLayout(tmp_path, "r1")
    _tables(run, 0, "grpo")
    checkpoint = Path(_train(run, 0, policy_dir, "grpo", keep=True))
    model = resident.held(resident.POLICY).objects[0]
    engine = ENGINES.get("hf")(checkpoint, EngineOptions())
    assert engine.model is not model and resident.lent() == 0
    close_engine(engine)


def test_a_lent_module_is_never_trained_and_a_taken_one_never_lent(tmp_path, policy_dir, monkeypatch):
    """A rollout overlapping training (runtime.max_staleness >= 1): whichever comes first keeps the
    module, the other loads the checkpoint; nothing is trained while an engine generates with it."""
    run = RunLayout(tmp_path, "r1")
    for k in (0, 1, 2):
        _tables(run, k, "grpo")
    checkpoint = Path(_train(run, 0, policy_dir, "grpo", keep=True))
    lease = resident.lend(checkpoint, torch.device("cpu"))
    assert lease is not None
    before = [p.detach().clone() for p in lease.model.parameters()]
    loads: list = []
    monkeypatch.setattr(iteration, "load_policy", lambda *a, **k: loads.append(a) or load_policy(*a, **k))
    second = Path(_train(run, 1, checkpoint, "grpo", keep=True))
    assert len(loads) == 1  # the trainer read the files: the kept module was lent
    assert all(torch.equal(a, p) for a, p in zip(before, lease.model.parameters()))
    lease.release()
    assert resident.lent() == 0
    assert resident.lend(second, torch.device("meta")) is None  # another device: the engine loads its own
    kept = resident.held(resident.POLICY)
    assert resident.take(resident.POLICY, kept.paths, kept.settings) is not None
    assert resident.lend(second) is None  # taken for training: never lent after


def test_a_rewritten_checkpoint_is_not_lent(tmp_path, policy_dir):
    run = RunLayout(tmp_path, "r1")
    _tables(run, 0, "grpo")
    checkpoint = Path(_train(run, 0, policy_dir, "grpo", keep=True))
    model, tokenizer, _ = resident.held(resident.POLICY).objects
    save_policy(model, tokenizer, checkpoint)  # same weights, new files: the stamp no longer matches
    assert resident.lend(checkpoint) is None
