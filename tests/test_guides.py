"""The guides' examples run: a tool in one file (examples/unit_convert_tool.py) and an env in one
file (examples/guess_number_env.py), each registered by a plugin import and used by name."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from agent_core.envs.registry import ENVS, EnvResources, make_env
from agent_core.envs.tools import TOOLS
from agent_core.io.tables import read_table, write_table
from agent_core.plugins import load_plugins
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage, Prompt
from agent_core.validation import build_config

REPO_ROOT = Path(__file__).resolve().parent.parent
GUIDES = REPO_ROOT / "docs" / "guides"


@pytest.fixture(scope="module", autouse=True)
def plugins():
    load_plugins(["examples.unit_convert_tool", "examples.guess_number_env"])


def _prompt(question: str, env: str) -> Prompt:
    return Prompt("p0", "guide", "train", (ChatMessage("user", question),), ("x",), env)


def test_guides_name_their_example_files():
    assert "examples/unit_convert_tool.py" in (GUIDES / "write-a-tool.md").read_text()
    assert "examples/guess_number_env.py" in (GUIDES / "write-an-env.md").read_text()


def test_tool_example_is_registered_with_the_schema_from_its_docstring():
    assert "unit_convert" in TOOLS.names()
    spec = TOOLS.get("unit_convert")(EnvResources()).spec()["function"]
    assert spec["description"] == "Convert a length from one unit to another."
    assert spec["parameters"]["required"] == ["value", "source", "target"]
    assert spec["parameters"]["properties"]["source"] == {
        "type": "string", "enum": ["m", "km", "mi", "ft"], "description": "The unit `value` is in."}


def test_tool_example_runs_in_tool_env_and_bad_calls_are_observations():
    env = make_env("tool_env", {"tools": ["unit_convert", "calculator"], "tool_format": "hermes"}, EnvResources())
    opening = env.reset(_prompt("How many km is a mile?", "tool_env"))
    assert "unit_convert" in opening[0].content  # the tool list is in the system prompt
    call = '<tool_call>{"name": "unit_convert", "arguments": {"value": 1, "source": "mi", "target": "km"}}</tool_call>'
    step = env.step(call)
    assert "1.60934 km" in step.observation and step.tool_calls[0].ok and not step.done
    bad = env.step('<tool_call>{"name": "unit_convert", "arguments": {"value": 1, "source": "yd", "target": "m"}}</tool_call>')
    assert not bad.tool_calls[0].ok and bad.tool_calls[0].error_kind == "bad_arguments" and "source" in bad.observation
    assert env.step("<answer>1.609 km</answer>").termination == "answered"


def test_tool_example_cannot_use_the_tag_format_and_says_why():
    with pytest.raises(ValueError, match="unit_convert"):
        make_env("tool_env", {"tools": ["unit_convert"], "tool_format": "tag"}, EnvResources())


def test_env_example_binary_search_wins():
    env = make_env("guess_number", {"high": 64, "seed": 7}, EnvResources())
    env.reset(_prompt("Guess.", "guess_number"))
    low, high, steps = 1, 64, 0
    while True:
        guess = (low + high) // 2
        step, steps = env.step(f"My guess is {guess}."), steps + 1
        if step.done:
            break
        low, high = (guess + 1, high) if step.observation == "higher" else (low, guess - 1)
    assert step.termination == "answered" and step.reward == 1.0 and steps <= 7
    assert env.step("no idea").parse_error == "no number in the reply"


def test_env_example_rolls_out_with_a_real_model_into_a_valid_steps_table(tmp_path):
    texts = ["I am thinking of a number from 1 to 8. Reply with one number per turn.", "higher lower 1 2 3 4 5 6 7 8"]
    tokenizer = build_tokenizer(texts, vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    prompts = [_prompt("Guess.", "guess_number")]
    settings = LoopSettings(group_size=3, max_steps=3, max_context_tokens=512, policy_version=0)
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=eos_token_ids(tokenizer), seed=0)
    steps = run_episodes(HFEngine(model, tokenizer), tokenizer, prompts,
                         lambda p: make_env(p.env_name, {"high": 8}, EnvResources()), sampling, settings)
    rows = [{"run_id": "r", "iteration": 0, **dataclasses.asdict(s)} for s in steps]
    table = read_table("steps", write_table("steps", rows, tmp_path / "steps.parquet"))
    assert len(set(table.column("episode_id").to_pylist())) == 3
    assert set(table.column("termination").drop_null().to_pylist()) <= {"answered", "max_steps"}


def test_env_example_is_selectable_by_config_and_typos_list_valid_kwargs():
    config = build_config({"plugins": ["examples.guess_number_env"],
                           "rollout": {"env": "guess_number", "env_kwargs": {"high": 8}}})
    assert config.rollout.env == "guess_number" and "guess_number" in ENVS.names()
    with pytest.raises(ValueError, match=re.escape("valid arguments: high, seed, step_penalty")):
        build_config({"plugins": ["examples.guess_number_env"],
                      "rollout": {"env": "guess_number", "env_kwargs": {"hi": 8}}})


@pytest.mark.slow
def test_env_example_trains_through_the_flow(tmp_path):
    from flows.train import train

    config = build_config({**_tiny_config(), "data_root": str(tmp_path), "run_id": "guess", "iterations": 1,
                           "plugins": ["examples.guess_number_env"],
                           "rollout": {**_tiny_config()["rollout"], "env": "guess_number", "env_kwargs": {"high": 4}}})
    result = train(config)
    steps = read_table("steps", Path(result.run_dir) / "iteration=0" / "steps.parquet")
    infos = [json.loads(i) for i in steps.column("info").to_pylist()]
    assert any("hint" in i or i.get("format_ok") is False or "answer" in i for i in infos)
    assert result.model_version == 1


def _tiny_config() -> dict:
    import yaml

    return yaml.safe_load((REPO_ROOT / "configs" / "tiny.yaml").read_text())
