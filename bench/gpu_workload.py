"""bench/gpu.py's models and tokenizer: Llamas of Qwen2.5's shapes with random weights, built in memory.

No download: the tokenizer is the demo's byte-level BPE (agent_core.training.model.build_tokenizer)
trained on the built-in task's text, then padded with unreachable filler tokens up to the model's
vocabulary (151,936 for Qwen2.5), so every id the random model samples decodes, and the LM head,
embedding and logits have the real sizes. It imports
only agent_core's model helpers and bench.workload (bench/gpu.py says what a bare GPU machine needs).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from agent_core.training.model import build_tokenizer
from bench.workload import Task


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (a Llama; Qwen2.5's only other difference is the q/k/v bias, ~0.03% of parameters)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = True

    def parameters(self) -> int:
        """Parameter count (a tied embedding counts once): what the MFU's 6 x N x tokens/s uses."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


QWEN_05B = Shape("qwen2.5-0.5b", hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151_936)
QWEN_15B = Shape("qwen2.5-1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151_936)
# --quick: the same structure (GQA, tied head, a vocabulary larger than the BPE's) at toy size
TINY = Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=1_024)
TINY_LORA = Shape("tiny-lora", hidden=96, layers=2, heads=4, kv_heads=2, ffn=192, vocab=1_024)

_BPE_VOCAB = 4_096  # what the task's text supports well; the rest of the vocabulary is filler


def task_texts(task: Task) -> list[str]:
    """The text the BPE is trained on: corpus and questions (as bench.workload.tiny_policy)."""
    return [d.text for d in task.documents] + sorted({m.content for p in task.prompts for m in p.messages})


def padded_tokenizer(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> PreTrainedTokenizerFast:
    """`tokenizer` with filler tokens appended up to exactly `vocab_size` ids.

    Fillers are 3-symbol strings of the byte-level alphabet that no merge produces: encoding never
    yields them, decoding one gives its 3 bytes (as a random model's samples need).
    """
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    # tokenizers numbers the added tokens (the tags) after the model's vocabulary when it loads, so
    # the fillers go into the model's vocabulary and the tags end up as the last ids
    extra = [t for t in state["added_tokens"] if t["content"] not in vocab]
    wanted = vocab_size - len(extra)
    if len(vocab) > wanted:
        raise ValueError(f"the tokenizer already has {len(vocab) + len(extra)} ids, more than the model's {vocab_size}")
    taken = set(vocab) | {t["content"] for t in extra}
    fillers = ("".join(c) for c in itertools.product(sorted(pre_tokenizers.ByteLevel.alphabet()), repeat=3))
    next_id = 1 + max(vocab.values())
    for text in fillers:
        if len(vocab) == wanted:
            break
        if text not in taken:
            vocab[text] = next_id
            next_id += 1
    padded = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)), bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token, clean_up_tokenization_spaces=False,
        padding_side="left")
    padded.chat_template = tokenizer.chat_template
    if len(padded) != vocab_size:
        raise RuntimeError(f"padded tokenizer has {len(padded)} ids, expected {vocab_size}")
    return padded


def shaped_tokenizer(task: Task, vocab_size: int) -> PreTrainedTokenizerFast:
    """The task's BPE, padded to `vocab_size` ids."""
    bpe = build_tokenizer(task_texts(task), vocab_size=min(_BPE_VOCAB, vocab_size // 2))
    return padded_tokenizer(bpe, vocab_size)


def shaped_model(shape: Shape, tokenizer: PreTrainedTokenizerFast, device: torch.device,
                 seed: int = 0) -> LlamaForCausalLM:
    """A random fp32 Llama of `shape`, created directly on `device` (no CPU copy of 2-6 GB first)."""
    if len(tokenizer) != shape.vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids, the {shape.name} shape {shape.vocab}")
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=8192,
                         rms_norm_eps=1e-6, tie_word_embeddings=shape.tied, dtype="float32", **ids)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(**ids)
    return model
