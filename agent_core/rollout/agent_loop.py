"""The multi-step agent loop: many episodes against one engine, one step = one LLM call + env answer.

Scheduling is event-driven, so every unfinished episode's next request is in flight and one slow
tool or long episode does not stall the others (docs/architecture.md §6). An engine taking N > 1
calls at once (`concurrent_calls`: a server batching across calls) gets a pool of N threads; a
one-call engine (hf) runs on the calling thread: on a second thread torch would give it a second
OpenMP team, and two teams on 2 cores ran hf generate 35% slower (bench/rollout.py). Env steps
(tool calls) run in a pool of `env_workers` threads, so tools run while the engine generates.
The calling thread waits for whichever call or env step finishes first, applies it to its episode,
and dispatches: when an engine slot is free, all ready episodes go out as one `generate` call if
  (a) no env step is pending (nothing else could join the call), or
  (b) the engine has been free with episodes ready for `straggler_wait_s` (a straggler tool does
      not hold up the others longer than that, counted from when a call could first be sent), or
  (c) the engine takes concurrent calls (it batches across calls itself, so waiting gains nothing).
Rules (a) and (b) keep the serial engine's batches large: fast tools come back within
milliseconds of each other, and without the wait the first episode back would be generated alone
while the rest queue behind it. With a serial engine and a large `straggler_wait_s` every call
holds all unfinished episodes (lock-step turns), in episode order, so seeded sampling is
reproducible run to run; otherwise which episodes share a call depends on timing. Call n (from 0)
samples with seed `sampling.seed + n`. An exception from `generate` ends the rollout at once
(queued work is cancelled, running work is not waited for).

Each step's info records `env_seconds` (the env step), `generate_seconds` (the generate call that
produced its action) and `queue_seconds` (how long the episode waited ready before that call).
`RolloutTimings` adds up what the loop did while no call was in flight (bench/rollout.py). To keep
that small, a call's actions are decoded in one batched call and an observation is encoded with one
tokenizer call (`ObservationEncoder` renders the template's glue once per kind of observation).

Contexts are token ids end to end: the next context is built by `agent_core.rollout.context` from
the exact ids of the previous context, the sampled action and the rendered observation, never from
re-encoded text (docs/architecture.md §6). The ids each call received are recorded as the step's prompt_ids.

Budgets belong to the loop, not to envs: an episode ends when the env says done ("answered"), when
the env raises or answers with an unusable EnvStep ("error"; the exception is recorded in info and
the rollout goes on), after `max_steps` LLM calls ("max_steps") or when the next context plus one
action would not fit in `max_context_tokens` ("max_context"). The last two are truncations (the
agent was cut off, the task did not end) and are recorded with truncated=True. Tool-call budgets
(per action, per episode) and per-call timeouts are the env's: the loop only sees text.

Nothing an env or the model produces escapes as an exception: text is made UTF-8-safe and JSON
columns storable (`agent_core.rollout.records`) before anything reaches the tokenizer or a table,
so one bad sample ends at most its own episode, never the rollout (tests/test_fuzz_agent_loop.py).

Each step records the anchor of the state it STARTS from (GiGPO, agent_core/algos/gigpo.py): step 0
the opening context's token ids, hashed (the state every episode of a group shares), step t the
`anchor` the env returned with step t-1 (None if it gave none).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Sequence

from agent_core.envs.base import AgentEnv, EnvStep
from agent_core.failpoints import failpoint
from agent_core.progress import report
from agent_core.rollout.chat import encode_conversation, eos_token_ids
from agent_core.rollout.context import ContextPolicy, EpisodeContext, extends, truncate_text
from agent_core.rollout.engine import Engine, Generation, SamplingParams, concurrent_calls
from agent_core.rollout.observation_encoder import ObservationEncoder
from agent_core.rollout.records import StepRecord, json_text, storable_env_step
from agent_core.types import ChatMessage, Prompt

log = logging.getLogger(__name__)

TRUNCATIONS = ("max_steps", "max_context")


@dataclass(frozen=True)
class LoopSettings:
    """How one rollout runs.

    straggler_wait_s: with a serial engine (one `generate` call at a time), how long a free engine
        waits for pending env steps (tool calls) before generating for the episodes already ready.
        Fast tools then share one call; a slow tool delays the others by at most this much per step.
        Large (float("inf") works) means lock-step turns: every call holds all unfinished episodes,
        which makes seeded sampling reproducible run to run. Engines that take concurrent calls
        never wait (module docstring).
    """

    group_size: int
    max_steps: int
    max_context_tokens: int
    policy_version: int
    episode_prefix: str = ""  # makes episode ids unique across runs and iterations
    context: ContextPolicy = field(default_factory=ContextPolicy)
    env_workers: int = 8  # threads running env steps (tool calls) concurrently
    straggler_wait_s: float = 2.0  # see the class docstring


@dataclass
class RolloutTimings:
    """Seconds of a rollout during which no generate call was in flight (the engine idle), by what
    the loop was doing. Work done while a call is in flight (with a concurrent engine, another
    call's episodes) costs the engine nothing and is not counted; what no field covers (scheduling,
    thread hand-offs, the caller's own set-up) is the rest of the rollout's time outside generate.
    """

    index_seconds: float = 0.0  # building the search index (set by the caller that builds it: tasks._common.roll_out)
    start_seconds: float = 0.0  # envs built and reset, opening conversations encoded
    decode_seconds: float = 0.0  # actions decoded to text
    env_wait_seconds: float = 0.0  # waiting for env steps (tool calls) to finish, the straggler wait included
    encode_seconds: float = 0.0  # observations encoded into the next contexts, steps recorded


@dataclass
class _Episode:
    index: int  # position in the rollout: the order of episodes within a generate call
    episode_id: str
    group_id: str
    prompt: Prompt
    sample_idx: int
    env: AgentEnv
    context: EpisodeContext
    current_ids: list[int]
    step_idx: int = 0
    records: list[StepRecord] = field(default_factory=list)
    ready_since: float = 0.0  # perf_counter time its current context became ready to generate from
    anchor: str | None = None  # the anchor of the state its next step starts from (module docstring)


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
    episodes = _start_episodes(tokenizer, prompts, make_env, settings)
    timings.start_seconds += time.perf_counter() - started
    for ep in episodes:
        if not _fits(ep.current_ids, sampling, settings):  # nothing could ever be generated
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
                 episodes: list[_Episode], timings: RolloutTimings):
        self.engine, self.tokenizer, self.sampling, self.settings = engine, tokenizer, sampling, settings
        self.episodes, self.timings = episodes, timings
        self.encoder = ObservationEncoder(tokenizer)
        self.slots = concurrent_calls(engine)
        self.started = self.slot_free_since = time.perf_counter()
        for ep in episodes:
            ep.ready_since = self.started
        self.ready: list[_Episode] = list(episodes)
        self.generating: dict[Future, tuple[list[_Episode], list[float]]] = {}  # call -> (episodes, queue seconds)
        self.stepping: dict[Future, tuple[_Episode, Generation, str, dict]] = {}  # env step -> its episode's step
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
                      "generated_at": returned_at}  # a column of its own, not info (_advance)
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
        goes_on = _advance(ep, gen, action_text, outcome, self.tokenizer, self.encoder, self.sampling, self.settings,
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


def _start_episodes(tokenizer, prompts, make_env, settings: LoopSettings) -> list[_Episode]:
    episodes = []
    heads: dict[tuple, list[int]] = {}  # a group's episodes usually open with the same conversation
    for prompt in prompts:
        for sample_idx in range(settings.group_size):
            env = make_env(prompt)
            messages, tools = tuple(env.reset(prompt)), _template_tools(env)
            key = (messages, json.dumps(tools, default=repr) if tools else None)
            if key not in heads:
                heads[key] = encode_conversation(tokenizer, messages, tools=tools)
            head = heads[key]
            group_id = f"{settings.episode_prefix}{prompt.prompt_id}"
            episodes.append(_Episode(
                index=len(episodes), episode_id=f"{group_id}-s{sample_idx}", group_id=group_id, prompt=prompt,
                sample_idx=sample_idx, env=env, context=EpisodeContext(head=list(head)), current_ids=list(head),
                anchor=opening_anchor(head),
            ))
    return episodes


def opening_anchor(head: list[int]) -> str:
    """The anchor of an episode's first state: a hash of its opening context's token ids."""
    digest = hashlib.blake2b(json.dumps(head).encode(), digest_size=8).hexdigest()
    return f"start:{digest}"


def _fits(context_ids: list[int], sampling: SamplingParams, settings: LoopSettings) -> bool:
    """Room for the context plus one full action."""
    return len(context_ids) + sampling.max_new_tokens <= settings.max_context_tokens


def _advance(ep: _Episode, gen: Generation, action_text: str, outcome: EnvStep, tokenizer,
             encoder: ObservationEncoder, sampling: SamplingParams, settings: LoopSettings,
             end_of_turn_ids: frozenset[int]) -> bool:
    """Apply one generation and the env's answer to its episode; return True if the episode goes on."""
    termination = outcome.termination if outcome.done else None
    generated_at = outcome.info.pop("generated_at", time.time())
    messages = _observation_messages(ep.env, outcome, tokenizer, settings)
    observation = "\n".join(m.content for m in messages)
    next_ids: list[int] | None = None
    if not outcome.done:
        # a stop token other than end-of-turn (e.g. "</search>") would leave the turn open
        ended_with_eos = bool(gen.token_ids) and gen.token_ids[-1] in end_of_turn_ids
        observation_ids = encoder.encode(messages, ended_with_eos, tools=_template_tools(ep.env))
        ep.context.add_turn(gen.token_ids, observation_ids)
        next_ids = ep.context.ids(settings.context)
        if ep.step_idx + 1 >= settings.max_steps:
            termination = "max_steps"
        elif not _fits(next_ids, sampling, settings):
            termination = "max_context"
    done = termination is not None
    prefix_shared = not done and extends(next_ids, ep.current_ids + list(gen.token_ids))
    ep.records.append(_record(ep, gen, action_text, outcome, observation, termination, prefix_shared, settings,
                              generated_at))
    ep.anchor = outcome.anchor  # the state the next step starts from
    if done:
        return False
    ep.current_ids = next_ids
    ep.step_idx += 1
    return True


def _template_tools(env: AgentEnv) -> list[dict] | None:
    return getattr(env, "tools_for_template", None)


def _observation_messages(env: AgentEnv, outcome: EnvStep, tokenizer, settings: LoopSettings) -> list[ChatMessage]:
    """The observation as messages, each cut to max_observation_tokens (the cut is noted in info)."""
    messages = list(outcome.observation_messages) or [ChatMessage(env.observation_role, outcome.observation)]
    limit, total_cut = settings.context.max_observation_tokens, 0
    for i, message in enumerate(messages):
        text, cut = truncate_text(tokenizer, message.content, limit)
        if cut:
            messages[i], total_cut = ChatMessage(message.role, text), total_cut + cut
    if total_cut:
        outcome.info["observation_tokens_cut"] = total_cut
    return messages


def _record(ep: _Episode, gen: Generation, action_text: str, outcome: EnvStep, observation: str,
            termination: str | None, prefix_shared: bool, settings: LoopSettings, generated_at: float) -> StepRecord:
    return StepRecord(
        episode_id=ep.episode_id,
        group_id=ep.group_id,
        prompt_id=ep.prompt.prompt_id,
        sample_idx=ep.sample_idx,
        step_idx=ep.step_idx,
        policy_version=settings.policy_version if gen.policy_version is None else gen.policy_version,
        prompt_ids=list(ep.current_ids),
        response_ids=list(gen.token_ids),
        response_logprobs=list(gen.logprobs),
        response_text=action_text,
        tool_calls=json_text([_call_json(call) for call in outcome.tool_calls]),
        parse_error=outcome.parse_error,
        observation_text=observation,
        env_reward=float(outcome.reward),
        done=termination is not None,
        termination=termination,
        truncated=termination in TRUNCATIONS,
        finish_reason=gen.finish_reason,
        prefix_shared=prefix_shared,
        info=json_text(outcome.info),
        served_by=gen.served_by,
        retries=gen.retries,
        generated_at=generated_at,
        anchor=ep.anchor,
        history=_history(ep),
    )


def _history(ep: _Episode) -> str:
    """How the step's context relates to the previous step's (StepRecord.history)."""
    if not ep.records:
        return "start"
    return "appended" if ep.records[-1].prefix_shared else "rewritten"


def _call_json(call) -> dict:
    """The call's fields, shallow: asdict() would deep-copy model-written arguments, recursively."""
    return {f.name: getattr(call, f.name) for f in fields(call)}
