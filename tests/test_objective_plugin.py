"""A training objective other than PPO, with a setting of its own, added from one plugin file that
touches no file of the project (issue 40), then trained with in a tiny run (`agentr1 train`): its
steps are the rows of train_metrics, its setting reaches it, and the checkpoint it saved is not the
policy it started from. A name nobody registered, or options that do not fit, fail at config load."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agent_core.config_errors import ConfigError
from agent_core.io.checkpoints import load_policy
from agent_core.io.tables import read_table
from agent_core.validation import build_config
from plugin_runs import train_tiny, write_plugin

PLUGIN = '''
import json
import time

import torch
from pydantic import BaseModel, ConfigDict, Field

from agent_core.training.objectives import TRAINING_OBJECTIVES
from agent_core.training.update_result import UpdateResult


class ImitateSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    steps: int = Field(1, ge=1, description="optimizer steps over all the sequences")
    record_to: str = Field(description="a file each call appends its settings to")


@TRAINING_OBJECTIVES.register("imitate", settings=ImitateSettings)
def imitate(policy, policy_optimizer, sequences, settings, *, options, pad_id, critic, critic_optimizer, scheduler,
            seed, dp):
    """Maximum likelihood of the policy's own action tokens, every episode alike (no advantages)."""
    with open(options.record_to, "a") as out:
        out.write(json.dumps(options.model_dump()) + "\\n")
    policy.train()
    results = []
    for _ in range(options.steps):
        started = time.perf_counter()
        policy_optimizer.zero_grad()
        total, tokens = 0.0, 0
        for sequence in sequences:
            ids = torch.tensor([sequence.input_ids])
            mask = torch.tensor(sequence.action_mask[1:], dtype=torch.float32)
            nll = torch.nn.functional.cross_entropy(policy(ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
            loss = (nll * mask).sum() / mask.sum().clamp(min=1) / len(sequences)
            loss.backward()
            total, tokens = total + loss.item(), tokens + int(mask.sum())
        policy_optimizer.step()
        results.append(UpdateResult(loss=total, pg_loss=total, vf_loss=float("nan"), entropy=0.0, kl=0.0,
                                    clipfrac=0.0, grad_norm=0.0, lr=policy_optimizer.param_groups[0]["lr"],
                                    tokens=tokens, tokens_per_s=0.0, seconds=time.perf_counter() - started,
                                    skipped=False, skip_reason=None))
    return results
'''


@pytest.fixture(autouse=True)
def my_objective(user_folder):
    """Every test here runs in the user's folder, beside the plugin (undone after it)."""
    write_plugin(user_folder, "my_objective", PLUGIN)


def test_a_training_objective_with_its_own_setting_trains_from_a_plugin_file(tmp_path):
    record = tmp_path / "objective_calls.jsonl"
    run = train_tiny(tmp_path / "data", "my_objective", "dev_eval.every=0", "warm_start.enabled=false",
                     "trainer.objective=imitate", "trainer.lr=0.01",
                     f"trainer.objective_options={{steps: 3, record_to: '{record}'}}")
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls == [{"steps": 3, "record_to": str(record)}]  # called once, with its own settings
    metrics = read_table("train_metrics", run.table_uri(0, "train_metrics")).to_pylist()
    losses = [m["loss"] for m in metrics]
    assert len(metrics) == 3 and all(math.isfinite(loss) for loss in losses)  # 3 = its setting, not trainer.mini_batches
    assert losses[-1] < losses[0]  # it learned its own objective: the same tokens got likelier
    before, _ = load_policy(run.initial_policy_dir)
    after, _ = load_policy(run.checkpoint_dir(0))
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


def test_an_unknown_objective_or_options_that_do_not_fit_are_refused_at_config_load():
    base = {"plugins": ["my_objective"], "warm_start": {"enabled": False}}
    with pytest.raises(ConfigError, match=r"trainer\.objective.*'imitat'.*imitate.*ppo"):
        build_config({**base, "trainer": {"objective": "imitat"}})
    with pytest.raises(ConfigError, match=r"trainer\.objective_options\.record_to.*'imitate'.*required"):
        build_config({**base, "trainer": {"objective": "imitate", "objective_options": {"steps": 2}}})
    with pytest.raises(ConfigError, match=r"trainer\.objective_options.*'ppo' takes no options.*'steps'"):
        build_config({**base, "trainer": {"objective_options": {"steps": 2}}})


def test_the_train_manifest_compares_the_objective_only_when_it_is_not_the_built_in():
    """Runs recorded before objectives were named resume without retraining; another objective reruns."""
    from agent_core.config import TrainerConfig
    from tasks.train import _result_settings

    cpu = torch.device("cpu")
    assert not {"objective", "objective_options"} & set(_result_settings(TrainerConfig(), cpu))
    named = _result_settings(TrainerConfig(objective="imitate", objective_options={"steps": 2}), cpu)
    assert (named["objective"], named["objective_options"]) == ("imitate", {"steps": 2})
