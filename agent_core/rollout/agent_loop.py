"""The multi-step agent loop: many episodes against one engine, one step = one LLM call + env answer.

Scheduling is event-driven: every unfinished episode's next request is in flight, so one slow tool or long
episode does not stall the others; env steps run in `env_workers` threads and ready episodes go out together
as one `generate` call (dispatch rules, `straggler_wait_s`: design notes). Nothing an env or the model
produces escapes as an exception. What one step does to its episode is agent_core/rollout/episode_steps.py.
Design notes: docs/architecture.md §11 (agent_core/rollout/agent_loop.py).
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from agent_core.envs.base import AgentEnv, EnvStep
from agent_core.failpoints import failpoint
from agent_core.progress import report
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Engine, Generation, SamplingParams, concurrent_calls
from agent_core.rollout.episode_steps import (  # LoopSettings, TRUNCATIONS, opening_anchor: re-exported
    TRUNCATIONS, LiveEpisode, LoopSettings, advance, fits, opening_anchor, start_episodes,
)
from agent_core.rollout.observation_encoder import ObservationEncoder
from agent_core.rollout.records import storable_env_step
from agent_core.types import Prompt

__all__ = ["TRUNCATIONS", "LoopSettings", "RolloutTimings", "opening_anchor", "run_episodes"]

log = logging.getLogger(__name__)


@dataclass
class RolloutTimings:
    """Seconds of a rollout during which no generate call was in flight (the engine idle), by what
    the loop was doing. Work done while a call is in flight (with a concurrent engine, another
    call's episodes) costs the engine nothing and is not counted; what no field covers (scheduling,
    thread hand-offs, the caller's own set-up) is the rest of the rollout's time outside generate.
    """

    index_seconds: float = 0.0  # building the search index (set by the caller that builds it: the agent_loop driver, agent_core/drivers/loop.py)
    start_seconds: float = 0.0  # envs built and reset, opening conversations encoded
    decode_seconds: float = 0.0  # actions decoded to text
    env_wait_seconds: float = 0.0  # waiting for env steps (tool calls) to finish, the straggler wait included
    encode_seconds: float = 0.0  # observations encoded into the next contexts, steps recorded


def run_episodes(
    engine: Engine,
    tokenizer,
    prompts: Sequence[Prompt],
    make_env: Callable[[Prompt], AgentEnv],
    sampling: SamplingParams,
    settings: LoopSettings,
    timings: RolloutTimings | None = None,
) -> list[StepRecord]:
    """Roll out `group_size` episodes per prompt to the end; return their steps in episode order.
    `timings`, if given, gets the loop's time outside generate added to it (module docstring)."""
    timings = RolloutTimings() if timings is None else timings
    started = time.perf_counter()
    episodes = start_episodes(tokenizer, prompts, make_env, settings)
    timings.start_seconds += time.perf_counter() - started
    for ep in episodes:
        if not fits(ep.current_ids, sampling, settings):  # nothing could ever be generated
            raise ValueError(
                f"prompt {ep.prompt.prompt_id!r} is {len(ep.current_ids)} tokens; with max_new_tokens="
                f"{sampling.max_new_tokens} it exceeds max_context_tokens={settings.max_context_tokens}"
            )
    _Scheduler(engine, tokenizer, sampling, settings, episodes, timings).run()
    return [record for ep in episodes for record in ep.records]


class _Scheduler:
    """The event loop of one rollout (module docstring).

    Episode state, contexts and the tokenizer are touched only on the calling thread; worker
    threads run nothing but `engine.generate` (a concurrent engine's) and `env.step`, so no episode
    needs a lock.
    """

    def __init__(self, engine: Engine, tokenizer, sampling: SamplingParams, settings: LoopSettings,
                 episodes: list[LiveEpisode], timings: RolloutTimings):
        self.engine, self.tokenizer, self.sampling, self.settings = engine, tokenizer, sampling, settings
        self.episodes, self.timings = episodes, timings
        self.encoder = ObservationEncoder(tokenizer)
        self.slots = concurrent_calls(engine)
        self.started = self.slot_free_since = time.perf_counter()
        for ep in episodes:
            ep.ready_since = self.started
        self.ready: list[LiveEpisode] = list(episodes)
        self.generating: dict[Future, tuple[list[LiveEpisode], list[float]]] = {}  # call -> (episodes, queue seconds)
        self.stepping: dict[Future, tuple[LiveEpisode, Generation, str, dict]] = {}  # env step -> its episode's step
        self.calls = self.finished = self.steps = 0
        self.generated_tokens = 0
        # once per rollout: it builds the tokenizer's whole vocabulary dict (~0.1 ms for 400 tokens, more for real ones)
        self.end_of_turn_ids = frozenset(eos_token_ids(tokenizer))

    def run(self) -> None:
        engine_pool = (ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="agentr1-generate")
                       if self.slots > 1 else None)  # a one-call engine runs on this thread (module docstring)
        env_pool = ThreadPoolExecutor(max_workers=self.settings.env_workers, thread_name_prefix="agentr1-env")
        try:
            while self.ready or self.generating or self.stepping:
                timeout = self._dispatch(engine_pool)
                engine_idle, waiting_since = not self.generating, time.perf_counter()
                done, _ = wait([*self.generating, *self.stepping], timeout=timeout, return_when=FIRST_COMPLETED)
                if engine_idle:  # nothing generating: only env steps could be waited for
                    self.timings.env_wait_seconds += time.perf_counter() - waiting_since
                for future in done:
                    if future in self.generating:
                        self._on_generated(future, env_pool)
                    else:
                        self._on_env_step(future)
        finally:
            # normally both pools are idle here; after an error (a dead engine server) queued work is
            # dropped and running work is not waited for, so the error reaches the caller at once
            if engine_pool is not None:
                engine_pool.shutdown(wait=False, cancel_futures=True)
            env_pool.shutdown(wait=False, cancel_futures=True)
        log.info("rollout done: %d episodes, %d steps, %d generate calls in %.1fs", len(self.episodes),
                 self.steps, self.calls, time.perf_counter() - self.started)

    def _dispatch(self, engine_pool: ThreadPoolExecutor | None) -> float | None:
        """Send the ready episodes as one call if a slot is free and the rules allow (module docstring).

        Returns how long to wait for a finished call or env step before deciding again (None: until one
        finishes, since nothing but a finished future can change the decision).
        """
        if not self.ready or len(self.generating) >= self.slots:
            return None
        now = time.perf_counter()
        if self.slots == 1 and self.stepping:  # (a) does not hold: wait for stragglers, but not past (b)
            waiting_since = max(self.slot_free_since, min(ep.ready_since for ep in self.ready))
            deadline = waiting_since + self.settings.straggler_wait_s
            if now < deadline:
                return deadline - now if math.isfinite(deadline) else None
        batch = sorted(self.ready, key=lambda ep: ep.index)  # episode order: a lock-step run repeats exactly
        self.ready = []
        seed = None if self.sampling.seed is None else self.sampling.seed + self.calls
        call = (_timed_generate, self.engine, [ep.current_ids for ep in batch], replace(self.sampling, seed=seed),
                [ep.episode_id for ep in batch])
        future = _run_here(*call) if engine_pool is None else engine_pool.submit(*call)
        self.generating[future] = (batch, [now - ep.ready_since for ep in batch])
        self.calls += 1
        return None

    def _on_generated(self, future: Future, env_pool: ThreadPoolExecutor) -> None:
        """Hand each action of a finished call to its env (raises the engine's error, if any)."""
        batch, queued = self.generating.pop(future)
        self.slot_free_since = time.perf_counter()
        generations, seconds = future.result()
        returned_at = time.time()
        decoding_since = time.perf_counter()
        texts = self.tokenizer.batch_decode([gen.token_ids for gen in generations], skip_special_tokens=True)
        if not self.generating:
            self.timings.decode_seconds += time.perf_counter() - decoding_since
        for ep, gen, queue_seconds, action_text in zip(batch, generations, queued, texts):
            timing = {"generate_seconds": round(seconds, 6), "queue_seconds": round(queue_seconds, 6),
                      "generated_at": returned_at}  # a column of its own, not info (episode_steps.advance)
            self.stepping[env_pool.submit(_env_step, ep.env, action_text)] = (ep, gen, action_text, timing)
        self.generated_tokens += sum(len(gen.token_ids) for gen in generations)
        log.debug("generate call %d back: %d episodes in %.2fs", self.calls, len(batch), seconds)

    def _on_env_step(self, future: Future) -> None:
        """Record the step; the episode is ready again unless it ended."""
        ep, gen, action_text, timing = self.stepping.pop(future)
        outcome = future.result()  # never raises: _env_step turns env errors into an "error" ending
        outcome.info.update(timing)
        self.steps += 1
        encoding_since = time.perf_counter()
        goes_on = advance(ep, gen, action_text, outcome, self.tokenizer, self.encoder, self.sampling, self.settings,
                          self.end_of_turn_ids)
        if not self.generating:
            self.timings.encode_seconds += time.perf_counter() - encoding_since
        if goes_on:
            ep.ready_since = time.perf_counter()
            self.ready.append(ep)
        else:
            self.finished += 1
            elapsed = time.perf_counter() - self.started
            report(1, total=len(self.episodes), steps=self.steps,
                   **{"tokens/s": self.generated_tokens / elapsed if elapsed > 0 else math.nan})


def _run_here(fn, *args) -> Future:
    """`fn(*args)` run now on this thread, as a finished Future holding its result or its exception
    (so the loop treats it like a call that ran on the engine pool)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as error:
        future.set_exception(error)
    return future


def _timed_generate(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                    episode_ids: list[str]) -> tuple[list[Generation], float]:
    """(generations, wall seconds of the call); runs on an engine thread or the loop's own (`_run_here`).
    An engine that routes by session (`routes_sessions`, agent_core/cluster) is told each prompt's episode."""
    failpoint("engine:generate")  # a crash mid-rollout, whichever engine
    started = time.perf_counter()
    if getattr(engine, "routes_sessions", False):
        generations = engine.generate(prompts, params, sessions=episode_ids)
    else:
        generations = engine.generate(prompts, params)
    if len(generations) != len(prompts):  # zip would silently drop episodes
        raise RuntimeError(f"engine returned {len(generations)} generations for {len(prompts)} prompts")
    return generations, time.perf_counter() - started


def _env_step(env: AgentEnv, action_text: str) -> EnvStep:
    """The env's answer; an env that raises, or answers with something the steps table cannot hold,
    ends its episode with termination "error"."""
    started = time.perf_counter()
    try:
        outcome = storable_env_step(env.step(action_text))
    except Exception as error:  # an env bug must not take down the other episodes of the rollout
        log.warning("env %s raised %s: %s", type(env).__name__, type(error).__name__, error)
        outcome = EnvStep(
            observation="", reward=0.0, done=True, termination="error",
            info={"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(limit=20)},
        )
    outcome.info.setdefault("env_seconds", round(time.perf_counter() - started, 6))
    return outcome
