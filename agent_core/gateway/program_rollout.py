"""Env `agent_program`'s rollout: the agent's own program, run once per (prompt, sample), talking to
the run's engine through the gateway; its calls become the episode's steps.

For each episode the gateway opens a bearer token, the program gets it as OPENAI_API_KEY with
OPENAI_BASE_URL (and as ANTHROPIC_API_KEY with ANTHROPIC_BASE_URL), AGENTR1_EPISODE_ID and AGENTR1_CORPUS (the dataset's corpus Parquet, when there is
one), and the prompt on stdin as JSON: {"prompt_id", "messages", "env_kwargs", "metadata"} (never
the gold answers). `run_programs` (agent_core/envs/agent_program.py) runs them, bounded and time
limited, each in `settings.jail` (the data root hidden but for the corpus; own PID namespace and
/proc, so no sibling reads its token); as each program ends its episode is finished (its token stops working) and its calls turn
into steps (agent_core/gateway/steps.py). A program that fails is a failed episode, never a failed
rollout; one that failed before its first call leaves one step with no action (`_no_action_steps`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from agent_core.envs.agent_program import ProgramJail, ProgramJob, ProgramOutcome, ProgramSpec, run_programs
from agent_core.envs.tool_env import ChatCapabilities
from agent_core.gateway.core import EpisodeCalls
from agent_core.gateway.server import Gateway, GatewayLimits
from agent_core.gateway.steps import EpisodeEnd, steps_from_calls
from agent_core.progress import report
from agent_core.rollout.agent_loop import opening_anchor
from agent_core.rollout.chat import encode_conversation
from agent_core.rollout.engine import Engine, SamplingParams
from agent_core.rollout.records import EpisodeIdentity, StepRecord, no_action_step
from agent_core.types import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProgramRollout:
    """One rollout's settings: the loop's budgets (max_calls = rollout.max_steps), ids, where the corpus is."""

    group_size: int
    max_calls: int
    max_context_tokens: int
    policy_version: int
    episode_prefix: str = ""
    corpus_path: str | None = None
    honor_request_sampling: bool = False
    jail: ProgramJail | None = None
    preflight: bool = False  # run the first episode alone first; one that fails before any call stops here


class PreflightError(RuntimeError):
    """The preflight episode failed before its first call: every episode would (a command that does not
    start, a first request over the context); said in one line, before the others run."""


def run_program_episodes(engine: Engine, tokenizer, prompts: Sequence[Prompt], spec: ProgramSpec,
                         sampling: SamplingParams, settings: ProgramRollout,
                         chat: ChatCapabilities | None = None) -> list[StepRecord]:
    """`group_size` episodes per prompt, each a run of the program (module docstring); their steps
    in episode order (prompt by prompt, sample by sample), like the agent loop's."""
    identities = [EpisodeIdentity(f"{settings.episode_prefix}{p.prompt_id}-s{k}", f"{settings.episode_prefix}{p.prompt_id}",
                                  p.prompt_id, k, settings.policy_version)
                  for p in prompts for k in range(settings.group_size)]
    prompt_of = {identity.episode_id: p for identity, p in zip(identities, _repeat(prompts, settings.group_size))}
    limits = GatewayLimits(settings.max_calls, settings.max_context_tokens, settings.honor_request_sampling)
    steps: dict[str, list[StepRecord]] = {}
    failed_early: list[tuple[EpisodeIdentity, EpisodeEnd]] = []
    started = time.perf_counter()
    with Gateway(engine, tokenizer, sampling, limits, chat) as gateway:
        tokens = {identity.episode_id: gateway.open_episode(identity.episode_id) for identity in identities}
        by_id = {identity.episode_id: identity for identity in identities}
        lock = threading.Lock()

        def on_done(outcome: ProgramOutcome) -> None:
            calls = gateway.finish_episode(tokens[outcome.key])  # its token stops working now
            end = _end_of(outcome)
            records = steps_from_calls(by_id[outcome.key], calls, end, tokenizer)
            with lock:
                steps[outcome.key] = records
                if not records:
                    failed_early.append((by_id[outcome.key], _no_call_end(end, calls)))
            report(1, total=len(identities))

        def on_start(job: ProgramJob) -> None:  # the engine queue may now wait for its first request
            gateway.program_started(tokens[job.key])

        jobs = [ProgramJob(identity.episode_id, _stdin(prompt_of[identity.episode_id]),
                           _environment(gateway, tokens[identity.episode_id], identity.episode_id,
                                        settings.corpus_path))
                for identity in identities]
        # a jailed program's own network holds one port: its gateway's, forwarded to the Unix socket
        jail = settings.jail and replace(settings.jail, gateway_port=gateway.port, gateway_socket=gateway.unix_socket)
        outcomes = []
        if settings.preflight:
            outcomes = run_programs(spec, jobs[:1], on_done, jail, on_start)
            if failed_early:
                raise PreflightError(f"agent_program preflight: the first episode ({jobs[0].key}) failed before any "
                                     f"call: {failed_early[0][1].failure}")
            jobs = jobs[1:]
        for job in jobs[:spec.max_parallel]:  # these start at once: counted before any runs, since one worker's
            on_start(job)                     # on_start can come after another's program already asked
        outcomes += run_programs(spec, jobs, on_done, jail, on_start)
    _say_missing_layers(outcomes)
    failures = [o for o in outcomes if o.failure is not None]
    if failures:
        log.warning("agent_program: %d of %d programs failed; first: %s: %s", len(failures), len(outcomes),
                    failures[0].key, failures[0].failure)
    for identity, records in _no_action_steps(tokenizer, failed_early, prompt_of):
        steps[identity.episode_id] = records
    log.info("agent_program rollout: %d episodes, %d steps in %.1fs", len(identities),
             sum(len(r) for r in steps.values()), time.perf_counter() - started)
    return [record for identity in identities for record in steps[identity.episode_id]]


def _say_missing_layers(outcomes: Sequence[ProgramOutcome]) -> None:
    """One warning per rollout naming each isolation layer the kernel refused, and why."""
    refused = {layer: why for o in outcomes if o.jail is not None for layer, why in o.jail.refused}
    if refused:
        log.warning("agent_program: programs ran without isolation layer(s) %s",
                    "; ".join(f"{layer} ({why})" for layer, why in sorted(refused.items())))
    elif any(o.jail is not None for o in outcomes):
        log.info("agent_program: programs isolated (%s)", ", ".join(next(o.jail.layers for o in outcomes if o.jail)))


def _repeat(prompts: Sequence[Prompt], times: int) -> list[Prompt]:
    return [p for p in prompts for _ in range(times)]


def _stdin(prompt: Prompt) -> dict[str, Any]:
    """What the program reads on stdin: the prompt, never its answers."""
    return {"prompt_id": prompt.prompt_id, "messages": [m.as_dict() for m in prompt.messages],
            "env_kwargs": dict(prompt.env_kwargs), "metadata": dict(prompt.metadata)}


def _environment(gateway: Gateway, token: str, episode_id: str, corpus_path: str | None) -> dict[str, str]:
    env = {"OPENAI_BASE_URL": gateway.base_url, "OPENAI_API_KEY": token, "ANTHROPIC_BASE_URL": gateway.root_url,
           "ANTHROPIC_API_KEY": token, "AGENTR1_EPISODE_ID": episode_id}
    if corpus_path:
        env["AGENTR1_CORPUS"] = corpus_path
    return env


def _end_of(outcome: ProgramOutcome) -> EpisodeEnd:
    info: dict[str, Any] = {"program_seconds": round(outcome.seconds, 3), "program_returncode": outcome.returncode}
    if outcome.failure is not None and outcome.stderr_tail:
        info["program_stderr_tail"] = outcome.stderr_tail[-1000:]
    return EpisodeEnd(outcome.answer, outcome.failure, info, outcome.agent_rewards)


def _no_call_end(end: EpisodeEnd, calls: EpisodeCalls) -> EpisodeEnd:
    """A program that made no call failed, whatever it printed: there is no action of the policy to
    credit. A refused first request is the cause to name first (the program's own failure follows it)."""
    if calls.refusal is not None:
        then = f" (then the program failed: {end.failure})" if end.failure else ""
        return replace(end, failure=f"the gateway served no call: it refused the first request: {calls.refusal}{then}")
    if end.failure is not None:
        return end
    return replace(end, failure="the program made no call to the gateway")


def _no_action_steps(tokenizer, failed: list[tuple[EpisodeIdentity, EpisodeEnd]],
                     prompt_of) -> list[tuple[EpisodeIdentity, list[StepRecord]]]:
    """One step for each episode whose program failed before any call: the opening it was given and
    no action (nothing of the policy's to credit or train), ending with the failure."""
    results = []
    for identity, end in sorted(failed, key=lambda item: item[0].episode_id):
        head = encode_conversation(tokenizer, prompt_of[identity.episode_id].messages)
        info = {"gateway": True, "gateway_calls": 0, "error": end.failure, **end.info}
        results.append((identity, [no_action_step(identity, head, info=info, anchor=opening_anchor(head))]))
    return results
