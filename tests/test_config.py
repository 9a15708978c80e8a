"""Config loading: defaults, YAML files, overrides, and typos failing with the valid choices."""

from __future__ import annotations

import json
import logging

import pytest

from agent_core.config import MOVED_KEYS, ConfigError, PipelineConfig
from agent_core.io.config_files import save_config
from agent_core.validation import load_config
from tests.conftest import REPO_ROOT


def test_embedded_defaults_equal_the_demo_yaml():
    defaults = load_config(None)
    demo = load_config(REPO_ROOT / "configs" / "demo.yaml")
    assert defaults == demo


def test_overrides_parse_yaml_scalars():
    config = load_config(None, ["rollout.group_size=8", "trainer.lr=1e-3", "algorithm.use_loss_mask=false"])
    assert config.rollout.group_size == 8
    assert config.trainer.lr == pytest.approx(1e-3)
    assert config.algorithm.use_loss_mask is False


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["rollout.grup_size=8"])
    message = str(error.value)
    assert "rollout.grup_size" in message and "group_size" in message and "max_steps" in message


def test_a_moved_key_loads_at_its_new_place_and_says_where_it_went(caplog):
    with caplog.at_level(logging.WARNING):
        config = load_config(None, ["algorithm.process_reward_norm=max_abs"])
    assert config.reward.process_norm == "max_abs"
    assert ("'algorithm.process_reward_norm' (set by --set algorithm.process_reward_norm=max_abs) moved to "
            "'reward.process_norm'") in caplog.text
    assert load_config(None, ["reward.process_norm=max_abs"]).reward.process_norm == "max_abs"
    with pytest.raises(ConfigError) as error:  # keys that did not move get no hint
        load_config(None, ["rollout.grup_size=8"])
    assert "moved" not in str(error.value)


@pytest.mark.parametrize("old,new", sorted(MOVED_KEYS.items()))
def test_every_moved_key_still_loads_as_its_new_key(old, new):
    """An old config keeps working: each moved key, set to a non-default value, lands at its new key."""
    new_section, new_key = new.split(".")
    default = getattr(getattr(PipelineConfig(), new_section), new_key)
    value = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v / 2 + 0.01,
             str: lambda v: "max_abs"}[type(default)](default)
    config = load_config(None, [f"{old}={json.dumps(value)}"])
    assert getattr(getattr(config, new_section), new_key) == value != default


def test_a_moved_key_set_at_both_places_fails_naming_both():
    with pytest.raises(ConfigError, match=r"'trainer.critic_lr' and 'critic.lr' are both set"):
        load_config(None, ["trainer.critic_lr=0.01", "critic.lr=0.02"])


def test_unknown_top_level_section_lists_sections(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rolout:\n  group_size: 2\n")
    with pytest.raises(ConfigError, match="rolout.*valid keys here:.*rollout"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "valid_name"),
    [("algorithm.estimator=grpoo", "grpo"), ("reward.scorer=em", "qa_em"), ("rollout.engine=vlm", "hf"),
     ("trainer.loss_agg_mode=mean", "token-mean")],
)
def test_unknown_registered_name_lists_valid_names(override, valid_name):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert valid_name in str(error.value)


def test_out_of_range_value_is_rejected():
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["rollout.group_size=0"])


def test_config_is_frozen_and_round_trips_through_yaml(tmp_path):
    config = load_config(None, ["run_id=abc", "iterations=5"])
    with pytest.raises(Exception):
        config.iterations = 7  # type: ignore[misc]
    path = save_config(config, tmp_path / "config.yaml")
    assert load_config(path) == config
    assert PipelineConfig().flat()["algorithm.estimator"] == "grpo"


def test_missing_file_and_bad_override_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["iterations"])


def test_config_files_layer_key_by_key():
    config = load_config([REPO_ROOT / "configs" / "tiny.yaml", REPO_ROOT / "configs" / "algos" / "ppo.yaml"],
                         ["algorithm.lam=0.95"])
    assert config.policy.hidden_size == 32 and config.rollout.group_size == 2  # from tiny.yaml
    assert config.algorithm.estimator == "gae" and config.algorithm.kl_in_reward  # from ppo.yaml
    assert config.algorithm.lam == 0.95 and config.algorithm.norm_by_std  # override, then defaults


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO_ROOT / "configs" / "algos").glob("*.yaml")))
def test_every_algorithm_config_loads(name):
    config = load_config(REPO_ROOT / "configs" / "algos" / f"{name}.yaml")
    assert config.algorithm.estimator in {"grpo", "gae", "step_gae", "gigpo", "rloo", "reinforce_pp",
                                          "reinforce_pp_baseline"}


# configs/experiment.yaml is an experiment spec (flows/experiment.py), loaded by its own tests.
SHIPPED = sorted(p for p in [*(REPO_ROOT / "configs").glob("*.yaml"), *(REPO_ROOT / "configs" / "algos").glob("*.yaml")]
                 if p.name != "experiment.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_shipped_config_loads_and_uses_no_moved_key(path, caplog):
    """The shipped configs are the examples users copy: each loads, and none relies on a moved key."""
    with caplog.at_level(logging.WARNING, logger="agent_core.config.loading"):
        load_config(path)
    assert "moved to" not in caplog.text
