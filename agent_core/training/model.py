"""A tiny policy built from scratch: a byte-level BPE tokenizer with a ChatML template and a small Llama.

Everything here lives in memory (saving and loading are in agent_core/io/checkpoints.py), so a run
can start with no model download: the tokenizer is trained on the run's own texts in well under a
second, and the model is a randomly initialised `LlamaForCausalLM`.

Choices that differ from common pretrained setups (SmolLM2, Qwen2.5), and why:
- The tool-format markers (<search>, </search>, <answer>, </answer>, <information>,
  </information>) are whole *added* tokens rather than BPE pieces, so a tiny model emits a tag in
  one step; they are not *special* tokens, so decoding with skip_special_tokens=True keeps them
  and the env can parse them.
- Input and output embeddings are untied: vLLM's CPU backend keeps a stale copy of a tied LM head
  after an in-place weight reload (see docs/architecture.md §10), and untied heads avoid that.
- The generation config carries only token ids, not transformers' sampling defaults (top_k=50),
  so nothing silently changes the distribution the engine samples from.
"""

from __future__ import annotations

from typing import Iterable

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (IM_START, IM_END, PAD)
TAG_TOKENS = ("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>")

# ChatML: every turn is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens
# an assistant turn. Any role is rendered the same way (system, user, assistant, tool).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it as a transformers tokenizer with ChatML.

    Byte-level means every string is encodable (no unknown token) and decode(encode(x)) == x.
    The vocabulary holds the 256 byte symbols, the special and tag tokens, then learned merges up
    to `vocab_size` (fewer if the texts do not support that many merges).
    """
    n_reserved = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_reserved:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: it must be at least {n_reserved} (bytes + special tokens)"
        )
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False keeps the round trip exact (no space invented before the first word).
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IM_START,  # every conversation starts with it; never added automatically
        eos_token=IM_END,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,  # would rewrite " ." to "." and break the round trip
        padding_side="left",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_policy(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 344,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised fp32 `LlamaForCausalLM` sized for `tokenizer`.

    The same `seed` gives the same weights (the global RNG is left as it was). The vocabulary is
    len(tokenizer), so added tokens have embeddings; bos/eos/pad ids come from the tokenizer.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    ids = _special_ids(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        dtype="float32",
        **ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(**ids)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int | None]:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; build it with build_tokenizer() or set eos_token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad}
