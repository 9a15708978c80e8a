"""The OpenAI-compatible gateway: a black-box agent's completions, served by the run's engine and
recorded as the steps of its episode (docs/architecture.md, "The gateway").

server.py: the HTTP server (`Gateway`); core.py: episodes, tokens, one completion, the record of a
call; openai_format.py: OpenAI requests and responses; steps.py: calls -> `StepRecord`s;
program_rollout.py: env `agent_program`'s rollout (programs run against the gateway).
"""

from agent_core.gateway.core import EpisodeCalls, GatewayCall, GatewayCore, GatewayError, GatewayLimits
from agent_core.gateway.server import Gateway

__all__ = ["EpisodeCalls", "Gateway", "GatewayCall", "GatewayCore", "GatewayError", "GatewayLimits"]
