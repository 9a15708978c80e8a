"""docs/config.md: generated from the config models, every key described, never stale."""

from __future__ import annotations

import typing

import pytest

from agent_core.config import ConfigError, apply_overrides, parse_config
from agent_core.validation import check_names
from flows import config_reference
from flows.config_reference import COMMAND, PAGE, REGISTERED, all_keys, main, render

_BOGUS = "zz_not_registered"


def test_every_key_has_a_description():
    undescribed = [key.name for key in all_keys() if not (key.field.description or "").strip()]
    assert not undescribed, f"config keys without a description (add Field(..., description=...)): {undescribed}"


def test_every_section_has_a_docstring():
    bare = [section.prefix or "top level" for section in config_reference.sections() if not section.model.__doc__]
    assert not bare, f"config sections without a docstring (the page's introduction of each): {bare}"


def test_the_page_is_current():
    current = PAGE.read_text() if PAGE.is_file() else ""
    assert current == render(), f"docs/config.md is stale: run `{COMMAND}` to regenerate it"


def test_check_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path, capsys):
    page = tmp_path / "config.md"
    page.write_text(render().replace("| `rollout.group_size` |", "| `rollout.grop_size` |"))
    assert main(["--check", "--path", str(page)]) == 1
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and COMMAND in message
    assert main(["--path", str(page)]) == 0
    assert main(["--check", "--path", str(page)]) == 0


def test_the_page_lists_every_key_with_its_default_and_choices():
    page = render()
    for key in all_keys():
        assert f"| `{key.name}` |" in page
    assert "| `rollout.group_size` | int | `4` | ≥ 1 |" in page
    assert "`gae`, `gigpo`, `grpo`" in page  # registered estimators
    assert "| `algorithm.process_reward_weight` | `reward.process_weight` |" in page  # the moved keys


def _plain_string_keys() -> list[str]:
    """Keys typed str (or str | None) with no Literal: the ones that may name a registered part."""
    def plain(annotation: typing.Any) -> bool:
        return annotation is str or annotation == (str | None)
    return [key.name for key in all_keys()
            if plain(key.field.annotation) and "[" not in key.name and "<" not in key.name]


@pytest.mark.parametrize("key", _plain_string_keys())
def test_registered_keys_are_exactly_those_check_names_checks(key):
    """The page's registered-name choices come from REGISTERED; a key check_names checks against a
    registry that REGISTERED lacks (or the reverse) would list wrong choices."""
    try:
        config = parse_config(apply_overrides({}, [f"{key}={_BOGUS}"]))
    except ConfigError:
        assert key not in REGISTERED, f"{key} is refused before check_names"
        return  # the value fails a pattern or a cross-field rule: not a registry name
    try:
        check_names(config)
        refused = False
    except ConfigError as error:
        refused = f"{key}: unknown" in str(error) and f"{_BOGUS!r}; valid" in str(error)
    assert refused == (key in REGISTERED), (
        f"{key}: check_names {'checks' if refused else 'does not check'} it against a registry; "
        "update flows/config_reference.py REGISTERED")
