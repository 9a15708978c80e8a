"""Environments and tools. Importing the package registers the built-in tools in
`agent_core.envs.tools.TOOLS` (search and calculator, and the sandboxed python tool), so any import
of an envs module sees them; here rather than in `tools` because those modules import `tools`."""

from agent_core.envs import builtin_tools as _builtin_tools  # noqa: F401  (registers search, calculator)
from agent_core.envs import sandbox as _sandbox  # noqa: F401  (registers python)
