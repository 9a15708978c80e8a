"""The run's resources have one owner (issue 30, item 2): `RunResources` places the run (its device,
the engines' lender) on entry and frees, on exit, whether the block ended normally or by an
exception, the engines, the cluster, the background writer, the resident policy and the shared
search indexes, in that order; the training flow opens it once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import agent_core.cluster.session as session
import agent_core.run_resources as run_resources
import flows.train as train_flow
from agent_core.config import PipelineConfig
from agent_core.envs import search
from agent_core.io import background
from agent_core.rollout import engines
from agent_core.run_resources import RunResources
from agent_core.training import resident
from agent_core.types import Document
from agent_core.validation import load_config

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [Document(f"d{i}", f"title {i}", f"text number {i}") for i in range(3)]


class _Boom(Exception):
    pass


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """What the exit freed, in order (engines and the cluster counted rather than started)."""
    seen: list[str] = []
    monkeypatch.setattr(engines, "shutdown_engines", lambda: seen.append("engines"))
    monkeypatch.setattr(session.ClusterSession, "close", lambda self: seen.append("cluster"))
    real_close, real_forget, real_clear = background.close, resident.forget, run_resources.clear_shared_indexes
    monkeypatch.setattr(background, "close", lambda: (seen.append("writer"), real_close())[1])
    monkeypatch.setattr(resident, "forget", lambda role=None: (seen.append("resident"), real_forget(role))[1])
    monkeypatch.setattr(run_resources, "clear_shared_indexes", lambda: (seen.append("indexes"), real_clear())[1])
    # Start from no shared index: a rollout run by an earlier test outside a run (the library's
    # roll_out, the gateway's tests) leaves the LRU of indexes holding one, which is its design.
    real_clear()
    yield seen
    background.close()
    real_forget()


def _hold_everything() -> None:
    """What a run leaves in the process: a kept and offered policy, a writer job, a search index."""
    model = torch.nn.Linear(2, 2)
    resident.keep(resident.CRITIC, [], (), (model, None))
    resident.offer(Path(__file__), model, None)
    background.submit("slow job", lambda: time.sleep(0.05))
    search.shared_index(DOCUMENTS)


def _nothing_left() -> None:
    assert resident.held(resident.POLICY) is None and resident.held(resident.CRITIC) is None
    assert resident.offered() is None and resident.lent() == 0
    assert engines._lender is None
    assert not background.running() and background.pending() == []
    assert len(search._shared) == 0


def _config(**cluster) -> PipelineConfig:
    return PipelineConfig(cluster=cluster) if cluster else PipelineConfig()


def test_leaving_normally_frees_everything_in_order(calls):
    with RunResources(_config()) as resources:
        assert resources.device == torch.device("cpu")  # auto, no CUDA here
        assert engines._lender is not None  # colocated: hf engines borrow the trainer's module
        _hold_everything()
        assert background.running() and len(search._shared) == 1
    _nothing_left()
    assert calls == ["engines", "writer", "resident", "indexes"]  # no cluster configured: none closed


def test_leaving_by_an_exception_frees_everything_and_keeps_the_error(calls):
    with pytest.raises(_Boom):
        with RunResources(_config(address="local")):
            _hold_everything()
            raise _Boom("a stage failed")
    _nothing_left()
    assert calls == ["engines", "cluster", "writer", "resident", "indexes"]


def test_a_failing_step_does_not_keep_the_others_from_running(calls, monkeypatch):
    def broken():
        calls.append("engines")
        raise RuntimeError("server would not stop")
    monkeypatch.setattr(engines, "shutdown_engines", broken)
    with pytest.raises(RuntimeError, match="server would not stop"):
        with RunResources(_config()):
            _hold_everything()
    _nothing_left()
    assert calls == ["engines", "writer", "resident", "indexes"]


def test_the_writers_last_job_finishes_before_the_policy_is_dropped(calls):
    """The background writer's last job holds the policy (resident.keep after the optimizer state is
    written): freeing the resident policy first would leave it held after the run."""
    started = threading.Event()

    def optimizer_state_then_keep():
        started.set()
        time.sleep(0.2)
        resident.keep(resident.POLICY, [], (), (torch.nn.Linear(1, 1), None, None))

    with RunResources(_config()):
        background.submit("iteration 0: optimizer state", optimizer_state_then_keep)
        started.wait(5)
    _nothing_left()


def test_without_the_resident_policy_or_in_a_cluster_nothing_is_lent(calls):
    for config in (PipelineConfig(runtime={"keep_policy_in_memory": False}), _config(address="local")):
        with RunResources(config) as resources:
            assert not resources.colocated and engines._lender is None


def test_the_training_flow_opens_the_resources_once_and_leaves_nothing(tmp_path, monkeypatch, calls):
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", [f"data_root={tmp_path}", "run_id=r1"])
    seen = []

    def fake_train(run, cfg, resources):
        seen.append((resources.device_setting, engines._lender is not None))
        _hold_everything()
        raise _Boom("iteration 0 failed")

    monkeypatch.setattr(train_flow, "_train", fake_train)
    with pytest.raises(_Boom):
        train_flow.train.fn(config)
    assert seen == [("auto", True)]
    _nothing_left()
    assert calls == ["engines", "writer", "resident", "indexes"]
