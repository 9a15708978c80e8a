"""LoRA training of the policy (policy.lora, issue 30 item 4; agent_core/training/lora.py and
agent_core/io/lora_checkpoints.py): only the adapter trains, the reference is the same module with
the adapter disabled and equals a separately loaded base, a checkpoint is the adapter plus the
base's path and reloads to the same log-probs (also after the data root moves), the train stage
writes and continues such checkpoints, and the registered MLflow model loads and generates.
Tiny real Llamas, a few seconds in all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent_core.config import AlgorithmConfig, PolicyConfig, PolicyLoraConfig, RuntimeConfig, TrainerConfig
from agent_core.io import background
from agent_core.io.checkpoints import CheckpointError, check_checkpoint, load_policy, load_tokenizer, save_policy
from agent_core.io.layout import RunLayout
from agent_core.io.lora_checkpoints import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE, is_lora_checkpoint, lora_base_dir, save_lora_policy,
)
from agent_core.io.tables import write_table
from agent_core.training import resident
from agent_core.training.lora import (
    adapter_disabled, has_lora, inject_lora, lora_reference_module, reference_policy, trainable_parameter_count,
)
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.training.scoring import score_logprobs
from agent_core.training.trainer import make_optimizer
from tasks.train import train_policy
from test_schemas import steps_rows

LORA = PolicyLoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
SEQUENCES = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 6, 8, 10], [30, 31, 32, 33, 34, 35, 36, 37]]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer(["<search>a</search> <answer>b</answer> the quick brown fox"], vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return save_policy(model, tokenizer, tmp_path_factory.mktemp("lora") / "run" / "initial_policy")


@pytest.fixture(autouse=True)
def nothing_kept():
    resident.forget()
    yield
    background.wait()
    resident.forget()


def logprobs(model, pad_id: int = 0) -> list[list[float]]:
    return score_logprobs(model, SEQUENCES, pad_id, max_tokens=256, temperature=1.0, starts=[2, 2, 3])


def close(a: list[list[float]], b: list[list[float]], tol: float = 1e-6) -> bool:
    return all(len(x) == len(y) and all(abs(u - v) <= tol for u, v in zip(x, y)) for x, y in zip(a, b))


def adapted(base_dir: Path, steps: int = 3):
    """The base with a fresh adapter, trained a few AdamW steps so its B matrices are not zero."""
    model, tokenizer = load_policy(base_dir)
    inject_lora(model, LORA, base_dir)
    optimizer = make_optimizer(model, lr=5e-2)
    ids = torch.tensor([SEQUENCES[0]])
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, tokenizer, optimizer


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(base_dir):
    model, _ = load_policy(base_dir)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters())
    inject_lora(model, LORA, base_dir)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    # 2 layers x (q, v) x (A: 4 x 32 + B: 32 x 4)
    assert trainable_parameter_count(model) == 2 * 2 * (4 * 32 + 32 * 4) < total / 20
    model, _, optimizer = adapted(base_dir)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad} and optimizer.defaults["fused"]
    after = dict(model.named_parameters())
    for name, value in before.items():  # the base weights, now under `base_layer` where an adapter sits
        moved = after.get(name, after.get(name.replace(".weight", ".base_layer.weight")))
        assert torch.equal(moved, value), name
    assert any(p.abs().sum() > 0 for n, p in after.items() if ".lora_B." in n)  # B started at 0 and moved


def test_a_fresh_adapter_changes_nothing_and_bad_targets_fail_in_one_line(base_dir):
    plain, _ = load_policy(base_dir)
    model, _ = load_policy(base_dir)
    inject_lora(model, LORA, base_dir)
    assert logprobs(model) == logprobs(plain)
    with pytest.raises(ValueError, match="policy.lora.target_modules") as error:
        inject_lora(load_policy(base_dir)[0], PolicyLoraConfig(target_modules=("no_such_proj",)), base_dir)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="already carries"):
        inject_lora(model, LORA, base_dir)
    again, _ = load_policy(base_dir)  # data-parallel workers each inject one: the same adapter everywhere
    torch.manual_seed(123)
    inject_lora(again, LORA, base_dir)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))


def test_reference_with_the_adapter_disabled_equals_the_base_model_after_training(base_dir):
    base, _ = load_policy(base_dir)  # a separately loaded base: the reference the stage used to load
    model, _, _ = adapted(base_dir)
    trained = logprobs(model)
    assert not close(trained, logprobs(base), tol=1e-3)  # the adapter changed the policy
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    with adapter_disabled(model) as reference:
        assert reference is model
        assert close(logprobs(reference), logprobs(base))
    assert logprobs(model) == trained  # enabled again, exactly as before
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    with adapter_disabled(base) as same:  # no adapter: nothing to disable
        assert same is base


def test_a_checkpoint_is_the_adapter_and_the_base_path_and_reloads_the_same(base_dir, tmp_path):
    model, tokenizer, _ = adapted(base_dir)
    checkpoint = save_lora_policy(model, tokenizer, base_dir.parent / "iteration=0" / "checkpoint")
    names = sorted(p.name for p in checkpoint.iterdir())
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE} <= set(names) and not any(
        n.startswith("model") or n == "config.json" for n in names), names
    weights = load_file(str(checkpoint / ADAPTER_WEIGHTS))
    assert all(k.startswith("base_model.model.model.layers.") and (".lora_A.weight" in k or ".lora_B.weight" in k)
               for k in weights)  # peft's saved names: what PeftModel and vLLM's LoRA loader read
    assert (checkpoint / ADAPTER_WEIGHTS).stat().st_size < (base_dir / "model.safetensors").stat().st_size / 10
    config = json.loads((checkpoint / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, ["q_proj", "v_proj"])
    assert json.loads((checkpoint / BASE_FILE).read_text())["relative"] == "../../initial_policy"
    assert is_lora_checkpoint(checkpoint) and check_checkpoint(checkpoint) == checkpoint

    reloaded, reloaded_tokenizer = load_policy(checkpoint)
    assert has_lora(reloaded) and reloaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert logprobs(reloaded) == logprobs(model)
    assert trainable_parameter_count(reloaded) == trainable_parameter_count(model)
    assert load_tokenizer(checkpoint).get_vocab() == tokenizer.get_vocab()

    moved = tmp_path / "moved-run"  # the whole run folder moves: the relative base path still holds
    shutil.copytree(base_dir.parent, moved)
    assert lora_base_dir(moved / "iteration=0" / "checkpoint") == moved / "initial_policy"
    assert logprobs(load_policy(moved / "iteration=0" / "checkpoint")[0]) == logprobs(model)
    alone = tmp_path / "alone"  # the adapter copied out alone: its base is where it was saved
    shutil.copytree(checkpoint, alone)
    assert lora_base_dir(alone) == base_dir.resolve()
    shutil.rmtree(moved / "initial_policy")
    (moved / "iteration=0" / "checkpoint" / BASE_FILE).write_text(json.dumps(
        {"format": 1, "relative": "../../initial_policy", "absolute": str(tmp_path / "gone")}))
    with pytest.raises(CheckpointError, match="base model is at none of") as error:
        check_checkpoint(moved / "iteration=0" / "checkpoint")
    assert "\n" not in str(error.value)


def test_the_reference_is_the_kept_module_with_its_adapter_off(base_dir):
    model, tokenizer, optimizer = adapted(base_dir)
    checkpoint = save_lora_policy(model, tokenizer, base_dir.parent / "iteration=1" / "checkpoint")
    loads = []

    def load(directory):
        loads.append(directory)
        return load_policy(directory)

    with reference_policy(base_dir, checkpoint, load) as (reference, _):  # nothing kept: the base is loaded
        expected = logprobs(reference)
    assert loads == [base_dir]
    resident.keep(resident.POLICY, (checkpoint, base_dir / "config.json"), (1e-3, 0.0), (model, tokenizer, optimizer))
    assert lora_reference_module(checkpoint, base_dir)[0] is model
    trained = logprobs(model)
    with reference_policy(base_dir, checkpoint, load) as (reference, _):
        assert reference is model and close(logprobs(reference), expected)
    assert loads == [base_dir] and logprobs(model) == trained  # no second model; the adapter is back on
    assert resident.held(resident.POLICY) is not None  # still there for the next training
    assert lora_reference_module(base_dir, base_dir) is None  # a full policy: the reference is loaded
    other = save_policy(*load_policy(base_dir), base_dir.parent / "other_base")
    assert lora_reference_module(checkpoint, other) is None  # an adapter on another base than the reference


def _tables(run: RunLayout, k: int) -> None:
    steps = [{**row, "iteration": k, "policy_version": k} for row in steps_rows()]
    write_table("steps", steps, run.table_uri(k, "steps"))
    write_table("advantages", [
        {"run_id": "r1", "iteration": k, "episode_id": s["episode_id"], "step_idx": s["step_idx"],
         "advantages": [1.0, 1.0] if s["episode_id"] == "ep-0" else [-1.0, -1.0], "returns": [1.0, 0.5],
         "values": [0.1, 0.2],
         "ref_logprobs": None, "obs_advantages": None, "obs_returns": None, "obs_values": None,
         "estimator": "grpo"} for s in steps], run.table_uri(k, "advantages"))


@pytest.mark.parametrize("keep", [False, True])
def test_the_train_stage_writes_adapter_checkpoints_and_continues_them(base_dir, tmp_path, keep):
    run = RunLayout(tmp_path, "r1")
    shutil.copytree(base_dir, run.initial_policy_dir)
    cfg = TrainerConfig(micro_batch_tokens=64, mini_batches=2, epochs=1, lr=1e-2)
    policy = str(run.initial_policy_dir)
    for k in range(2):
        _tables(run, k)
        policy = train_policy.fn(run, k, run.table_uri(k, "steps"), run.table_uri(k, "advantages"), policy, cfg,
                                 AlgorithmConfig(estimator="grpo"), 1.0, lora=LORA,
                                 runtime=RuntimeConfig(keep_policy_in_memory=keep))
        background.wait()
        assert is_lora_checkpoint(policy) and lora_base_dir(policy) == run.initial_policy_dir.resolve()
    first, second = (load_file(str(run.checkpoint_dir(k) / ADAPTER_WEIGHTS)) for k in (0, 1))
    assert first.keys() == second.keys() and any(not torch.equal(first[n], second[n]) for n in first)
    state = torch.load(run.optimizer_state_path(1), weights_only=True)["state"]
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(t.numel() for t in second.values())
    final, _ = load_policy(Path(policy))
    initial, _ = load_policy(run.initial_policy_dir)
    with adapter_disabled(final):
        assert close(logprobs(final), logprobs(initial))  # the base never moved
    assert not close(logprobs(final), logprobs(initial), tol=1e-4)


def test_policy_lora_is_off_by_default_and_leaves_the_initial_policy_manifest_alone():
    assert PolicyConfig().lora is None
    assert "lora" not in PolicyConfig(lora=LORA).model_dump(mode="json", exclude={"lora"})
    with pytest.raises(ValueError):
        PolicyLoraConfig(rank=0)


def test_a_lora_checkpoint_registers_as_the_merged_model_which_loads_and_generates(base_dir, tmp_path):
    """What Tracker.register_checkpoint logs (save_policy_model), loaded as MLflow serves it; the
    registry round trip itself is tests/test_model_registry.py's (the same function)."""
    import mlflow.pyfunc

    from agent_core.io.model_registry import model_checkpoint_dir, save_policy_model

    model, tokenizer, _ = adapted(base_dir)
    checkpoint = save_lora_policy(model, tokenizer, tmp_path / "run" / "iteration=0" / "checkpoint")
    saved = save_policy_model(checkpoint, tmp_path / "model")
    shipped = model_checkpoint_dir(saved)
    assert (shipped / "config.json").is_file() and not is_lora_checkpoint(shipped)  # full weights: no base needed
    merged, _ = load_policy(shipped)
    assert not has_lora(merged) and close(logprobs(merged), logprobs(model), tol=1e-5)
    pyfunc = mlflow.pyfunc.load_model(str(saved))
    outputs = pyfunc.predict(["the quick", [{"role": "user", "content": "brown fox"}]], params={"max_new_tokens": 5})
    assert len(outputs) == 2 and all(isinstance(text, str) and text for text in outputs)


def test_the_advantages_stage_of_a_lora_run_scores_the_reference_on_the_kept_module(base_dir, tmp_path, monkeypatch):
    import tasks.compute_advantages as stage
    from agent_core.io.tables import read_table
    from test_schemas import rewards_rows

    run = RunLayout(tmp_path, "r1")
    shutil.copytree(base_dir, run.initial_policy_dir)
    _tables(run, 0)
    cfg = TrainerConfig(micro_batch_tokens=64, mini_batches=1, epochs=1, lr=5e-2)  # keeps the policy in memory
    train_policy.fn(run, 0, run.table_uri(0, "steps"), run.table_uri(0, "advantages"), str(run.initial_policy_dir),
                    cfg, AlgorithmConfig(estimator="grpo"), 1.0, lora=LORA)
    steps = [{**row, "iteration": 1, "policy_version": 1} for row in steps_rows()]
    write_table("steps", steps, run.table_uri(1, "steps"))
    write_table("rewards", [{**row, "iteration": 1} for row in rewards_rows()], run.table_uri(1, "rewards"))
    loads = []
    monkeypatch.setattr(stage, "load_policy", lambda *a, **k: loads.append(a) or load_policy(*a, **k))
    uri = stage.compute_advantages.fn(run, 1, run.table_uri(1, "steps"), run.table_uri(1, "rewards"),
                                      AlgorithmConfig(estimator="grpo", kl_coef=0.1), cfg)
    assert loads == []  # the reference came from the kept module, not from disk
    stored = read_table("advantages", uri).to_pylist()
    base, _ = load_policy(run.initial_policy_dir)
    expected = score_logprobs(base, [s["prompt_ids"] + s["response_ids"] for s in steps], 0, 256, 1.0,
                              starts=[len(s["prompt_ids"]) for s in steps])
    by_step = {(s["episode_id"], s["step_idx"]): e[len(s["prompt_ids"]):] for s, e in zip(steps, expected)}
    assert close([r["ref_logprobs"] for r in stored], [by_step[r["episode_id"], r["step_idx"]] for r in stored], 1e-5)
    kept = resident.held(resident.POLICY).objects[0]
    assert not close(logprobs(kept), logprobs(base), tol=1e-4)  # the kept policy is adapted, and enabled again
