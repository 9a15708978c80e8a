"""Rollout drivers by name: how an env's episodes are rolled out (docs/architecture.md §4, "Where to add what").

`roll_out` is the one entry point training, the warm start, eval and the benchmarks call; each env
names its driver when registered (`ENVS.register(name, traits=EnvTraits(driver=...))`, default `agent_loop`).
Importing this package registers the built-in drivers.
"""

from agent_core.drivers.base import DRIVERS, DataAccess, RolloutDriver, RolloutRequest, roll_out
from agent_core.drivers import loop, program  # noqa: F401  (importing them registers the built-in drivers)

__all__ = ["DRIVERS", "DataAccess", "RolloutDriver", "RolloutRequest", "roll_out"]
