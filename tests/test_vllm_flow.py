"""A training run with `rollout.engine: vllm` end to end (needs `make vllm`; slow, runs in make test-slow).

The real Prefect flow on the tiny config (head size 32, the smallest vLLM's CPU attention takes):
one vLLM server serves every rollout and dev evaluation of the run, each new checkpoint's weights
are loaded into it in place, and the server is stopped when the flow ends.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agent_core.config import VLLMConfig
from agent_core.io.layout import DataRoot
from agent_core.io.tables import read_table
from agent_core.rollout.vllm_server import VLLMNotInstalledError, vllm_python
from agent_core.validation import load_config
from flows.train import train

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_training_with_the_vllm_engine_reloads_weights_in_place_and_stops_the_server(tmp_path, caplog):
    from agent_core.rollout.vllm_engine import server_stats

    try:
        vllm_python(VLLMConfig())
    except VLLMNotInstalledError as error:
        pytest.fail(str(error))  # the slow suite promises this runs (CI runs `make vllm` first)
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        f"data_root={tmp_path}", "run_id=vllm", "rollout.engine=vllm", "policy.hidden_size=64",
        "dev_eval.every=1",
    ])
    with caplog.at_level("INFO"):
        result = train(config)
    out = caplog.text  # the flow logs its prints (log_prints)
    assert out.count("ready on port") == 1  # one server start for the whole run
    # iteration 0's checkpoint (dev eval, rollout 1) and iteration 1's (dev eval) reach it in place
    assert out.count("into the running server") >= 2
    assert server_stats() == []  # stopped when the flow ended
    run = DataRoot(tmp_path).run("vllm")
    for k in range(config.iterations):
        steps = read_table("steps", run.table_uri(k, "steps")).to_pylist()
        assert len({s["episode_id"] for s in steps}) == config.data.prompts_per_iteration * config.rollout.group_size
        for step in steps:
            assert len(step["response_ids"]) == len(step["response_logprobs"]) >= 1
            assert all(math.isfinite(lp) and lp <= 1e-6 for lp in step["response_logprobs"])
            assert step["policy_version"] == k
    assert [s.iteration for s in result.iterations] == list(range(config.iterations))


def test_keep_server_false_stops_the_server_after_each_rollout(tmp_path, caplog):
    """rollout.vllm.keep_server: false gives training the server's memory: every rollout starts a
    server holding the current checkpoint and stops it when it ends, so none is running in between."""
    from agent_core.rollout.vllm_engine import server_stats

    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        f"data_root={tmp_path}", "run_id=vllm-release", "rollout.engine=vllm", "policy.hidden_size=64",
        "dev_eval.every=0", "rollout.vllm.keep_server=false",
    ])
    with caplog.at_level("INFO"):
        train(config)
    out = caplog.text
    assert out.count("ready on port") == config.iterations  # one fresh server per rollout
    assert out.count("keep_server: false") == config.iterations
    assert "into the running server" not in out  # nothing was left running to reload into
    assert server_stats() == []

