"""How the trainer's forward/backward passes run: bfloat16 autocast (`trainer.precision`) and
activation checkpointing (`trainer.activation_checkpointing`), each a context around an update."""

from __future__ import annotations

from contextlib import contextmanager

import torch

PRECISIONS = ("fp32", "bf16")
SETTINGS = ("auto", *PRECISIONS)


def resolve_precision(setting: str, device: torch.device | str) -> str:
    """The precision a `trainer.precision` setting means on `device`: "auto" is "bf16" on CUDA (its
    tensor cores; ~2x the fp32 throughput) and "fp32" elsewhere (a CPU's default stays what it was
    before "auto" existed); "fp32" and "bf16" mean themselves."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown precision {setting!r}; choose one of {', '.join(PRECISIONS)} (or auto)")
    if setting != "auto":
        return setting
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def autocast(device: torch.device, precision: str):
    """The forward pass's autocast: bfloat16 matmuls for "bf16" (parameters, gradients and the
    optimizer stay fp32; scoring upcasts logits to fp32 before the log-softmax), none for "fp32";
    "auto" as `resolve_precision` says for the device the batch is on."""
    precision = resolve_precision(precision, device)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@contextmanager
def activation_checkpointing(model: torch.nn.Module, enabled: bool):
    """Within the block, `model` (a transformers model) recomputes each layer's activations in the
    backward pass instead of keeping them: peak memory of a micro-batch falls from all layers'
    activations to about one layer's, for one more forward pass of compute. Off: nothing changes."""
    if not enabled:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"trainer.activation_checkpointing: {type(model).__name__} does not support it")
    already = model.is_activation_checkpointing
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        if not already:
            model.activation_checkpointing_disable()
