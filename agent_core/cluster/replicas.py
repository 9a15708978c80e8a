"""Inference replicas: Ray actors that each own one engine, and the weight sync that keeps them on
one policy version (docs/scale-out.md).

A replica builds its engine with the same registry as an in-process rollout (`ENGINES`): the hf
engine holds the model in the actor's process, the vllm engine starts its own server there (its
own virtualenv, as in-process), and an external URL is a vLLM server someone else runs. Ray does
the process management: actors, their placement (num_cpus / num_gpus), death detection, `kill`.

A replica never serves a mix of versions: `load` waits for the calls in flight to finish and
holds new calls back while it swaps the engine, and every `generate` answers with the version
that served the whole call. Weights travel as a checkpoint folder on shared storage; the actor's
`load` is the one place a GPU path (NCCL broadcast, CUDA IPC handles) would plug in.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agent_core.cluster.runtime import ClusterError, kill_quietly, ray_module
from agent_core.failpoints import failpoint, failpoint_environment
from agent_core.rollout.engine import Generation, SamplingParams
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSpec:
    """How every replica of a pool is built.

    engine: a registered engine name (hf, vllm, or a plugin's); options: its EngineOptions.
    urls: external OpenAI-compatible servers, one replica each (vllm engine only; replaces `count`).
    threads: torch threads per replica process (reused Ray workers keep their first task's count).
    sync_timeout_s: how long a running replica may take to load new weights.
    plugins: modules that register the engine, imported in each replica process.
    """

    engine: str
    options: EngineOptions
    count: int = 1
    urls: tuple[str, ...] = ()
    cpus: float = 1.0
    gpus: float = 0.0
    threads: int = 1
    plugins: tuple[str, ...] = ()
    sync_timeout_s: float = 300.0
    start_timeout_s: float = 600.0  # a new actor: a Ray worker process, torch, the engine (a vLLM server: minutes)

    @property
    def size(self) -> int:
        return len(self.urls) or self.count


class ReplicaWorker:
    """The body of one replica actor (run by Ray as `ray.remote(ReplicaWorker)`)."""

    def __init__(self, name: str, spec: ReplicaSpec, policy_dir: str, version: int, url: str | None,
                 env: dict[str, str]):
        import torch

        os.environ.update(env)  # the driver's failpoint settings reach the replica's own code
        torch.set_num_threads(spec.threads)
        if spec.plugins:
            from agent_core.plugins import load_plugins

            load_plugins(list(spec.plugins))
        self.name, self.spec, self.url = name, spec, url
        self._gate = threading.Condition()
        self._active = 0
        self._loading = False
        self._engine = self._build(policy_dir)
        self._version = version

    def _build(self, policy_dir: str):
        if self.url is not None:
            from agent_core.rollout.vllm_engine import external_engine

            return external_engine(self.url, Path(policy_dir), self.spec.options)
        return ENGINES.get(self.spec.engine)(Path(policy_dir), self.spec.options)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[Generation], int]:
        """The engine's generations and the policy version that produced all of them."""
        with self._gate:
            self._gate.wait_for(lambda: not self._loading)
            self._active += 1
            engine, version = self._engine, self._version
        try:
            failpoint(f"replica:{self.name}:generate")
            return engine.generate(prompts, params), version
        finally:
            with self._gate:
                self._active -= 1
                self._gate.notify_all()

    def load(self, policy_dir: str, version: int) -> float:
        """Serve `policy_dir`'s weights as `version` from the next call on; the seconds it took."""
        started = time.perf_counter()
        with self._gate:
            self._loading = True
            self._gate.wait_for(lambda: self._active == 0)
        try:
            failpoint(f"replica:{self.name}:load")
            old = self._engine
            self._engine = self._build(policy_dir)
            self._version = version
            close_engine(old)
        finally:
            with self._gate:
                self._loading = False
                self._gate.notify_all()
        return time.perf_counter() - started

    def version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        """Release the engine and any server this process started (before the actor is killed)."""
        close_engine(self._engine)
        from agent_core.rollout.engines import shutdown_engines

        shutdown_engines()


@dataclass
class Replica:
    name: str
    actor: object
    alive: bool = True


class ReplicaPool:
    """`spec.size` replica actors serving one policy version; `sync` moves them all to the next."""

    def __init__(self, spec: ReplicaSpec, policy_dir: str, version: int):
        self.spec = spec
        self.version = version
        self.policy_dir = policy_dir
        self.replicas = [self._start(index, policy_dir, version) for index in range(spec.size)]
        ray = ray_module()
        try:  # start-up errors (a bad checkpoint, vLLM missing) surface here, naming the replica
            ray.get([r.actor.version.remote() for r in self.replicas], timeout=spec.start_timeout_s)
        except Exception as error:
            self.shutdown()
            raise ClusterError(f"inference replicas did not start: {error}") from None

    def _start(self, index: int, policy_dir: str, version: int) -> Replica:
        ray = ray_module()
        name = f"replica-{index}"
        url = self.spec.urls[index] if self.spec.urls else None
        # concurrent calls only where the engine takes them (vLLM); an hf replica is serial anyway
        concurrency = max(2, self.spec.options.vllm.max_concurrent_calls + 1)
        actor_class = ray.remote(ReplicaWorker).options(
            num_cpus=self.spec.cpus, num_gpus=self.spec.gpus, max_concurrency=concurrency, max_restarts=0)
        actor = actor_class.remote(name, self.spec, policy_dir, version, url, failpoint_environment())
        return Replica(name, actor)

    def living(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def mark_dead(self, replica: Replica) -> None:
        replica.alive = False
        kill_quietly(replica.actor)  # a hung replica must not keep its resources (or answer late)

    def sync(self, policy_dir: str, version: int) -> float:
        """Every replica serves `version` before this returns (dead ones are replaced, started on it);
        the wall seconds. A replica that fails or takes longer than sync_timeout_s fails the sync, named."""
        if version == self.version and policy_dir == self.policy_dir and all(r.alive for r in self.replicas):
            return 0.0
        ray = ray_module()
        started = time.perf_counter()
        for index, replica in enumerate(self.replicas):
            if not replica.alive:  # replaced: its __init__ loads the new weights
                self.replicas[index] = self._start(index, policy_dir, version)
        pending = {r.actor.load.remote(policy_dir, version): r for r in self.replicas}
        done, late = ray.wait(list(pending), num_returns=len(pending), timeout=self.spec.sync_timeout_s)
        failures = [f"{pending[ref].name} did not answer within {self.spec.sync_timeout_s:g} s" for ref in late]
        for ref in done:
            try:
                ray.get(ref)
            except Exception as error:
                failures.append(f"{pending[ref].name} failed: {type(error).__name__}: {error}")
        if failures:
            for ref in late:
                self.mark_dead(pending[ref])
            raise ClusterError(f"weight sync to policy version {version} failed: {'; '.join(failures)}")
        self.version, self.policy_dir = version, policy_dir
        seconds = time.perf_counter() - started
        log.info("weight sync: %d replicas serve policy version %d (%.2f s)", len(self.replicas), version, seconds)
        return seconds

    def shutdown(self) -> None:
        """Stop every replica and what it started (its vLLM server), then the actors."""
        ray = ray_module()
        alive = [r for r in self.replicas if r.alive]
        try:
            ray.get([r.actor.shutdown.remote() for r in alive], timeout=30)
        except Exception:  # a replica that cannot shut down cleanly is killed below all the same
            pass
        for replica in self.replicas:
            replica.alive = False
            kill_quietly(replica.actor)
