"""How many padded tokens one micro-batch may hold: a constant on the CPU, the device's free memory
over a per-token memory model on CUDA, or what the user set (which always wins).

On the CPU, "auto" is what the settings were before "auto" existed: 8,192 tokens, capped so that
tokens x vocabulary <= 2**26 logits (``vocab_capped_tokens``). On CUDA that cap (441 tokens at
Qwen2.5's 151,936-token vocabulary) threw away 4.5x of the trainer's speed on an H100
(docs/benchmarks.md §GPU), so "auto" there asks the device how many bytes are free
(``device_free_bytes``, the seam tests replace) and ``micro_batch_token_budget`` turns them into
tokens; a micro-batch that still runs out of memory is split and retried
(agent_core/training/oom.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

AUTO = "auto"
Auto = Literal["auto"]
# "auto" off CUDA: trainer.micro_batch_tokens' default before "auto" (the CPU suite is unchanged).
CPU_MICRO_BATCH_TOKENS = 8192
# Default cap on tokens x vocab of one micro-batch off CUDA: 2**26 fp32 logits = 256 MiB per copy. A
# training micro-batch holds several copies (logits, softmax, their gradients): SmolLM2's 49k
# vocabulary at 8192 tokens per micro-batch peaked at ~18 GB; this cap keeps it to ~1365 tokens.
MAX_LOGIT_ELEMENTS = 2**26
MIN_TOKENS, MAX_TOKENS, ROUND_TO = 512, 32768, 512
SAFETY = 0.85  # the fraction of the usable bytes the estimate may fill (allocator fragmentation, model error)
RESERVE_BYTES = 1 << 30  # cuBLAS / attention workspaces and the allocator's rounding, outside the estimate
LOGIT_COPIES = 4  # fp32 [N, V] copies alive at the LM head's peak (see micro_batch_token_budget)


def vocab_capped_tokens(max_tokens: int | Auto, vocab_size: int,
                        max_logit_elements: int | Auto = MAX_LOGIT_ELEMENTS) -> int:
    """The micro-batch token budget after capping its [tokens, vocab] logits at max_logit_elements
    (the cap never goes below 64 tokens; a row longer than the budget gets a micro-batch of its own).
    "auto" is the CPU's value of each (``CPU_MICRO_BATCH_TOKENS``, ``MAX_LOGIT_ELEMENTS``)."""
    tokens = CPU_MICRO_BATCH_TOKENS if max_tokens == AUTO else max_tokens
    cap = MAX_LOGIT_ELEMENTS if max_logit_elements == AUTO else max_logit_elements
    return min(tokens, max(64, cap // max(1, vocab_size)))


@dataclass(frozen=True)
class ModelShape:
    """What the memory model reads of a transformer: hidden size, layers, LM-head vocabulary (0:
    none, e.g. a critic), MLP width and parameter count."""

    hidden_size: int
    layers: int
    vocab_size: int
    intermediate_size: int
    parameters: int

    @staticmethod
    def of(module: torch.nn.Module) -> "ModelShape | None":
        """The shape of a transformers model (or of a critic's backbone, with no vocabulary); None
        when the module has no config saying it."""
        config = getattr(module, "config", None)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if config is None and hasattr(module, "backbone"):  # ValueModel: no LM head, no logits
            config, vocab = getattr(module.backbone, "config", None), 0
        hidden, layers = getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None)
        if not hidden or not layers:
            return None
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
        parameters = sum(p.numel() for p in module.parameters())
        return ModelShape(int(hidden), int(layers), vocab, int(intermediate), parameters)


def activation_bytes_per_token(shape: ModelShape, *, precision: str, checkpointing: bool, training: bool) -> int:
    """Bytes one token's activations hold in the backbone (see ``micro_batch_token_budget``)."""
    h, ffn = shape.hidden_size, shape.intermediate_size
    layer = 36 * h + 8 * ffn if precision == "bf16" else 4 * (10 * h + 4 * ffn)
    if not training:  # no graph: one layer's temporaries at a time, beside the residual stream
        return 2 * layer + 16 * h
    if checkpointing:  # each layer's fp32 input, plus the one layer being recomputed in the backward
        return shape.layers * 4 * h + layer + 16 * h
    return shape.layers * layer + 16 * h


def micro_batch_token_budget(free_bytes: int, shape: ModelShape, *, pending_bytes: int = 0, precision: str = "bf16",
                             checkpointing: bool = False, loss_fraction: float = 1.0, training: bool = True,
                             explicit: int | None = None, minimum: int = MIN_TOKENS, maximum: int = MAX_TOKENS) -> int:
    """Padded tokens per micro-batch that fit in `free_bytes` of device memory; `explicit` (the
    user's setting) always wins.

    The memory model, per padded token (h: hidden size, F: MLP width, V: vocabulary, l: layers),
    for a Llama-style decoder with SDPA / flash attention (no [L, L] scores kept):
    - activations kept for the backward, per layer: fp32, 4 x (10h + 4F) bytes (two RMSNorms'
      inputs and outputs, q/k/v/rotary/attention output, the MLP's gate, up, SiLU and product);
      bf16 autocast, 36h + 8F bytes (matmul inputs and outputs in bf16; norms, rotary outputs
      and the residual stream in fp32). Counted against Qwen2/Llama's modules: Qwen2.5-0.5B's
      shape keeps ~1.7 MB per token in bf16. Activation checkpointing keeps each layer's fp32
      input (4h) and one layer's activations during its recomputation. Scoring (training=False)
      keeps no graph: two layers' worth of temporaries.
    - logits: the selective LM head computes them only at loss-mask tokens
      (``scoring.sequence_logprobs(positions=...)``), so they cost loss_fraction x LOGIT_COPIES x
      4V bytes: the fp32 scores the log-softmax keeps, its gradient, the gather's gradient and
      the no-grad entropy's softmax (2.4 MB per loss token at V = 151,936). loss_fraction is the
      largest share of loss tokens in one row (so in any micro-batch of those rows).
    Device bytes outside the estimate: `pending_bytes` (gradients and AdamW moments not yet
    allocated: they are made at the first backward / step, after this is asked), the bf16 copy
    of the weights autocast caches (2 bytes per parameter), and RESERVE_BYTES (workspaces).
    Safety margin: the activations may fill only SAFETY (85%) of what is left. The result is
    rounded down to a multiple of 512 and clamped to [minimum, maximum] (32,768: beyond it the
    GPU is already saturated, and one row longer than the budget still gets a micro-batch of its
    own). A micro-batch that still runs out of memory is split and retried by the trainer.
    """
    if explicit is not None:
        return explicit
    weight_copy = 2 * shape.parameters if precision == "bf16" and training else 0
    usable = free_bytes - pending_bytes - weight_copy - RESERVE_BYTES
    per_token = (activation_bytes_per_token(shape, precision=precision, checkpointing=checkpointing, training=training)
                 + loss_fraction * LOGIT_COPIES * 4 * shape.vocab_size)
    tokens = int(SAFETY * max(usable, 0) / per_token) // ROUND_TO * ROUND_TO
    return max(minimum, min(maximum, tokens))


def device_free_bytes(device: torch.device | str) -> int | None:
    """Bytes a CUDA device can still give this process (the driver's free memory plus what torch's
    caching allocator holds unused), capped by `torch.cuda.set_per_process_memory_fraction` when one
    is set (the driver's free memory ignores it: a process limited to 24 GiB of an 80 GB card would
    size for the card and run out); None off CUDA (the CPU budget is a constant)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:  # get_per_process_memory_fraction wants an index, like its setter (torch 2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    available = free + torch.cuda.memory_reserved(device) - allocated
    fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    if fraction_of is not None:
        available = min(available, fraction_of(device) * total - allocated)
    return int(max(available, 0))


def pending_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Device bytes a training step will still allocate for `module`: a gradient per trainable
    parameter without one, and AdamW's two moments per parameter the optimizer has no state for."""
    total = 0
    for parameter in module.parameters():
        if not parameter.requires_grad:
            continue
        size = parameter.numel() * parameter.element_size()
        total += size if parameter.grad is None else 0
        total += 2 * size if optimizer is not None and not optimizer.state.get(parameter) else 0
    return total


def resolve_micro_batch_tokens(module: torch.nn.Module, tokens: int | Auto, logits: int | Auto, *, training: bool,
                               precision: str = "fp32", checkpointing: bool = False, pending_bytes: int = 0,
                               loss_fraction: float = 1.0, maximum: int = MAX_TOKENS) -> int:
    """The micro-batch token budget for `module` on its device.

    Off CUDA (or for a model without a readable shape): `tokens` ("auto": 8,192) capped by
    `logits` ("auto": 2**26) over the vocabulary, as before "auto" existed. On CUDA: `tokens`
    when set, else ``micro_batch_token_budget`` over ``device_free_bytes``; `logits` caps it only
    when set (the memory model already counts the logits).
    """
    shape = ModelShape.of(module)
    vocab = shape.vocab_size if shape is not None else 0
    free = device_free_bytes(next(module.parameters()).device)
    if free is None or shape is None:
        return vocab_capped_tokens(tokens, vocab, logits)
    budget = micro_batch_token_budget(free, shape, pending_bytes=pending_bytes, precision=precision,
                                      checkpointing=checkpointing, loss_fraction=loss_fraction, training=training,
                                      explicit=None if tokens == AUTO else tokens, maximum=maximum)
    return budget if logits == AUTO else vocab_capped_tokens(budget, vocab, logits)
