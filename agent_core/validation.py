"""The registry-name checks of a pipeline config, and the config loaders that run them.

A config names swappable parts by string (engine, env, tool format and tools, scorer, advantage
and KL estimators, policy loss, loss aggregation mode). Those names are registered by the modules that
implement them and by plugins, so they can only be checked once everything is imported; the
config models (`agent_core.config`) import none of those modules, and `check_names` does it here,
at the top of the library, once a config is validated (its plugins loaded).

Every entry point that loads a config for a run goes through here: `load_config` (YAML files and
`a.b=v` overrides) and `build_config` (a dict): `agent_core.io.config_files` / `agent_core.config`
parsing, then `check_names`; the training flow checks the config it is handed as well.
"""

from __future__ import annotations

import importlib.util
import os

import re
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from agent_core.algos.estimator_core import ADVANTAGE_ESTIMATORS, estimator_ignores_advantage_mask
from agent_core.algos.kl import KL_ESTIMATORS
from agent_core.algos.losses import LOSS_AGG_MODES, POLICY_LOSSES
from agent_core.config import AlgorithmConfig, PipelineConfig, RolloutConfig, parse_config
from agent_core.config_errors import Problem, config_error
from agent_core.data.oracle import oracle_config_problems
from agent_core.devices import DeviceError, resolve_device
from agent_core.drivers import DRIVERS
from agent_core.envs.program_spec import ENV_NAME as PROGRAM_ENV, ProgramSpec
from agent_core.envs.formats import FORMATS
from agent_core.envs.registry import ENVS, check_env_spec, env_driver, check_tool_entries, check_tool_env_kwargs
from agent_core.io.checkpoints import CheckpointError, check_checkpoint, policy_source_dir
from agent_core.io.config_files import config_source, read_config
from agent_core.audit.validate import audit_problems
from agent_core.io.query import QueryError, check_episode_selection
from agent_core.registry import Registry, UnknownNameError
from agent_core.rewards.scorers import SCORERS
from agent_core.rollout.engines import ENGINES, engine_traits
from agent_core.training.objectives import TRAINING_OBJECTIVES

# `owner/name`, the shape of a Hugging Face Hub id
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_config(paths: str | Path | Sequence[str | Path] | None = None,
                overrides: list[str] | None = None, runnable: bool = False) -> PipelineConfig:
    """Read YAML configs with overrides (`agent_core.io.config_files.read_config`), then `check_names`,
    and with `runnable` `check_runnable` (for a new run: its policy checkpoint, its engine)."""
    config = read_config(paths, overrides)
    check_names(config, config_source(paths), overrides or [])
    return check_runnable(config, config_source(paths), overrides or []) if runnable else config


def build_config(data: dict[str, Any], source: str = "config") -> PipelineConfig:
    """A config from a dict (`agent_core.config.parse_config`), then `check_names`."""
    return check_names(parse_config(data, source), source)


def check_names(config: PipelineConfig, source: str = "config", overrides: Sequence[str] = ()) -> PipelineConfig:
    """Return `config` if every name in it is registered; else ConfigError listing each bad key with
    the valid names (and the `--set` of `overrides` that set it, if one did). A check that depends on a
    name (the env's kwargs on the env, the advantage-mask ablation on the estimator) is skipped while
    that name is unknown, so each mistake is told once."""
    problems = [
        *_rollout_problems(config.rollout),
        *_unknown("reward.scorer", SCORERS, config.reward.scorer),
        *_algorithm_problems(config.algorithm),
        *_unknown("trainer.loss_agg_mode", LOSS_AGG_MODES, config.trainer.loss_agg_mode),
        *(_unknown("trainer.policy_loss", POLICY_LOSSES, config.trainer.policy_loss)
          or _options_problems("trainer.policy_loss_options", POLICY_LOSSES, config.trainer.policy_loss,
                               config.trainer.policy_loss_options)),
        *(_unknown("trainer.objective", TRAINING_OBJECTIVES, config.trainer.objective)
          or _options_problems("trainer.objective_options", TRAINING_OBJECTIVES, config.trainer.objective,
                               config.trainer.objective_options)),
        *oracle_config_problems(config),  # the warm start's oracle fits the data and the env's tools
        *_select_sql_problems(config.warm_start.select_sql),
        *audit_problems(config.audit),
    ]
    if problems:
        raise config_error(problems, source, overrides)
    return config


def _select_sql_problems(sql: str | None) -> list[Problem]:
    """User SQL is refused here, before any run starts, unless it is one SELECT that reads only its views."""
    if sql is None:
        return []
    try:
        check_episode_selection(sql)
    except QueryError as error:
        return [Problem("warm_start.select_sql", str(error))]
    return []


def _unknown(key: str, registry: Registry, name: str) -> list[Problem]:
    try:
        registry.check(name)
    except UnknownNameError as error:
        return [Problem(key, str(error))]
    return []


def _rollout_problems(cfg: RolloutConfig) -> list[Problem]:
    problems = _unknown("rollout.engine", ENGINES, cfg.engine)
    env_problems = [] if cfg.env is None else _unknown("rollout.env", ENVS, cfg.env)
    if cfg.env is not None and not env_problems:  # a plugin's env may name a driver nobody registered
        env_problems = _unknown("rollout.env", DRIVERS, env_driver(cfg.env))
    return problems + (env_problems or _env_kwargs_problems(cfg))


def _env_kwargs_problems(cfg: RolloutConfig) -> list[Problem]:
    """env_kwargs must fit the config's env (keys, tool format, tool names), or, with no env set,
    name registered tools and format (they refine each prompt's own env)."""
    if cfg.env is not None:
        try:
            check_env_spec(cfg.env, cfg.env_kwargs)
        except ValueError as error:
            return [Problem("rollout.env_kwargs", str(error))]
    else:  # they refine each prompt's own env: the built-in ones are ToolEnvs
        try:
            if "tools" in cfg.env_kwargs:
                check_tool_entries(cfg.env_kwargs["tools"], "rollout.env_kwargs")
        except ValueError as error:
            return [Problem("rollout.env_kwargs.tools", str(error))]
        try:
            check_tool_env_kwargs(cfg.env_kwargs, "a prompt's env")
        except ValueError as error:
            return [Problem("rollout.env_kwargs", str(error))]
    if "tool_format" in cfg.env_kwargs:
        return _unknown("rollout.env_kwargs.tool_format", FORMATS, cfg.env_kwargs["tool_format"])
    return []


def _algorithm_problems(cfg: AlgorithmConfig) -> list[Problem]:
    estimator = _unknown("algorithm.estimator", ADVANTAGE_ESTIMATORS, cfg.estimator)
    problems = estimator + _unknown("algorithm.kl_estimator", KL_ESTIMATORS, cfg.kl_estimator)
    if not estimator and not cfg.use_advantage_mask and estimator_ignores_advantage_mask(cfg.estimator):
        problems.append(Problem("algorithm.use_advantage_mask",
                                f"algorithm.use_advantage_mask=false changes nothing for estimator {cfg.estimator!r}: "
                                "its advantage is the episode's score, a sum of rewards on action tokens either way"))
    if not estimator:
        problems += _options_problems("algorithm.estimator_options", ADVANTAGE_ESTIMATORS, cfg.estimator,
                                      cfg.estimator_options)
    return problems


def _options_problems(key: str, registry: Registry, name: str, options: dict[str, Any]) -> list[Problem]:
    """The options of registered item `name` must fit the settings model it was registered with."""
    try:
        registry.settings(name, options)
    except ValidationError as error:
        found = error.errors(include_url=False)
        return [Problem(f"{key}.{'.'.join(map(str, e['loc']))}" if e["loc"] else key,
                        f"{registry.kind} {name!r}: {e['msg']} (got {e.get('input')!r})") for e in found]
    except ValueError as error:
        return [Problem(key, str(error))]
    return []


def check_runnable(config: PipelineConfig, source: str = "config", overrides: Sequence[str] = (),
                   policy_source: bool = True) -> PipelineConfig:
    """Return `config` if this machine has what it needs to run it; else ConfigError naming the fix.

    Checked before a Prefect server starts or a run folder is made, so a bad path leaves nothing
    behind: the checkpoint the initial policy is copied from (`policy_source=False` skips it, for a
    run that has copied it already), vLLM's virtualenv when the engine is vllm, and the `device`
    (a CUDA device this machine lacks), and an agent program's command (its executable and script).
    """
    problems = _data_root_problems(config.data_root)
    problems += (_policy_problems(config) if policy_source else []) + _cluster_problems(config)
    try:
        resolve_device(config.device)
    except DeviceError as error:
        problems.append(Problem("device", str(error)))
    if config.rollout.env == PROGRAM_ENV and (why := ProgramSpec.from_env_kwargs(config.rollout.env_kwargs)
                                              .missing(os.getcwd())) is not None:
        problems.append(Problem("rollout.env_kwargs.command", why))
    engine = config.rollout.engine
    if engine in ENGINES and not config.cluster.replica_urls:  # external servers need nothing here
        if (why := engine_traits(engine).unavailable(config.rollout)) is not None:
            problems.append(Problem("rollout.engine", why))
    if problems:
        raise config_error(problems, source, overrides)
    return config


def _data_root_problems(data_root: str) -> list[Problem]:
    """The data root is a folder, or a path whose first existing ancestor is one (it is made then):
    `/dev/null` or a file would otherwise fail late, after the Prefect server tried to live in it."""
    for path in (Path(data_root), *Path(data_root).parents):
        if path.exists() or path.is_symlink():
            if path.is_dir():
                return []
            what = f"{data_root} is not a folder" if path == Path(data_root) else f"{path}, above it, is not a folder"
            return [Problem("data_root", f"{what}; the data root must be a folder (or not exist yet)")]
    return []


def _cluster_problems(config: PipelineConfig) -> list[Problem]:
    """A cluster section that cannot work: Ray missing, replicas or workers without a cluster,
    external servers for an engine other than vllm."""
    cluster, problems = config.cluster, []
    if cluster.address is None:
        for key, value in (("rollout_replicas", cluster.rollout_replicas), ("trainer_workers", cluster.trainer_workers)):
            if value > 1:
                problems.append(Problem(f"cluster.{key}", f"cluster.{key}={value} needs a cluster: set cluster.address "
                                                          "(local, auto or ray://host:port; docs/scale-out.md)"))
        if cluster.replica_urls:
            problems.append(Problem("cluster.replica_urls", "cluster.replica_urls needs cluster.address (docs/scale-out.md)"))
    elif importlib.util.find_spec("ray") is None:
        problems.append(Problem("cluster.address", 'cluster.address is set but Ray is not installed: '
                                                   'pip install -e ".[ray]"'))
    engine = config.rollout.engine
    if cluster.replica_urls and engine in ENGINES and not engine_traits(engine).external_servers:
        servers = ", ".join(n for n in ENGINES.names() if engine_traits(n).external_servers)
        problems.append(Problem("cluster.replica_urls", f"engine {engine!r} cannot use external replica servers; "
                                                        f"set rollout.engine to one that can: {servers}"))
    return problems


def _policy_problems(config: PipelineConfig) -> list[Problem]:
    policy = config.policy
    if policy.source == "path" and not policy.path:
        return [Problem("policy.path", "policy.source=path needs policy.path: a local transformers checkpoint folder")]
    directory = policy_source_dir(policy.source, policy.path)
    if directory is None:
        return []
    key = "policy.path" if policy.path else "policy.source"
    if policy.source == "smollm2" and not directory.exists():
        return [Problem(key, f"SmolLM2 checkpoint not found at {directory}: run `make smollm2` first "
                             "(or set policy.path to a converted SmolLM2 folder)")]
    if not directory.exists() and _HUB_ID.match(str(policy.path)):
        return [Problem(key, f"{policy.path!r} is not a local folder; it looks like a Hugging Face Hub id, and runs "
                             "load local checkpoints only (they are offline): download it first, e.g. "
                             f"`huggingface-cli download {policy.path} --local-dir models/{policy.path.split('/')[-1]}`, "
                             "and set policy.path to that folder")]
    try:
        check_checkpoint(directory)
    except CheckpointError as error:
        return [Problem(key, f"{error} (policy.path must be a local transformers checkpoint folder)")]
    return []
