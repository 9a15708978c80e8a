"""An engine, an advantage estimator with a setting of its own and a policy loss with a setting of
its own, added from one plugin file that touches no file of the project (issue 40), then trained
with in a tiny run (`agentr1 train`): the estimator's setting shows in the advantages table, the
loss's in what it recorded, the engine's replies in the steps table. Options that do not fit a
settings model, or are given to an item without one, are refused at config load."""

from __future__ import annotations

import json
import math

import pytest

from agent_core.algos.estimator_core import ADVANTAGE_ESTIMATORS
from agent_core.config_errors import ConfigError
from agent_core.io.tables import read_table
from agent_core.validation import build_config
from plugin_runs import train_tiny, write_plugin

PLUGIN = '''
import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from agent_core.algos.estimator_core import ADVANTAGE_ESTIMATORS, AdvantageOutput
from agent_core.algos.losses import POLICY_LOSSES, ppo_clip_loss
from agent_core.io.checkpoints import load_tokenizer
from agent_core.rollout.engine import Generation
from agent_core.rollout.engines import ENGINES, EngineTraits


class FixedReply:
    """Answers every context with the same text, log-prob -1 per token."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode("<answer>Paris</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]

    def generate(self, prompts, params):
        return [Generation(list(self.ids), [-1.0] * len(self.ids), "stop") for _ in prompts]


@ENGINES.register("fixed_reply")
def fixed_reply(policy_dir, options):
    return FixedReply(load_tokenizer(Path(policy_dir)))


@ENGINES.register("needs_runtime", traits=EngineTraits(concurrent_calls=lambda options: 3,
                                                       unavailable=lambda rollout: "the x runtime is not installed"))
def needs_runtime(policy_dir, options):
    raise RuntimeError("never built on this machine")


class ConstantSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    value: float = Field(0.5, description="the advantage of every action token")


@ADVANTAGE_ESTIMATORS.register("constant", settings=ConstantSettings)
def constant(inputs):
    mask = inputs.mask.to(torch.float32)
    return AdvantageOutput(inputs.options.value * mask, torch.zeros_like(mask))


class ScaledSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    scale: float = Field(1.0, gt=0, description="multiplies ppo_clip's loss")
    record_to: str = Field(description="a file each call appends its settings to")


@POLICY_LOSSES.register("scaled_ppo", settings=ScaledSettings)
def scaled_ppo(logprobs, old_logprobs, advantages, loss_mask, *, options, **kwargs):
    with open(options.record_to, "a") as out:
        out.write(json.dumps(options.model_dump()) + "\\n")
    output = ppo_clip_loss(logprobs, old_logprobs, advantages, loss_mask, **kwargs)
    return type(output)(options.scale * output.loss, output.clipfrac, output.approx_kl)
'''


@pytest.fixture()
def plugin(user_folder):
    return write_plugin(user_folder, "my_algorithms", PLUGIN)


def test_an_engine_estimator_and_loss_with_their_own_settings_train_from_a_plugin_file(plugin, tmp_path):
    record = tmp_path / "loss_calls.jsonl"
    run = train_tiny(tmp_path / "data", "my_algorithms", "dev_eval.every=0", "rollout.engine=fixed_reply",
                     "algorithm.estimator=constant", "algorithm.estimator_options={value: 0.25}",
                     "trainer.policy_loss=scaled_ppo", f"trainer.policy_loss_options={{scale: 3.0, record_to: '{record}'}}")
    steps = read_table("steps", run.table_uri(0, "steps")).to_pylist()
    assert steps and {s["response_text"] for s in steps} == {"<answer>Paris</answer>"}  # the plugin's engine
    advantages = read_table("advantages", run.table_uri(0, "advantages")).to_pylist()
    values = {round(a, 6) for row in advantages for a in row["advantages"]}
    assert values == {0.25} and {row["estimator"] for row in advantages} == {"constant"}  # its setting, not 0.5
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls and all(call == {"scale": 3.0, "record_to": str(record)} for call in calls)
    metrics = read_table("train_metrics", run.table_uri(0, "train_metrics")).to_pylist()
    assert metrics and all(math.isfinite(m["loss"]) and not m["skipped"] for m in metrics)


def test_options_that_do_not_fit_the_settings_model_are_refused_at_config_load(plugin):
    base = {"plugins": ["my_algorithms"], "warm_start": {"enabled": False}}
    with pytest.raises(ConfigError, match=r"algorithm\.estimator_options\.value.*'constant'.*valid number"):
        build_config({**base, "algorithm": {"estimator": "constant", "estimator_options": {"value": "high"}}})
    with pytest.raises(ConfigError, match=r"algorithm\.estimator_options\.valu\b.*Extra inputs"):
        build_config({**base, "algorithm": {"estimator": "constant", "estimator_options": {"valu": 1.0}}})
    with pytest.raises(ConfigError, match=r"trainer\.policy_loss_options\.record_to.*'scaled_ppo'.*required"):
        build_config({**base, "trainer": {"policy_loss": "scaled_ppo", "policy_loss_options": {"scale": 2.0}}})
    with pytest.raises(ConfigError, match=r"algorithm\.estimator_options.*'grpo' takes no options.*'value'"):
        build_config({**base, "algorithm": {"estimator": "grpo", "estimator_options": {"value": 1.0}}})
    config = build_config({**base, "algorithm": {"estimator": "constant", "estimator_options": {"value": 2.0}}})
    assert ADVANTAGE_ESTIMATORS.settings("constant", config.algorithm.estimator_options).value == 2.0


def test_a_scoped_registry_forgets_what_was_registered_inside_and_keeps_the_rest():
    from pydantic import BaseModel

    from agent_core.registry import Registry

    class Options(BaseModel):
        size: int = 1

    things = Registry("thing")
    things.register("kept")(1)
    with things.scoped():
        things.register("inside", settings=Options)(2)
        assert things.names() == ["inside", "kept"] and things.settings("inside", {"size": 3}).size == 3
    assert things.names() == ["kept"] and "inside" not in things
    things.register("inside")(3)  # the name is free again, and registered without a settings model now
    assert things.settings_model("inside") is None and things.get("inside") == 3


def test_an_engines_traits_decide_availability_and_router_concurrency(plugin):
    from agent_core.rollout.engines import EngineOptions, router_concurrency
    from agent_core.validation import check_runnable

    base = {"plugins": ["my_algorithms"], "warm_start": {"enabled": False}}
    config = build_config({**base, "rollout": {"engine": "needs_runtime"}})
    with pytest.raises(ConfigError, match="rollout.engine.*the x runtime is not installed"):
        check_runnable(config, policy_source=False)
    check_runnable(build_config({**base, "rollout": {"engine": "fixed_reply"}}), policy_source=False)  # defaults
    options = EngineOptions()
    assert router_concurrency("needs_runtime", options, 2) == 6
    assert router_concurrency("fixed_reply", options, 2) == router_concurrency("hf", options, 4) == 1
    assert router_concurrency("vllm", options, 2) == 2 * options.vllm.max_concurrent_calls
