"""Inference replicas on a local Ray cluster (docs/scale-out.md): routing, retries, weight sync.

One Ray instance for the module (2 CPUs, no dashboard, its session folder in a
temporary directory). Replicas are real Ray actors with real hf engines on a tiny checkpoint;
failures come from failpoints inside the replica process (a SIGKILL, or a thread that stops
answering), passed to the actors through the environment at start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agent_core.cluster.replicas import ReplicaPool, ReplicaSpec
from agent_core.cluster.router import ReplicaRouter
from agent_core.cluster.runtime import ClusterError
from agent_core.data.synthetic import generate_synthetic_qa
from agent_core.envs.registry import EnvResources, make_env
from agent_core.envs.search import Bm25Index
from agent_core.io.checkpoints import save_policy
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.engines import ENGINES, EngineOptions
from agent_core.training.model import build_tiny_policy, build_tokenizer

try:
    import ray
except ImportError:  # the default suite collects this module too (its tests are slow, so deselected there)
    ray = None
pytestmark = pytest.mark.slow

OPTIONS = EngineOptions(max_batch_size=16, max_model_len=512)


@pytest.fixture(scope="module")
def ray_cluster():
    if ray is None:
        pytest.fail('Ray is missing: `make ray` (pip install -e ".[ray]") installs it; make test-slow does')
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    marker = os.environ["AGENTR1_TEST_RAY_MARKER"] = f"agentr1-ray-{uuid.uuid4().hex}"  # inherited by Ray's processes
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2, logging_level="ERROR",
             _temp_dir=temp_dir)
    yield temp_dir
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    deadline, left = time.monotonic() + 30, _processes_with(marker)
    while left and time.monotonic() < deadline:  # ray.shutdown returns before its last agents exit
        time.sleep(1)
        left = _processes_with(marker)
    del os.environ["AGENTR1_TEST_RAY_MARKER"]
    assert left == [], f"Ray processes outlived the module's cluster: {left}"


def _processes_with(marker: str) -> list[str]:
    """Command lines of other processes whose environment holds `marker` (this one and its parents are excluded)."""
    own = {os.getpid(), os.getppid()}
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if int(environ.parent.name) not in own and marker.encode() in environ.read_bytes():
                found.append(environ.with_name("cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:  # gone meanwhile
            continue
    return found


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    dataset = generate_synthetic_qa(seed=3, num_films=12, num_people=10, num_cities=5, num_countries=3)
    texts = [d.text for d in dataset.documents] + [m.content for p in dataset.prompts for m in p.messages]
    tokenizer = build_tokenizer(texts, vocab_size=400)
    folder = tmp_path_factory.mktemp("cluster")
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    first = save_policy(model, tokenizer, folder / "policy-v0")
    with torch.no_grad():  # a second version whose greedy actions differ from the first's
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
        model.lm_head.weight.mul_(10.0)
    second = save_policy(model, tokenizer, folder / "policy-v1")
    resources = EnvResources(search_index=Bm25Index(dataset.documents))
    return dataset, tokenizer, resources, str(first), str(second)


def _rollout(task, engine, *, seed=7, temperature=1.0, prompts=3):
    dataset, tokenizer, resources, _, _ = task
    settings = LoopSettings(group_size=2, max_steps=3, max_context_tokens=512, policy_version=0,
                            episode_prefix="t-", straggler_wait_s=float("inf"))  # lock-step: calls repeat exactly
    sampling = SamplingParams(max_new_tokens=10, temperature=temperature, seed=seed,
                              stop_token_ids=eos_token_ids(tokenizer))
    return run_episodes(engine, tokenizer, dataset.prompts[:prompts],
                        lambda p: make_env(p.env_name, p.env_kwargs, resources), sampling, settings)


def _pool(task, *, replicas=2, version=0, sync_timeout_s=60.0) -> ReplicaPool:
    spec = ReplicaSpec(engine="hf", options=OPTIONS, count=replicas, cpus=1.0, sync_timeout_s=sync_timeout_s)
    return ReplicaPool(spec, task[3], version)


def _same_episodes(left, right) -> None:
    assert [(s.episode_id, s.step_idx) for s in left] == [(s.episode_id, s.step_idx) for s in right]
    for a, b in zip(left, right):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids, a.episode_id
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def in_process_steps(task):
    return _rollout(task, ENGINES.get("hf")(Path(task[3]), OPTIONS))


def test_two_replicas_produce_the_episodes_of_one_in_process_engine(ray_cluster, task, in_process_steps):
    pool = _pool(task)
    try:
        router = ReplicaRouter(pool, generate_timeout_s=120)
        steps = _rollout(task, router)
    finally:
        pool.shutdown()
    _same_episodes(in_process_steps, steps)
    assert {s.served_by for s in steps} == {"replica-0", "replica-1"}  # both replicas took episodes
    by_episode: dict[str, set] = {}
    for step in steps:
        by_episode.setdefault(step.episode_id, set()).add(step.served_by)
    assert all(len(served) == 1 for served in by_episode.values())  # sticky: an episode stays on its replica
    assert {s.policy_version for s in steps} == {0} and {s.retries for s in steps} == {0}


def test_a_replica_killed_mid_rollout_is_retried_on_the_other(ray_cluster, task, in_process_steps, monkeypatch):
    monkeypatch.setenv("AGENTR1_FAILPOINT", "replica:replica-0:generate@2")  # SIGKILL at its second call
    pool = _pool(task)
    try:
        router = ReplicaRouter(pool, generate_timeout_s=120)
        steps = _rollout(task, router)
        assert [r.alive for r in pool.replicas] == [False, True]
        pool.sync(task[4], 1)  # the next sync replaces the dead replica, started on the new weights
        assert [r.alive for r in pool.replicas] == [True, True]
        assert ray.get([r.actor.version.remote() for r in pool.replicas]) == [1, 1]
    finally:
        pool.shutdown()
    _same_episodes(in_process_steps, steps)  # seeds travel with the prompts: the retry samples the same
    retried = [s for s in steps if s.retries]
    assert retried and {s.retries for s in retried} == {1} and {s.served_by for s in retried} == {"replica-1"}
    assert router.retried_prompts == len(retried)


def test_a_hung_replica_times_out_and_its_calls_go_elsewhere(ray_cluster, task, in_process_steps, monkeypatch):
    monkeypatch.setenv("AGENTR1_FAILPOINT", "replica:replica-1:generate@1=hang")
    pool = _pool(task)
    try:
        router = ReplicaRouter(pool, generate_timeout_s=5)
        started = time.monotonic()
        steps = _rollout(task, router)
        elapsed = time.monotonic() - started
    finally:
        pool.shutdown()
    _same_episodes(in_process_steps, steps)
    assert {s.served_by for s in steps} == {"replica-0"}
    assert {s.retries for s in steps if s.step_idx == 0 and s.sample_idx == 1} == {1}
    assert elapsed < 90  # one timeout, not one per call


def test_the_rollout_fails_clearly_when_every_replica_is_gone(ray_cluster, task, monkeypatch):
    monkeypatch.setenv("AGENTR1_FAILPOINT", "replica:replica-0:generate@1")
    pool = _pool(task, replicas=1)
    try:
        with pytest.raises(ClusterError, match="no inference replica is left"):
            _rollout(task, ReplicaRouter(pool, generate_timeout_s=60))
    finally:
        pool.shutdown()


def _greedy(engine, prompts, **kwargs):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    return [g.token_ids for g in engine.generate(prompts, params, **kwargs)]


def test_weight_sync_reaches_every_replica(ray_cluster, task):
    _, tokenizer, _, first, second = task
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in ("Who directed", "Where was", "The film")]
    expected = {}
    for name, folder in (("first", first), ("second", second)):
        expected[name] = _greedy(ENGINES.get("hf")(Path(folder), OPTIONS), prompts)
    assert expected["first"] != expected["second"]
    pool = _pool(task)
    try:
        seconds = pool.sync(second, 1)
        assert seconds > 0 and pool.version == 1
        for replica in pool.replicas:  # each replica on its own, not whichever the router picks
            generations, version = ray.get(replica.actor.generate.remote(prompts, SamplingParams(
                max_new_tokens=8, temperature=0.0)))
            assert version == 1 and [g.token_ids for g in generations] == expected["second"], replica.name
        router = ReplicaRouter(pool, generate_timeout_s=60)
        out = router.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0), sessions=["a", "b", "c"])
        assert {g.policy_version for g in out} == {1}
    finally:
        pool.shutdown()


def test_a_replica_that_does_not_answer_fails_the_sync_within_its_timeout(ray_cluster, task, monkeypatch):
    monkeypatch.setenv("AGENTR1_FAILPOINT", "replica:replica-1:load@1=hang")
    pool = _pool(task, sync_timeout_s=4.0)
    try:
        started = time.monotonic()
        with pytest.raises(ClusterError, match=r"replica-1 did not answer within 4 s") as error:
            pool.sync(task[4], 1)
        assert time.monotonic() - started < 30
        assert "replica-0" not in str(error.value)
        assert [r.alive for r in pool.replicas] == [True, False]
    finally:
        pool.shutdown()


@pytest.fixture(scope="module")
def vllm_checkpoints(task, tmp_path_factory):
    """Two versions of a policy vLLM's CPU backend can serve (head size 32), logits sharpened so
    greedy comparisons with the hf engine are robust to float noise."""
    tokenizer = task[1]
    folder = tmp_path_factory.mktemp("vllm-replicas")
    saved = []
    for seed in (0, 1):
        model = build_tiny_policy(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)
        saved.append(str(save_policy(model, tokenizer, folder / f"policy-v{seed}")))
    return saved


def _vllm_processes() -> list[str]:
    return [cmd for cmd in (p.read_bytes().replace(b"\0", b" ").decode(errors="replace")
                            for p in Path("/proc").glob("[0-9]*/cmdline") if _readable(p))
            if "vllm.entrypoints.openai.api_server" in cmd and "--served-model-name policy" in cmd]


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
        return True
    except OSError:
        return False


@pytest.mark.vllm
def test_two_vllm_replicas_serve_reload_and_stop_their_servers(ray_cluster, task, vllm_checkpoints):
    from agent_core.config import VLLMConfig
    from agent_core.rollout.vllm_server import VLLMNotInstalledError, vllm_python

    try:
        vllm_python(VLLMConfig())
    except VLLMNotInstalledError as error:
        pytest.fail(str(error))  # the slow suite builds .venv-vllm: never skip silently
    tokenizer = task[1]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in ("Who directed", "Where was", "The film", "Doc")]
    expected = [_greedy(ENGINES.get("hf")(Path(folder), OPTIONS), prompts) for folder in vllm_checkpoints]
    before = set(_vllm_processes())
    spec = ReplicaSpec(engine="vllm", options=replace(OPTIONS, vllm=OPTIONS.vllm.model_copy(update={"max_concurrent_calls": 2})),
                       count=2, cpus=1.0, sync_timeout_s=120)
    pool = ReplicaPool(spec, vllm_checkpoints[0], 0)
    try:
        router = ReplicaRouter(pool, generate_timeout_s=120, concurrent_calls=4)
        out = router.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0), sessions=list("abcd"))
        assert [g.token_ids for g in out] == expected[0]
        assert {g.served_by for g in out} == {"replica-0", "replica-1"} and {g.policy_version for g in out} == {0}
        assert len(set(_vllm_processes()) - before) == 2  # one server per replica
        pool.sync(vllm_checkpoints[1], 1)  # in place: the servers keep running
        out = router.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0), sessions=list("abcd"))
        assert [g.token_ids for g in out] == expected[1] and {g.policy_version for g in out} == {1}
    finally:
        pool.shutdown()
    assert set(_vllm_processes()) - before == set()


@pytest.mark.vllm
def test_an_external_vllm_server_is_a_replica_that_syncs_but_is_not_stopped(ray_cluster, task, vllm_checkpoints):
    """cluster.replica_urls: a server someone else runs (here this test, with our worker extension)."""
    from agent_core.rollout.vllm_server import VLLMServer

    tokenizer = task[1]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in ("Who directed", "Where was")]
    expected = [_greedy(ENGINES.get("hf")(Path(folder), OPTIONS), prompts) for folder in vllm_checkpoints]
    server = VLLMServer(Path(vllm_checkpoints[1]), OPTIONS.max_model_len, OPTIONS.vllm).start()  # holds v1 at first
    try:
        spec = ReplicaSpec(engine="vllm", options=OPTIONS, urls=(server.base_url,), sync_timeout_s=120)
        pool = ReplicaPool(spec, vllm_checkpoints[0], 0)  # the replica loads v0 into it
        try:
            router = ReplicaRouter(pool, generate_timeout_s=120, concurrent_calls=2)
            greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
            assert [g.token_ids for g in router.generate(prompts, greedy, sessions=["a", "b"])] == expected[0]
            pool.sync(vllm_checkpoints[1], 1)
            out = router.generate(prompts, greedy, sessions=["a", "b"])
            assert [g.token_ids for g in out] == expected[1] and {g.policy_version for g in out} == {1}
        finally:
            pool.shutdown()
        assert server.alive  # not ours to stop
    finally:
        server.stop()
