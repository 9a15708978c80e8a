"""The policy, critic and optimizers kept in memory between iterations (runtime.keep_policy_in_memory,
agent_core/training/resident.py): the same parameters and optimizer state as reloading the files
every iteration, no reload where the previous iteration saved the inputs, and a reload whenever the
files, the settings or a failure say the kept objects may differ. Tiny real Llamas on real tables."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import agent_core.training.iteration as iteration
import agent_core.training.trainer as trainer_module
from agent_core.config import AlgorithmConfig, RuntimeConfig, TrainerConfig
from agent_core.io import background
from agent_core.io.checkpoints import load_policy, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.tables import write_table
from agent_core.training import resident
from agent_core.training.critic import load_critic
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.safety import NonFiniteTrainingError
from tasks.train import train_policy
from test_schemas import steps_rows

ESTIMATORS = ["grpo", "gae"]  # without and with a critic


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer(["<search>a</search> <answer>b</answer> the quick brown fox"], vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("policy") / "initial")


@pytest.fixture(autouse=True)
def nothing_kept():
    resident.forget()
    yield
    resident.forget()


@pytest.fixture()
def loads(monkeypatch) -> dict[str, int]:
    """How often run_training read a policy or a critic from disk."""
    counts = {"policy": 0, "critic": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(iteration, "load_policy", counted("policy", iteration.load_policy))
    monkeypatch.setattr(iteration, "load_critic", counted("critic", iteration.load_critic))
    return counts


def _tables(run: RunLayout, k: int, estimator: str) -> None:
    """Iteration k's steps (2 episodes x 3 steps, on-policy) and advantages with values and returns."""
    steps = [{**row, "iteration": k, "policy_version": k} for row in steps_rows()]
    write_table("steps", steps, run.table_uri(k, "steps"))
    sign = 1.0 if k % 2 == 0 else -0.5  # the two iterations pull different ways
    write_table("advantages", [
        {"run_id": "r1", "iteration": k, "episode_id": s["episode_id"], "step_idx": s["step_idx"],
         "advantages": [sign, sign] if s["episode_id"] == "ep-0" else [-sign, -sign], "returns": [1.0, 0.5],
         "values": [0.1, 0.2], "ref_logprobs": None, "obs_advantages": None, "obs_returns": None,
         "obs_values": None, "estimator": estimator} for s in steps], run.table_uri(k, "advantages"))


def _train(run: RunLayout, k: int, policy: Path, estimator: str, keep: bool, settle: bool = True,
           background_save: bool = True, **trainer) -> str:
    """The train stage of iteration k; with `settle`, also its background writes (runtime.background_save)."""
    cfg = TrainerConfig(**{"micro_batch_tokens": 64, "mini_batches": 2, "epochs": 1, "lr": 1e-2, **trainer})
    runtime = RuntimeConfig(keep_policy_in_memory=keep, background_save=background_save)
    checkpoint = train_policy.fn(run, k, run.table_uri(k, "steps"), run.table_uri(k, "advantages"), str(policy), cfg,
                                 AlgorithmConfig(estimator=estimator), 1.0, runtime=runtime)
    if settle:
        background.wait()
    return checkpoint


def _two_iterations(root: Path, policy: Path, estimator: str, keep: bool) -> RunLayout:
    run = RunLayout(root, "r1")
    for k in (0, 1):
        _tables(run, k, estimator)
    first = _train(run, 0, policy, estimator, keep)
    _train(run, 1, Path(first), estimator, keep)
    return run


def _assert_same(a, b, where: str = "") -> None:
    """Equal nested state: tensors bit for bit (values, dtype, shape), everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def _outputs(run: RunLayout, k: int, critic: bool) -> dict:
    out = {"policy": load_file(str(run.checkpoint_dir(k) / "model.safetensors")),
           "optimizer": torch.load(run.optimizer_state_path(k), weights_only=True)}
    if critic:
        out["critic"] = load_critic(run.critic_dir(k)).state_dict()
        out["critic_optimizer"] = torch.load(run.critic_optimizer_state_path(k), weights_only=True)
    return out


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kept_objects_train_exactly_like_ones_reloaded_from_the_checkpoint(tmp_path, policy_dir, estimator, loads):
    uses_critic = estimator == "gae"
    reloaded = _two_iterations(tmp_path / "off", policy_dir, estimator, keep=False)
    assert loads == {"policy": 2, "critic": 1 if uses_critic else 0}  # iteration 0's critic is built, not loaded
    kept = _two_iterations(tmp_path / "on", policy_dir, estimator, keep=True)
    assert loads == {"policy": 3, "critic": 1 if uses_critic else 0}  # iteration 1 read nothing back
    for k in (0, 1):
        _assert_same(_outputs(reloaded, k, uses_critic), _outputs(kept, k, uses_critic), f"iteration {k}")
    before = _outputs(kept, 0, uses_critic)["policy"]
    assert any(not torch.equal(before[n], t) for n, t in _outputs(kept, 1, uses_critic)["policy"].items())


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_what_is_kept_is_what_a_reload_of_the_saved_files_gives(tmp_path, policy_dir, estimator):
    """dtype, values, optimizer state and train/eval modes: the cache must hold what the files hold."""
    run = _two_iterations(tmp_path, policy_dir, estimator, keep=True)
    model, tokenizer, optimizer = resident.held(resident.POLICY).objects
    loaded, _ = load_policy(run.checkpoint_dir(1))
    _assert_same(dict(loaded.state_dict()), dict(model.state_dict()))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert resident.training_modes(model) == resident.training_modes(loaded)
    _assert_same(torch.load(run.optimizer_state_path(1), weights_only=True), optimizer.state_dict())
    if estimator == "gae":
        critic, critic_optimizer = resident.held(resident.CRITIC).objects
        from_disk = load_critic(run.critic_dir(1))
        _assert_same(dict(from_disk.state_dict()), dict(critic.state_dict()))
        assert resident.training_modes(critic) == resident.training_modes(from_disk)
        _assert_same(torch.load(run.critic_optimizer_state_path(1), weights_only=True), critic_optimizer.state_dict())
    else:
        assert resident.held(resident.CRITIC) is None


def test_with_the_switch_off_nothing_is_kept(tmp_path, policy_dir):
    run = RunLayout(tmp_path, "r1")
    _tables(run, 0, "grpo")
    _train(run, 0, policy_dir, "grpo", keep=True)
    assert resident.held(resident.POLICY) is not None
    _train(run, 0, policy_dir, "grpo", keep=False, lr=2e-2)  # another setting: the stage reruns
    assert resident.held(resident.POLICY) is None


def _rewrite_checkpoint(run: RunLayout) -> None:
    model, tokenizer = load_policy(run.checkpoint_dir(0))
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    save_policy(model, tokenizer, run.checkpoint_dir(0))


def _rewrite_optimizer(run: RunLayout) -> None:
    path = run.optimizer_state_path(0)
    path.write_bytes(path.read_bytes())  # same bytes, a new file: it may have been anything


def _poisoning(train_iteration):
    """train_iteration that trains, then leaves a nan in the policy (the iteration then raises)."""
    def poisoned(model, *args, **kwargs):
        results = train_iteration(model, *args, **kwargs)
        with torch.no_grad():
            model.model.norm.weight[0] = float("nan")
        return results
    return poisoned


@pytest.mark.parametrize("change", ["checkpoint", "optimizer state", "lr", "a failed iteration"])
def test_a_changed_input_or_setting_or_a_failure_reloads_from_disk(tmp_path, policy_dir, loads, monkeypatch, change):
    run = RunLayout(tmp_path / "on", "r1")
    for k in (0, 1):
        _tables(run, k, "grpo")
    first = Path(_train(run, 0, policy_dir, "grpo", keep=True))
    settings = {}
    if change == "checkpoint":
        _rewrite_checkpoint(run)
    elif change == "optimizer state":
        _rewrite_optimizer(run)
    elif change == "lr":
        settings = {"lr": 2e-2}
    else:  # the kept model is changed in place, then refused: it must not be used again
        with monkeypatch.context() as patch:
            patch.setattr(trainer_module, "train_iteration", _poisoning(trainer_module.train_iteration))  # the "ppo" objective's
            with pytest.raises(NonFiniteTrainingError, match="non-finite parameters"):
                _train(run, 1, first, "grpo", keep=True)
        assert resident.held(resident.POLICY) is None
    assert loads["policy"] == 1
    _train(run, 1, first, "grpo", keep=True, **settings)
    assert loads["policy"] == 2

    # the same iteration 1 from the files as they are now, with nothing kept
    reference = RunLayout(tmp_path / "off", "r1")
    _tables(reference, 1, "grpo")
    reference.optimizer_state_path(0).parent.mkdir(parents=True)
    reference.optimizer_state_path(0).write_bytes(run.optimizer_state_path(0).read_bytes())
    resident.forget()
    _train(reference, 1, first, "grpo", keep=False, **settings)
    _assert_same(_outputs(reference, 1, False), _outputs(run, 1, False))


def test_a_job_whose_inputs_are_not_the_kept_files_loads_them(tmp_path, policy_dir, loads):
    run = RunLayout(tmp_path, "r1")
    _tables(run, 0, "grpo")
    _train(run, 0, policy_dir, "grpo", keep=True)
    other = RunLayout(tmp_path, "r2")
    _tables(other, 0, "grpo")
    _train(other, 0, policy_dir, "grpo", keep=True)  # iteration 0: no optimizer state to match
    assert loads["policy"] == 2
    assert resident.held(resident.POLICY).paths[0] == str(other.checkpoint_dir(0).resolve())
