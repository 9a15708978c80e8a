"""The replica router: an Engine that spreads one `generate` call over a pool's replicas
(docs/scale-out.md).

An episode's calls stick to the replica that served its first one (prefix cache, as in SkyRL's sticky
router); a new episode goes to the least-loaded living replica. Per-prompt seeds make the split not change
what is sampled. A replica that dies or times out is removed and its part resent; none left: ClusterError.
Design notes: docs/architecture.md §11 (agent_core/cluster/router.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Sequence

from agent_core.cluster.replicas import Replica, ReplicaPool
from agent_core.cluster.runtime import ClusterError, ray_module
from agent_core.rollout.engine import Generation, SamplingParams, check_request, seeds_of

log = logging.getLogger(__name__)


class ReplicaRouter:
    """Engine over a ReplicaPool. `routes_sessions`: the agent loop names each prompt's episode."""

    routes_sessions = True

    def __init__(self, pool: ReplicaPool, *, generate_timeout_s: float, concurrent_calls: int = 1):
        self.pool = pool
        self.generate_timeout_s = generate_timeout_s
        # hf replicas: one call at a time, split over all of them (the loop's lock-step batches stay
        # whole and seeded runs repeat); vLLM replicas batch across calls, so the loop keeps many in flight
        self.max_concurrent_calls = concurrent_calls
        self._lock = threading.Lock()
        self._sticky: dict[str, Replica] = {}
        self._in_flight: dict[str, int] = {r.name: 0 for r in pool.replicas}
        self.retried_prompts = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 sessions: Sequence[str] | None = None) -> list[Generation]:
        check_request(prompts, params)
        if not prompts:
            return []
        sessions = list(sessions) if sessions is not None else [f"call-{id(prompts)}-{i}" for i in range(len(prompts))]
        seeds = seeds_of(params, len(prompts))
        results: list[Generation | None] = [None] * len(prompts)
        retries = [0] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:
            parts = self._place(todo, sessions)
            todo = self._run_parts(parts, prompts, params, seeds, results, retries)
        return results  # type: ignore[return-value]  (every slot is filled when todo is empty)

    def _place(self, indices: list[int], sessions: list[str]) -> dict[str, tuple[Replica, list[int]]]:
        """replica name -> (replica, prompt indices): sticky where the episode's replica lives, else least-loaded."""
        with self._lock:
            living = self.pool.living()
            if not living:
                raise ClusterError(f"no inference replica is left ({len(self.pool.replicas)} failed); "
                                   "the rollout stops and writes nothing")
            parts: dict[str, tuple[Replica, list[int]]] = {}
            load = {r.name: self._in_flight.get(r.name, 0) for r in living}
            for index in indices:
                replica = self._sticky.get(sessions[index])
                if replica is None or not replica.alive:
                    replica = min(living, key=lambda r: (load[r.name], living.index(r)))
                    self._sticky[sessions[index]] = replica
                load[replica.name] += 1
                parts.setdefault(replica.name, (replica, []))[1].append(index)
            for name, (_, part) in parts.items():
                self._in_flight[name] = self._in_flight.get(name, 0) + len(part)
            return parts

    def _run_parts(self, parts, prompts, params: SamplingParams, seeds, results, retries) -> list[int]:
        """Send each part to its replica and collect; the indices to send again (their replica failed)."""
        ray = ray_module()
        refs = {}
        for name, (replica, part) in parts.items():
            part_params = params if seeds is None else replace(params, prompt_seeds=tuple(seeds[i] for i in part))
            refs[replica.actor.generate.remote([list(prompts[i]) for i in part], part_params)] = (replica, part)
        deadline = time.monotonic() + self.generate_timeout_s
        failed: list[int] = []
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not done:  # the rest did not answer in time
                    for ref in pending:
                        failed += self._fail(*refs[ref], f"no answer within {self.generate_timeout_s:g} s", retries)
                    break
                replica, part = refs[done[0]]
                try:
                    generations, version = ray.get(done[0])
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
                    failed += self._fail(replica, part, f"{type(error).__name__}", retries)
                    continue
                for index, gen in zip(part, generations):
                    results[index] = replace(gen, policy_version=version, served_by=replica.name,
                                             retries=retries[index])
        finally:
            with self._lock:
                for replica, part in refs.values():
                    self._in_flight[replica.name] -= len(part)
        return failed

    def _fail(self, replica: Replica, part: list[int], why: str, retries: list[int]) -> list[int]:
        log.warning("%s failed a call (%s): %d prompts go to the other replicas", replica.name, why, len(part))
        self.pool.mark_dead(replica)
        for index in part:
            retries[index] += 1
        self.retried_prompts += len(part)
        return part
