"""LoRA checkpoints on disk: a policy that is a full base checkpoint plus a peft adapter.

A directory holds `adapter_config.json` and `adapter_model.safetensors` (as peft's `save_pretrained` writes
them), `lora_base.json` (the base checkpoint's `relative` and `absolute` paths; the first that exists wins)
and the tokenizer; no base weights. The adapter is injected in place (`peft.inject_adapter_in_model`), not
wrapped (`get_peft_model`), so the model stays the plain transformers class.
Design notes: docs/architecture.md §11 (agent_core/io/lora_checkpoints.py).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agent_core.io.checkpoint_files import TOKENIZER_FILES as _TOKENIZER_FILES
from agent_core.io.checkpoint_files import CheckpointError, check_full_checkpoint, swap_into_place

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_FILE = "lora_base.json"  # checkpoints.py's load_policy / check_checkpoint dispatch on this name
ADAPTER_NAME = "default"  # peft's; the only adapter a policy carries
_SAVED_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before a module path
_FORMAT = 1


def is_lora_checkpoint(directory: Path) -> bool:
    return (Path(directory) / BASE_FILE).is_file()


def has_lora(model: torch.nn.Module) -> bool:
    """Whether `model` carries an injected peft adapter."""
    return bool(getattr(model, "peft_config", None))


def lora_base_dir(directory: Path) -> Path:
    """The full checkpoint a LoRA checkpoint's adapter goes on (module docstring); CheckpointError if gone."""
    directory = Path(directory)
    try:
        record = json.loads((directory / BASE_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"LoRA checkpoint {directory} has no readable {BASE_FILE} ({error})") from None
    if record.get("format") != _FORMAT:
        raise CheckpointError(f"LoRA checkpoint {directory} has {BASE_FILE} format {record.get('format')!r}; "
                              f"this code reads {_FORMAT}")
    candidates = [directory / record["relative"]] if record.get("relative") else []
    candidates += [Path(record["absolute"])] if record.get("absolute") else []
    for candidate in candidates:
        if candidate.is_dir():
            return Path(os.path.normpath(candidate))
    raise CheckpointError(f"LoRA checkpoint {directory}: its base model is at none of "
                          f"{', '.join(map(str, candidates))}; copy the base there or edit {BASE_FILE}")


def check_lora_checkpoint(directory: Path) -> Path:
    """CheckpointError naming every missing part unless `directory` holds an adapter, its config, a
    tokenizer and a base that is a full checkpoint. Cheap: nothing is loaded."""
    directory = Path(directory)
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (directory / name).is_file()]
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        missing.append(f"tokenizer (one of {', '.join(_TOKENIZER_FILES)})")
    if missing:
        raise CheckpointError(f"LoRA checkpoint directory {directory} is missing {'; '.join(missing)}")
    base = lora_base_dir(directory)
    if is_lora_checkpoint(base):
        raise CheckpointError(f"LoRA checkpoint {directory} names another LoRA checkpoint ({base}) as its base; "
                              "a base must be a full checkpoint")
    check_full_checkpoint(base)
    return directory


def attach_adapter(model: torch.nn.Module, config, base_dir: Path,
                   state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """Inject a LoRA adapter (`config`: peft.LoraConfig) into `model` in place; only adapter parameters
    keep requires_grad. `state`: saved adapter weights (peft's saved names) to load, else peft's
    initialisation (B = 0: the model computes what it did). `base_dir` is recorded as the base."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    config.base_model_name_or_path = str(Path(base_dir).resolve())
    config.inference_mode = False  # trainable; generation runs under no_grad anyway
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # peft: "Target modules {...} not found in the base model ..."
        first = " ".join(str(error).split())[:300]
        raise ValueError(f"cannot put LoRA adapters on the policy ({first}): check policy.lora.target_modules "
                         "against the model's Linear layer names") from None
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    if state is not None:
        plain = {k.removeprefix(_SAVED_PREFIX): v for k, v in state.items()}
        result = set_peft_model_state_dict(model, plain, adapter_name=ADAPTER_NAME)
        if result.unexpected_keys:
            raise CheckpointError(f"adapter weights do not fit the base model: {', '.join(result.unexpected_keys[:5])}")
    return model


def save_lora_policy(model: torch.nn.Module, tokenizer, directory: Path) -> Path:
    """Write the adapter of `model` (injected by `attach_adapter`), the base path and the tokenizer to
    `directory` (module docstring), replacing it, via a temporary sibling and a rename."""
    from peft import get_peft_model_state_dict

    directory = Path(directory)
    config = model.peft_config[ADAPTER_NAME]
    base = Path(config.base_model_name_or_path)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
        save_file({_SAVED_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()},
                  str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        inference = config.inference_mode
        config.inference_mode = True  # as PeftModel.save_pretrained writes it
        try:
            config.save_pretrained(str(staging))
        finally:
            config.inference_mode = inference
        record = {"format": _FORMAT, "relative": os.path.relpath(base, directory.resolve()), "absolute": str(base)}
        (staging / BASE_FILE).write_text(json.dumps(record, indent=1))
        tokenizer.save_pretrained(staging)
        swap_into_place(staging, directory)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_lora_model(directory: Path, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The base model of a LoRA checkpoint with its adapter injected (on the CPU, like from_pretrained)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    directory = check_lora_checkpoint(Path(directory))
    base = lora_base_dir(directory)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, local_files_only=True)
    config = LoraConfig.from_pretrained(str(directory))
    state = {k: v.to(dtype) for k, v in load_file(str(directory / ADAPTER_WEIGHTS)).items()}
    return attach_adapter(model, config, base, state)


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every adapter merged into its base weights and removed (in place): a plain
    transformers model whose outputs equal the adapted one's (what a registered model ships)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=[ADAPTER_NAME])
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model
