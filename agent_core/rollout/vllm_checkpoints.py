"""What the vLLM server needs to know of a policy checkpoint folder, read without loading it: its
architecture (what must match for an in-place reload), its attention head size (the CPU backend's
limit), and whether it is a LoRA adapter, of which rank, on which base model.

A LoRA checkpoint is a folder with peft's adapter files (adapter_config.json, adapter_model.safetensors)
that names the full checkpoint it adapts (lora_base.json; agent_core/training/lora.py's docstring
describes the format). vLLM serves it by starting on the base model with `--enable-lora` and loading
the adapter at runtime; this module only reads the folder's JSON (the server loads the tensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agent_core.io.lora_checkpoints import ADAPTER_CONFIG, BASE_FILE, lora_base_dir

# vLLM 0.32's accepted --max-lora-rank values (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMServerError(RuntimeError):
    """The vLLM server could not be started, died, or refused a request (or cannot serve a checkpoint)."""


class LoraCheckpointError(VLLMServerError):
    """A folder with adapter_config.json that does not say what vLLM needs."""


@dataclass(frozen=True)
class LoraCheckpoint:
    adapter_dir: Path
    base_dir: Path
    rank: int


def lora_checkpoint(policy_dir: Path) -> LoraCheckpoint | None:
    """The adapter of `policy_dir`, or None when it is a full checkpoint (no adapter_config.json)."""
    policy_dir = Path(policy_dir)
    config_file = policy_dir / ADAPTER_CONFIG
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
        rank = int(config["r"])
    except (ValueError, KeyError, TypeError) as error:
        raise LoraCheckpointError(f"{config_file}: not a peft LoRA adapter config ({error}); "
                                  "re-save the checkpoint with policy.lora set") from error
    return LoraCheckpoint(policy_dir, base_model_dir(policy_dir, config), rank)


def base_model_dir(adapter_dir: Path, config: dict) -> Path:
    """The full checkpoint the adapter applies to: the trainer's lora_base.json (agent_core/io/lora_checkpoints.py),
    else peft's base_model_name_or_path (an adapter saved elsewhere; relative to the adapter's folder)."""
    if (adapter_dir / BASE_FILE).is_file():
        base = lora_base_dir(adapter_dir)
    else:
        named = config.get("base_model_name_or_path")
        if not named:
            raise LoraCheckpointError(f"{adapter_dir}: the LoRA adapter does not name its base model (no {BASE_FILE}, "
                                      f"no base_model_name_or_path in {ADAPTER_CONFIG})")
        base = Path(named) if Path(named).is_absolute() else adapter_dir / named
    if not (base / "config.json").is_file():
        raise LoraCheckpointError(f"{adapter_dir}: its base model {base} is not a checkpoint folder (no config.json); "
                                  "vLLM starts on the base model, so it must be on local disk")
    return base.resolve()


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise LoraCheckpointError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]}); "
                              "lower policy.lora.rank or use engine: hf")


# vLLM 0.32's CPU attention backend (CPUAttentionBackend.get_supported_head_sizes)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_cpu_head_size(model_dir: Path) -> None:
    """Fail before a 30 s start when the CPU backend cannot run the model's attention (it would
    only fail at the first request, killing the server)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in CPU_HEAD_SIZES:
        raise VLLMServerError(
            f"{model_dir} has attention head size {head_dim} (hidden_size {config['hidden_size']} / "
            f"{config['num_attention_heads']} heads); vLLM's CPU backend supports {list(CPU_HEAD_SIZES)}. "
            "Choose policy.hidden_size / policy.num_heads to match (e.g. 64 / 2), or use engine: hf."
        )


def architecture_key(model_dir: Path) -> str:
    """What must match for a reload to be possible: the model config minus fields weights don't change."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    return json.dumps(config, sort_keys=True)
