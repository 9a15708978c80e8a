"""Plugins: the user's modules that register envs, tools, estimators or scorers by name.

A plugin is any importable module whose import registers things (`@ENVS.register("my_env")`,
`@TOOLS.register("my_tool")`, ...). Configs list them (`plugins: [my_project.tools]`); they are
imported before the config is validated, so the names they register are valid choices. The current
directory is importable too, so a file `my_tools.py` next to where `agentr1` runs is plugin
`my_tools`.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence


class PluginError(ImportError):
    pass


_loaded: list[str] = []


def loaded_plugins() -> tuple[str, ...]:
    """The plugin modules this process imported, in order (a Ray replica imports the same ones)."""
    return tuple(_loaded)


def load_plugins(modules: Sequence[str]) -> None:
    """Import each module (once; importing again is a no-op). PluginError names the module."""
    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in modules:
        try:
            importlib.import_module(name)
            if name not in _loaded:
                _loaded.append(name)
        except Exception as error:
            raise PluginError(f"cannot import plugin {name!r}: {type(error).__name__}: {error}") from error
