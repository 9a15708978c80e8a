"""Example: a tool in one file. The guide docs/guides/write-a-tool.md walks through it.

Use it in a run: the commands of the guide's section 3, from the checkout's root (tests/test_guides.py
runs them as written).
"""

from typing import Literal

from agent_core.envs.tools import TOOLS, ToolResult, function_tool

_TO_METRES = {"m": 1.0, "km": 1000.0, "mi": 1609.344, "ft": 0.3048}


@function_tool(timeout_s=1.0)
def unit_convert(value: float, source: Literal["m", "km", "mi", "ft"], target: Literal["m", "km", "mi", "ft"]) -> ToolResult:
    """Convert a length from one unit to another.

    Args:
        value: The length to convert.
        source: The unit `value` is in.
        target: The unit to convert to.
    """
    converted = value * _TO_METRES[source] / _TO_METRES[target]
    # A process reward is optional; here a no-op conversion is mildly discouraged.
    return ToolResult(text=f"{converted:.6g} {target}", reward=-0.01 if source == target else 0.0)


@TOOLS.register("unit_convert")
def make_unit_convert(resources):
    """The registry holds factories: (resources, **kwargs) -> Tool. This tool needs no resources."""
    return unit_convert
