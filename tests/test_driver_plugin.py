"""An env with a rollout driver of its own, added from one plugin file that touches no file of the
project (issue 40): `ENVS.register(..., traits=EnvTraits(driver=...))` plus `DRIVERS.register(...)`, then trained with
in a tiny run (`agentr1 train`, dev eval included) and refused at config load when its driver is
not registered."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from agent_core.config_errors import ConfigError
from agent_core.io.tables import read_table
from agent_core.rollout.engine import Generation
from agent_core.rollout.records import EpisodeIdentity, one_step_episode
from flows.cli import main as cli_main
from plugin_runs import train_tiny, write_plugin
from schemas import table_from_rows, validate

# One generation per episode; the answer is the gold one when the first sampled token id is even,
# so rewards vary within a group and the update has a signal. Every step says which driver made it.
PLUGIN = '''
from agent_core.drivers import DRIVERS
from agent_core.envs.registry import ENVS, EnvTraits
from agent_core.rollout.chat import encode_conversation, eos_token_ids
from agent_core.rollout.records import EpisodeIdentity, one_step_episode


@ENVS.register("one_shot_guess", traits=EnvTraits(driver="one_shot"))
def one_shot_guess(resources):
    raise ValueError("one_shot_guess is rolled out by its driver, never built")


@ENVS.register("orphan_env", traits=EnvTraits(driver="nobody_registered_this"))
def orphan_env(resources):
    raise ValueError("never built")


@DRIVERS.register("one_shot")
def one_shot(request, prompts):
    group = request.group_size or request.spec.group_size
    sampling = request.spec.sampling(request.seed, eos_token_ids(request.tokenizer))
    steps = []
    for prompt in prompts:
        context = encode_conversation(request.tokenizer, prompt.messages)
        group_id = f"{request.episode_prefix}{prompt.prompt_id}"
        for k, generation in enumerate(request.engine.generate([context] * group, sampling)):
            answer = prompt.answers[0] if generation.token_ids[0] % 2 == 0 else "no idea"
            identity = EpisodeIdentity(f"{group_id}-s{k}", group_id, prompt.prompt_id, k, request.policy_version)
            steps.append(one_step_episode(identity, context, generation, request.tokenizer.decode(generation.token_ids),
                                          termination="answered", info={"answer": answer, "driver": "one_shot"}))
    return steps
'''


@pytest.fixture()
def plugin_dir(user_folder):
    return write_plugin(user_folder, "one_shot_driver", PLUGIN)


def test_an_env_with_its_own_driver_trains_from_a_plugin_file(plugin_dir, tmp_path):
    run = train_tiny(tmp_path / "data", "one_shot_driver", "rollout.env=one_shot_guess")
    steps = read_table("steps", run.table_uri(0, "steps")).to_pylist()
    assert steps and {json.loads(s["info"])["driver"] for s in steps} == {"one_shot"}  # the loop never ran them
    assert len(steps) == 3 * 2  # tiny: 3 prompts x group_size 2, one step each
    rewards = read_table("rewards", run.table_uri(0, "rewards")).column("reward").to_pylist()
    assert len(rewards) == len(steps)
    metrics = read_table("train_metrics", run.table_uri(0, "train_metrics")).to_pylist()
    assert metrics and all(math.isfinite(m["loss"]) and not m["skipped"] for m in metrics)
    dev = read_table("eval", run.dev_eval_uri(0)).to_pylist()  # the dev eval went through the driver too
    assert dev and {d["termination"] for d in dev} == {"answered"} and {d["steps"] for d in dev} == {1}


def test_an_env_whose_driver_is_not_registered_is_refused_at_config_load(plugin_dir, tmp_path, capsys, no_server):
    from agent_core.validation import build_config

    with pytest.raises(ConfigError, match="unknown rollout driver 'nobody_registered_this'.*one_shot"):
        build_config({"plugins": ["one_shot_driver"], "warm_start": {"enabled": False},
                      "rollout": {"env": "orphan_env"}})
    assert cli_main(["train", "--config", "tiny", "--data-root", str(tmp_path / "d"), "--set",
                     "plugins=[one_shot_driver]", "--set", "rollout.env=orphan_env"]) == 2
    assert "rollout.env" in capsys.readouterr().err and not (tmp_path / "d" / "runs").exists()


def test_one_step_episode_is_a_whole_valid_episode_and_takes_a_replicas_version():
    identity = EpisodeIdentity("r-p1-s1", "r-p1", "p1", 1, 3)
    step = one_step_episode(identity, [5, 6], Generation([7, 8], [-0.5, -0.25], "length", policy_version=2,
                                                         served_by="replica-0"), "ab", termination="max_context",
                            info={"answer": "é"})
    assert (step.step_idx, step.done, step.truncated, step.policy_version, step.served_by) == (0, True, True, 2, "replica-0")
    assert (step.prompt_ids, step.response_ids, step.info, step.history) == ([5, 6], [7, 8], '{"answer": "é"}', "start")
    validate("steps", table_from_rows("steps", [{"run_id": "r", "iteration": 3, **dataclasses.asdict(step)}]))
    answered = one_step_episode(identity, [5], Generation([7], [-1.0], "stop"), "a", termination="answered", info={})
    assert (answered.truncated, answered.policy_version) == (False, 3)
    with pytest.raises(ValueError, match="termination 'done' is not one of"):
        one_step_episode(identity, [5], Generation([7], [-1.0], "stop"), "a", termination="done", info={})
