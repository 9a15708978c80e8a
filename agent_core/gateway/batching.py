"""How the gateway calls the engine: as well as the in-process agent loop does
(agent_core/rollout/agent_loop.py).

`EngineQueue`: a concurrent engine (`concurrent_calls` > 1, vLLM) gets up to N calls in flight, one request
each; a serial engine (hf) gets the queued requests that share sampling settings as ONE generate call, each
with its own seed, once every live episode has one queued, or no request came for `window_s`, or the
oldest waited `max_wait_s`. No thread of its own.
Design notes: docs/architecture.md §11 (agent_core/gateway/batching.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from agent_core.rollout.engine import Engine, Generation, SamplingParams, concurrent_calls

DEFAULT_WINDOW_S = 0.05  # program round trips between calls are milliseconds; bench/gateway.py measures
DEFAULT_MAX_WAIT_S = 1.0  # programs starting together arrive over ~0.5 s on 2 cores (bench/gateway.py)


@dataclass(frozen=True)
class Served:
    """One request's share of an engine call: its own generation, the call's wall seconds, the
    number of sequences the call held, and the params the call ran with (its seeds included)."""

    generation: Generation
    seconds: float
    batch_size: int
    params: SamplingParams


@dataclass(eq=False)
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    session: str
    arrived: float
    served: Served | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.served is not None or self.error is not None


def _shareable(params: SamplingParams) -> tuple[SamplingParams, bool]:
    """What must be equal for two requests to share one call: everything but the seed's value."""
    return replace(params, seed=None, prompt_seeds=None), params.seed is None


class EngineQueue:
    """The engine as the gateway's request threads use it (module docstring). Thread-safe.

    live_episodes: how many open episodes could send a request now (their program runs, or they have
    made one): the most a call can wait for.
    """

    def __init__(self, engine: Engine, live_episodes: Callable[[], int], window_s: float = DEFAULT_WINDOW_S,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S):
        self.engine, self.live_episodes = engine, live_episodes
        self.window_s, self.max_wait_s = window_s, max_wait_s
        self.slots = concurrent_calls(engine)
        self._semaphore = threading.BoundedSemaphore(self.slots)
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._leading = False
        self._free_since = time.perf_counter()  # when the serial engine last finished a call
        self._last_arrival = 0.0
        self.calls = 0  # generate calls made, for tests and the benchmark

    def generate(self, prompt_ids: list[int], params: SamplingParams, session: str) -> Served:
        """The engine's generation for one sequence (raises the engine's error for its call)."""
        if self.slots > 1:
            with self._semaphore:
                return self._call([_Job(prompt_ids, params, session, time.perf_counter())])[0]
        job = _Job(prompt_ids, params, session, time.perf_counter())
        with self._cond:
            self._queue.append(job)
            self._last_arrival = job.arrived
            self._cond.notify_all()  # a leader waiting for stragglers counts again
            while not job.done and self._leading:
                self._cond.wait()
            if not job.done:
                self._leading = True
        if not job.done:
            try:
                self._lead_until(job)
            finally:
                with self._cond:
                    self._leading = False
                    self._cond.notify_all()  # a queued thread takes the lead
        if job.error is not None:
            raise job.error
        return job.served

    def episodes_changed(self) -> None:
        """An episode finished: a leader waiting for its request stops waiting for it."""
        with self._cond:
            self._cond.notify_all()

    def _lead_until(self, own: _Job) -> None:
        """Run calls for the queue until `own` is served."""
        while not own.done:
            batch = self._next_batch()
            try:
                served = self._call(batch)
            except BaseException as error:  # every request of the call gets its error
                served = None
                for job in batch:
                    job.error = error
            with self._cond:
                self._free_since = time.perf_counter()
                for job, result in zip(batch, served or ()):
                    job.served = result
                self._cond.notify_all()

    def _next_batch(self) -> list[_Job]:
        """The oldest queued request and those that can share its call, once the rules allow (docstring):
        the wait ends when every live episode has a request queued, when none arrived for window_s
        (while requests keep coming, more are on their way), or max_wait_s after the call could first go."""
        with self._cond:
            while True:
                could_go = max(self._free_since, self._queue[0].arrived)
                deadline = min(max(could_go, self._last_arrival) + self.window_s, could_go + self.max_wait_s)
                remaining = deadline - time.perf_counter()
                if remaining <= 0 or len(self._queue) >= self.live_episodes():
                    break
                self._cond.wait(remaining)
            key = _shareable(self._queue[0].params)
            batch = [job for job in self._queue if _shareable(job.params) == key]
            self._queue = [job for job in self._queue if _shareable(job.params) != key]
            return batch

    def _call(self, batch: list[_Job]) -> list[Served]:
        """One generate call for `batch`, each sequence with its own request's seed."""
        shared, unseeded = _shareable(batch[0].params)
        seeds = tuple(job.params.seed for job in batch)  # all None or none (_shareable)
        params = shared if unseeded else replace(shared, seed=seeds[0], prompt_seeds=seeds)
        prompts = [job.prompt_ids for job in batch]
        started = time.perf_counter()
        if getattr(self.engine, "routes_sessions", False):
            generations = self.engine.generate(prompts, params, sessions=[job.session for job in batch])
        else:
            generations = self.engine.generate(prompts, params)
        seconds = time.perf_counter() - started
        if len(generations) != len(batch):
            raise RuntimeError(f"engine returned {len(generations)} generations for {len(batch)} prompts")
        with self._cond:
            self.calls += 1
        return [Served(generation, seconds, len(batch), params) for generation in generations]
