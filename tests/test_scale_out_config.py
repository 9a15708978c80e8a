"""Scale-out without a cluster (fast): the `cluster:` section's checks, the staleness cap, the
hanging failpoint the replica tests use. The Ray parts run in tests/test_cluster.py and
tests/test_scale_out.py (slow)."""

from __future__ import annotations

import threading
import uuid

import pytest

from agent_core.config import ConfigError, PipelineConfig, parse_config
from agent_core.failpoints import failpoint
from agent_core.io.tables import write_table
from agent_core.validation import check_runnable
from tasks.train import StaleStepsError, check_staleness
from tests.test_schemas import steps_rows


def test_a_cluster_address_must_be_local_auto_or_a_ray_url():
    for address in ("local", "auto", "ray://head:10001"):
        assert parse_config({"cluster": {"address": address}}).cluster.address == address
    with pytest.raises(ConfigError, match="cluster.address"):
        parse_config({"cluster": {"address": "lokal"}})
    assert PipelineConfig().cluster.address is None  # the default stays in-process, Ray-free


@pytest.mark.parametrize("overrides, message", [
    ({"rollout_replicas": 2}, r"cluster.rollout_replicas=2 needs a cluster: set cluster.address"),
    ({"trainer_workers": 2}, r"cluster.trainer_workers=2 needs a cluster"),
    ({"address": "local", "replica_urls": ["http://127.0.0.1:8000"]},
     r"engine 'hf' cannot use external replica servers; set rollout.engine to one that can: vllm"),
])
def test_a_cluster_section_that_cannot_work_fails_before_the_run(overrides, message):
    config = parse_config({"cluster": overrides})
    with pytest.raises(ConfigError, match=message):
        check_runnable(config, policy_source=False)


def test_a_missing_ray_is_named_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r'Ray is not installed: pip install -e "\.\[ray\]"'):
        check_runnable(parse_config({"cluster": {"address": "local"}}), policy_source=False)
    check_runnable(parse_config({}), policy_source=False)  # no cluster: Ray is not needed


def _steps(tmp_path, iteration: int, versions: list[int]) -> str:
    rows = steps_rows()
    for row, version in zip(rows, versions * len(rows)):
        row.update(iteration=iteration, policy_version=version)
    return write_table("steps", rows, str(tmp_path / "steps.parquet"))


def test_steps_older_than_the_staleness_cap_are_refused(tmp_path):
    uri = _steps(tmp_path, iteration=3, versions=[2, 2, 2, 1, 1, 1])  # one episode per version
    assert check_staleness(uri, 3, max_staleness=2) == 2
    with pytest.raises(StaleStepsError, match=r"iteration 3: 3 of 6 steps come from policy version 1, 2 behind; "
                                              r"runtime.max_staleness=1 refuses"):
        check_staleness(uri, 3, max_staleness=1)
    on_policy = _steps(tmp_path, iteration=3, versions=[3])
    assert check_staleness(on_policy, 3, max_staleness=0) == 0


def test_a_steps_table_cannot_claim_a_newer_policy_than_its_iteration(tmp_path):
    from schemas import TableValidationError

    with pytest.raises(TableValidationError, match="no step comes from a newer policy"):
        _steps(tmp_path, iteration=1, versions=[2])


def test_a_hang_failpoint_blocks_the_thread_that_reaches_it(monkeypatch):
    name = f"test:hang-{uuid.uuid4().hex}"  # visits are counted per process: a fresh name each time
    monkeypatch.setenv("AGENTR1_FAILPOINT", f"{name}@2=hang")
    passed = []

    def visit(n):
        failpoint(name)
        passed.append(n)

    visit(1)  # the first visit is not selected
    stuck = threading.Thread(target=visit, args=(2,), daemon=True)  # blocks forever: a daemon, never joined
    stuck.start()
    stuck.join(timeout=0.5)
    assert stuck.is_alive() and passed == [1]
