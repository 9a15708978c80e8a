"""LoRA training of the policy (`policy.lora`): peft adapters injected in place, the reference as the
same module with its adapters off, and checkpoints that hold only the adapter.

`inject_lora` uses `peft.inject_adapter_in_model`, so the model stays the plain transformers class, and only
the adapter's parameters require grad. `adapter_disabled(model)` gives the KL reference (the base model, the
run's start policy) from the policy's own module. On-disk format: agent_core/io/lora_checkpoints.py.
Design notes: docs/architecture.md §11 (agent_core/training/lora.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from agent_core.config import PolicyLoraConfig
from agent_core.io import background
from agent_core.io.lora_checkpoints import attach_adapter, has_lora, is_lora_checkpoint, lora_base_dir
from agent_core.io.manifests import stat_stamp
from agent_core.training import resident

__all__ = ["adapter_disabled", "has_lora", "inject_lora", "lora_reference_module", "peft_lora_config",
           "reference_policy", "trainable_parameter_count"]


def peft_lora_config(settings: PolicyLoraConfig):
    """The peft.LoraConfig of `policy.lora`."""
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none")


def inject_lora(model: torch.nn.Module, settings: PolicyLoraConfig, base_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Put a fresh adapter on `model` (a full checkpoint's, loaded from `base_dir`) in place; only the
    adapter trains. Fresh means B = 0, so the model's outputs are unchanged until the first step; A is
    random, drawn from `seed` (the global RNG is left as it was), so data-parallel workers that each
    inject one start from the same adapter."""
    if has_lora(model):
        raise ValueError(f"the policy from {base_dir} already carries a LoRA adapter; it is trained as it is")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return attach_adapter(model, peft_lora_config(settings), base_dir)


def trainable_parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _lora_layers(model: torch.nn.Module) -> list:
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


@contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` computing as its base model (every LoRA layer passes its input to the base layer only)
    inside the block; adapters and their requires_grad flags are as before afterwards. A model
    without adapters is yielded unchanged."""
    layers = _lora_layers(model)
    if any(layer.merged for layer in layers):
        raise ValueError("the policy's adapter is merged into its weights: the base model cannot be recovered")
    flags = {parameter: parameter.requires_grad for parameter in model.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for parameter, flag in flags.items():  # peft's enable/set_adapter re-flag adapter weights
            parameter.requires_grad_(flag)


@contextmanager
def reference_policy(reference_dir: Path, policy_dir: Path, load: Callable[[Path], tuple]) -> Iterator[tuple]:
    """(model, tokenizer) of the KL reference at `reference_dir` inside the block: where the policy at
    `policy_dir` is a LoRA checkpoint on that very base and the train stage kept its module in memory
    (`lora_reference_module`), that module with its adapter disabled (no second model); else `load(reference_dir)`."""
    shared = lora_reference_module(Path(policy_dir), Path(reference_dir))
    if shared is None:
        yield load(Path(reference_dir))
        return
    model, tokenizer = shared
    with adapter_disabled(model):
        yield model, tokenizer


def lora_reference_module(policy_dir: Path, reference_dir: Path) -> tuple[torch.nn.Module, object] | None:
    """(model, tokenizer) whose adapter-disabled outputs are the reference's, when the policy at
    `policy_dir` is a LoRA checkpoint on `reference_dir`: the module the train stage keeps in memory
    (resident.py) if it was saved there and is unchanged, else None (the caller loads the reference).
    Not removed from memory: the next training takes it as usual."""
    policy_dir, reference_dir = Path(policy_dir), Path(reference_dir)
    if not is_lora_checkpoint(policy_dir) or lora_base_dir(policy_dir).resolve() != reference_dir.resolve():
        return None
    background.wait()  # with runtime.background_save the module is held once its optimizer state is written
    entry = resident.held(resident.POLICY)
    if entry is None or entry.paths[0] != str(policy_dir.resolve()) or entry.stamp[0] != stat_stamp(policy_dir):
        return None
    model, tokenizer, _ = entry.objects
    return model, tokenizer
