"""The vLLM server's command line and environment, built without starting it (fast); the slow half
starts a real server whose KV cache is too small, which shows the size reaches vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_core.config import VLLMConfig
from agent_core.config_errors import ConfigError
from agent_core.rollout.vllm_server import VLLMServer, kv_cache_bytes
from agent_core.validation import build_config


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_a_fractional_kv_cache_reaches_the_cpu_server_in_bytes_and_the_legacy_variable_cannot_override_it(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # vLLM's CPU platform would apply it over the flag
    server = VLLMServer(tmp_path, 1024, VLLMConfig(kv_cache_gib=0.25))
    cpu = server.command(Path("python"), on_cpu=True)
    assert _flag(cpu, "--kv-cache-memory-bytes") == str(2**28)
    assert "VLLM_CPU_KVCACHE_SPACE" not in server._environment()
    gpu = server.command(Path("python"), on_cpu=False)  # on a GPU the share of GPU memory decides
    assert "--kv-cache-memory-bytes" not in gpu and _flag(gpu, "--gpu-memory-utilization") == "0.5"
    assert kv_cache_bytes(1) == 2**30 and kv_cache_bytes(1.5) == 3 * 2**29


def test_the_config_takes_fractions_of_a_gib_and_refuses_zero():
    config = build_config({"rollout": {"vllm": {"kv_cache_gib": 0.25}}}, source="test")
    assert config.rollout.vllm.kv_cache_gib == 0.25
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        build_config({"rollout": {"vllm": {"kv_cache_gib": 0}}}, source="test")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_kv_cache_too_small_for_one_sequence_fails_the_start_naming_the_setting(tmp_path):
    from agent_core.rollout.vllm_server import VLLMServerError
    from tests.test_engine_contract import MAX_LEN, _save_tiny, _vllm_missing

    if _vllm_missing():
        pytest.fail(_vllm_missing())  # the slow suite promises this runs (CI runs `make vllm` first)
    checkpoint = _save_tiny(tmp_path / "policy", seed=0)
    server = VLLMServer(checkpoint, MAX_LEN, VLLMConfig(kv_cache_gib=2**-14))  # 64 KiB: not one block
    with pytest.raises(VLLMServerError, match=r"rollout\.vllm\.kv_cache_gib = 6\.1035.*e-05 GiB"):
        server.start()
    assert server.process.poll() is not None
