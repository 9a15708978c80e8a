"""The run's one Placement (agent_core/cluster/placement.py) decides every "in this process?" question
the rollout and train stages and RunResources ask, and builds the in-process engine from the registry
through the one construction of its options. The Ray side runs in tests/test_scale_out.py (slow)."""

from __future__ import annotations

import pytest
import torch

from agent_core.cluster.placement import Placement
from agent_core.config import ClusterConfig, RolloutConfig
from agent_core.rollout.engines import ENGINES, EngineOptions

DATA_PARALLEL = ClusterConfig(address="local", trainer_workers=2)
ROLLOUT_ONLY = ClusterConfig(address="local", rollout_replicas=2)


@pytest.mark.parametrize("cluster, on_cluster, trains_here, colocated", [
    (None, False, True, True),
    (ClusterConfig(), False, True, True),  # a section without an address: this process
    (ROLLOUT_ONLY, True, True, False),  # replicas generate, training stays here, nothing to borrow
    (DATA_PARALLEL, True, False, False),
    (ClusterConfig(address="auto", worker_gpus=1), True, False, False),
])
def test_one_placement_answers_where_rollout_and_training_run(cluster, on_cluster, trains_here, colocated):
    placement = Placement(cluster, "cpu")
    assert placement.on_cluster is on_cluster and placement.trains_in_process is trains_here
    assert placement.colocated(keep_policy_in_memory=True) is colocated
    assert placement.colocated(keep_policy_in_memory=False) is False


def test_a_worker_gets_a_device_setting_of_its_own_not_an_index_of_this_machine():
    assert Placement(None, "cuda:1").job_device() == "cuda:1"
    assert Placement(DATA_PARALLEL, "cuda:1").job_device() == "auto"
    assert Placement(DATA_PARALLEL, "cpu").job_device() == "cpu"
    assert Placement(DATA_PARALLEL, "auto").training_device() == torch.device("cpu")  # worker_gpus = 0
    assert Placement(ClusterConfig(address="local", trainer_workers=2, worker_gpus=1), "auto").training_device() \
        == torch.device("cuda")
    assert Placement(None, "cpu").training_device() == torch.device("cpu")


def test_the_in_process_engine_gets_the_rollout_sections_options_and_is_closed_on_exit(tmp_path):
    built, closed = [], []

    class Recorder:
        def generate(self, prompts, params):
            return []

        def close(self):
            closed.append(True)

    rollout = RolloutConfig(engine="recorder", max_batch_size=7, max_context_tokens=321)
    with ENGINES.scoped():
        ENGINES.register("recorder")(lambda policy_dir, options: built.append((policy_dir, options)) or Recorder())
        with Placement(None, "cpu").rollout_engine(rollout, str(tmp_path), 0) as engine:
            assert isinstance(engine, Recorder) and not closed
    (policy_dir, options), = built
    assert policy_dir == tmp_path and closed == [True]
    assert options == EngineOptions.from_rollout(rollout, "cpu")
    assert (options.max_batch_size, options.max_model_len, options.device) == (7, 321, "cpu")


def test_the_runs_session_is_used_and_left_open_a_stage_alone_opens_and_closes_its_own(monkeypatch):
    import agent_core.cluster.session as session

    seen: list = []
    monkeypatch.setattr(session.ClusterSession, "train", lambda self, spec, job: seen.append((id(self), spec.workers)))
    monkeypatch.setattr(session.ClusterSession, "close", lambda self: seen.append(("close", id(self))))
    alone = Placement(DATA_PARALLEL)
    alone.train(job=None)
    (opened, workers), closed = seen
    assert workers == 2 and closed == ("close", opened)  # its own session, closed after the stage
    seen.clear()
    runs = alone.new_session()
    placement = Placement(DATA_PARALLEL, session=runs)
    placement.train(job=None)
    placement.train(job=None)
    assert seen == [(id(runs), 2), (id(runs), 2)]  # the run's session, twice, never closed by a stage
    assert placement == alone  # the session is not part of where the work runs


def test_a_run_on_a_cluster_gives_its_stages_one_session_and_closes_it(monkeypatch):
    import agent_core.cluster.session as session
    from agent_core.config import PipelineConfig
    from agent_core.run_resources import RunResources

    closed: list = []
    monkeypatch.setattr(session.ClusterSession, "close", lambda self: closed.append(self))
    with RunResources(PipelineConfig(cluster={"address": "local"})) as resources:
        run_session = resources.placement.session
        assert run_session is not None and resources.placement.on_cluster
    assert closed == [run_session]
    with RunResources(PipelineConfig()) as resources:
        assert resources.placement.session is None and not resources.placement.on_cluster
