"""Envs by name: a prompt's `env_name` + `env_kwargs` (plus shared resources) build its env.

A factory takes the rollout's shared, read-only resources (built once per rollout, e.g. the search
index) and the prompt's keyword arguments. `make_env` checks the keyword names against the factory
before calling it, so a bad key in a dataset or config names the env and the valid keys.
`check_env_spec` checks the same without building anything (an env may need the corpus), plus the
tool names and tool format the kwargs name, so bad input fails before a rollout starts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from agent_core.envs.program_spec import ENV_NAME, ProgramSpec
from agent_core.envs.base import AgentEnv
from agent_core.envs.formats import FORMATS
from agent_core.envs.search import Bm25Index
from agent_core.envs.tool_env import DEFAULT_MAX_TOOL_CALLS_PER_EPISODE, ChatCapabilities, ToolEnv, check_tool_env_values
from agent_core.envs.tools import TOOLS, make_tool
from agent_core.registry import Registry


@dataclass(frozen=True)
class EnvResources:
    """What envs share across a rollout. search_index: the corpus, for envs and tools that search.
    chat: what the policy's chat template can render (decides where tools are described)."""

    search_index: Bm25Index | None = None
    chat: ChatCapabilities = ChatCapabilities()


EnvFactory = Callable[..., AgentEnv]  # (resources: EnvResources, **kwargs) -> AgentEnv

ENVS: Registry[EnvFactory] = Registry("env")
LOOP_DRIVER = "agent_loop"  # the rollout driver of an env registered without traits (agent_core/drivers)


@dataclass(frozen=True)
class EnvTraits:
    """What a rollout must know of an env before building it: `driver`, the rollout driver its
    episodes need (a name in agent_core/drivers DRIVERS, checked at config load).
    `@ENVS.register(name, traits=EnvTraits(driver=...))`. tool_format: the tool-call format the env
    always speaks, whatever its kwargs (None: its `tool_format` argument, or that argument's default).
    program_tools: its tools are declared by the agent program in each request, known only at run time."""

    driver: str = LOOP_DRIVER
    tool_format: str | None = None
    program_tools: bool = False


def env_driver(name: str) -> str:
    """The rollout driver env `name` declared (UnknownNameError for an unknown env)."""
    return env_traits(name).driver


def env_traits(name: str) -> EnvTraits:
    """What env `name` declared when registered (UnknownNameError for an unknown env)."""
    return ENVS.traits(name, EnvTraits())


def env_tool_format(name: str, kwargs: Mapping[str, Any]) -> str:
    """The tool-call format env `name` speaks with `kwargs`: the format it always speaks, else its
    `tool_format` argument or that argument's default, else "tag"."""
    fixed = env_traits(name).tool_format
    if fixed is not None:
        return fixed
    if "tool_format" in kwargs:
        return str(kwargs["tool_format"])
    default = _kwarg_default(name, "tool_format")
    return default if isinstance(default, str) else "tag"


def _kwarg_default(name: str, key: str) -> Any:
    """The default of env `name`'s keyword argument `key` (inspect.Parameter.empty: none, or no such key)."""
    parameter = inspect.signature(ENVS.get(name)).parameters.get(key)
    return inspect.Parameter.empty if parameter is None else parameter.default


@ENVS.register("tool_env")
def _make_tool_env(resources: EnvResources, *, tools: Sequence[str | Mapping[str, Any]] = ("calculator",),
                   tool_format: str = "hermes", invalid_action_penalty: float = 0.0, tool_error_penalty: float = 0.0,
                   tool_timeout_s: float = 10.0, max_calls_per_action: int = 4, max_result_chars: int = 4000,
                   max_tool_calls_per_episode: int | None = DEFAULT_MAX_TOOL_CALLS_PER_EPISODE,
                   instructions: bool = True) -> ToolEnv:
    """Any registered tools in any format. tools: names, or {"name": ..., "kwargs": {...}} entries.
    The other kwargs are ToolEnv's (budgets, timeout, result size, penalties, instructions)."""
    check_tool_entries(tools, "env 'tool_env'")
    built = [make_tool(name, dict(kwargs), resources) for name, kwargs in map(_tool_entry, tools)]
    return ToolEnv(built, tool_format, chat=resources.chat, invalid_action_penalty=invalid_action_penalty,
                   tool_error_penalty=tool_error_penalty, tool_timeout_s=tool_timeout_s,
                   max_calls_per_action=max_calls_per_action, max_result_chars=max_result_chars,
                   max_tool_calls_per_episode=max_tool_calls_per_episode, instructions=instructions)


@ENVS.register("search_qa")
def _make_search_qa(resources: EnvResources, *, top_k: int = 3, tool_format: str = "tag",
                    invalid_action_penalty: float = 0.0, tool_error_penalty: float = 0.0,
                    tool_timeout_s: float = 10.0, max_result_chars: int = 4000,
                    max_tool_calls_per_episode: int | None = DEFAULT_MAX_TOOL_CALLS_PER_EPISODE,
                    instructions: bool = True) -> ToolEnv:
    """Multi-hop QA (Search-R1 / Agent-R1): the `search` tool over the corpus, then `<answer>`.
    The other kwargs are ToolEnv's (budgets, timeout, result size, penalties, instructions)."""
    if resources.search_index is None:
        raise ValueError(
            "env 'search_qa' needs a corpus to search: EnvResources.search_index is None "
            "(build a Bm25Index from the dataset's documents)"
        )
    search = make_tool("search", {"top_k": top_k}, resources)
    return ToolEnv([search], tool_format, chat=resources.chat, invalid_action_penalty=invalid_action_penalty,
                   tool_error_penalty=tool_error_penalty, tool_timeout_s=tool_timeout_s,
                   max_result_chars=max_result_chars, max_tool_calls_per_episode=max_tool_calls_per_episode,
                   instructions=instructions)


@ENVS.register(ENV_NAME, traits=EnvTraits(driver=ENV_NAME, tool_format="hermes", program_tools=True))
def _make_agent_program(resources: EnvResources, *, command: Sequence[str] = (), timeout_s: float = 60.0,
                        max_parallel: int = 4, max_output_bytes: int = 1_000_000) -> AgentEnv:
    """Your own agent program, run once per episode against the gateway (agent_core/gateway,
    agent_core/envs/agent_program.py). Its episodes are rolled out by its own driver
    (agent_core/drivers/program.py), not the agent loop: nothing builds this env, its kwargs are
    checked here (`ProgramSpec.from_env_kwargs`)."""
    ProgramSpec.from_env_kwargs({"command": command, "timeout_s": timeout_s, "max_parallel": max_parallel,
                                 "max_output_bytes": max_output_bytes})
    raise ValueError(f"env {ENV_NAME!r} runs a program through the gateway, not in the agent loop; "
                     "roll it out with agent_core.drivers.roll_out (its driver is agent_program)")


# Envs whose tools are fixed by the env, not chosen by a `tools` argument.
_FIXED_TOOLS: dict[str, tuple[str, ...]] = {"search_qa": ("search",)}


def env_tool_names(name: str, kwargs: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The names of the tools env `name` gives the policy with `kwargs`, told without building it:
    an env that takes `tools` (tool_env) has those (or its default), search_qa has `search`. None
    for an env whose tools its arguments do not tell (a plugin's env without a `tools` argument)."""
    if name in _FIXED_TOOLS:
        return _FIXED_TOOLS[name]
    if "tools" not in env_kwarg_names(name):
        return None
    default = _kwarg_default(name, "tools")
    entries = kwargs.get("tools", () if default is inspect.Parameter.empty else default)
    return tuple(str(_tool_entry(entry)[0]) for entry in entries)


def env_offers_tools(name: str | None, kwargs: Mapping[str, Any]) -> bool:
    """False only when env `name` with `kwargs` is known to give the policy no tools (a tool_env
    with `tools: []`): the audit's tool checks are not run for it. `name` None (`rollout.env` unset:
    each prompt names its env) is True."""
    return name is None or env_tool_names(name, kwargs) != ()


def env_kwarg_names(name: str) -> list[str]:
    """The keyword arguments env `name` accepts (UnknownNameError for an unknown env)."""
    return ENVS.kwarg_names(name)


def check_env_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Raise TypeError naming the env and the bad keys if `kwargs` has a key env `name` does not take."""
    ENVS.check_kwargs(name, kwargs)


def check_env_spec(name: str, kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError naming the problem unless env `name` is registered, takes every key of
    `kwargs`, and the tool format and tools those name are registered (with keys their factories
    take). Values are not checked: that needs the env built. An env whose factory takes `tools`
    gets them as names or {"name", "kwargs"} entries, the `tool_env` convention."""
    ENVS.check(name)
    try:
        check_env_kwargs(name, dict(kwargs))
    except TypeError as error:
        raise ValueError(str(error)) from None
    if "tool_format" in kwargs:
        _check_name(FORMATS, kwargs["tool_format"], f"env {name!r}, tool_format")
    if "tools" in kwargs and "tools" in env_kwarg_names(name):
        check_tool_entries(kwargs["tools"], f"env {name!r}")
    if name == ENV_NAME:  # its values can be checked without building anything
        ProgramSpec.from_env_kwargs(kwargs)
    if name in TOOL_ENVS:
        check_tool_env_kwargs(kwargs, f"env {name!r}")


# The registered envs that are a ToolEnv: their scalar kwargs (penalties, budgets) are checked at
# config load, not first when an env is built (a rollout, or minutes later the dev eval).
TOOL_ENVS = ("tool_env", "search_qa")


def check_tool_env_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    """ValueError, prefixed with `where`, if a ToolEnv setting in `kwargs` is out of range or not a number."""
    try:
        check_tool_env_values(**kwargs)
    except TypeError:
        raise ValueError(f"{where}: penalties, budgets and timeouts must be numbers, got "
                         f"{ {k: v for k, v in kwargs.items() if k != 'tools'} }") from None
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def check_tool_entries(entries: Any, where: str) -> None:
    """Raise ValueError, prefixed with `where` and the entry's index, unless `entries` is a list of
    registered tool names or {"name": ..., "kwargs": {...}} entries whose keys the tool takes."""
    if isinstance(entries, (str, Mapping)) or not isinstance(entries, Sequence):
        raise ValueError(f"{where}: tools must be a list of tool names or {{name, kwargs}} entries, got {entries!r}")
    for index, entry in enumerate(entries):
        at = f"{where}, tools[{index}]"
        name, kwargs = _tool_entry(entry)
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"{at}: expected a tool name or a {{name, kwargs}} entry, got {entry!r}")
        _check_name(TOOLS, name, at)
        try:
            TOOLS.check_kwargs(name, kwargs)
        except TypeError as error:
            raise ValueError(f"{at}: {error}") from None


def _tool_entry(entry: Any) -> tuple[Any, Any]:
    """(name, kwargs) of a tools entry: a tool name, or {"name": ..., "kwargs": {...}}; (None, None) else."""
    if isinstance(entry, str):
        return entry, {}
    if isinstance(entry, Mapping):
        return entry.get("name"), entry.get("kwargs", {})
    return None, None


def _check_name(registry: Registry, name: Any, where: str) -> None:
    if not isinstance(name, str) or name not in registry:
        raise ValueError(f"{where}: unknown {registry.kind} {name!r}; valid {registry.kind}s: "
                         f"{', '.join(registry.names()) or '(none)'}")


def make_env(name: str, kwargs: dict[str, Any], resources: EnvResources) -> AgentEnv:
    """Build env `name` with `kwargs` (e.g. a prompt's env_name and env_kwargs)."""
    check_env_kwargs(name, kwargs)
    return ENVS.get(name)(resources, **kwargs)
