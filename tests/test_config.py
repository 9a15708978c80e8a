"""Config loading: defaults, YAML files, overrides, and typos failing with the valid choices."""

from __future__ import annotations

import pytest

from agent_core.config import ConfigError, PipelineConfig
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


def test_a_moved_key_says_where_it_went():
    with pytest.raises(ConfigError, match=r"'algorithm.process_reward_norm' \(it moved to 'reward.process_norm'"):
        load_config(None, ["algorithm.process_reward_norm=max_abs"])
    assert load_config(None, ["reward.process_norm=max_abs"]).reward.process_norm == "max_abs"
    with pytest.raises(ConfigError) as error:  # keys that did not move get no hint
        load_config(None, ["rollout.grup_size=8"])
    assert "moved" not in str(error.value)


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
