"""An episode's KV cache kept between its turns (the hf engine's `kv_reuse`), so a turn prefills only what it appended.

A turn's context is the previous context + the sampled response + the observation (context_mode
append). After a call, each row's cache is cut out of the batch's cache: the KV of its prompt's
tokens and of its response but the last token (`generate` never runs the model on the token it
sampled last). The next call for that session, if its prompt starts with exactly those tokens,
gets them back: rows are laid out as [left padding][kept tokens][padding][new tokens], so the
kept caches line up in one batch cache; position ids come from the attention mask, so padding in
the middle changes no position. A prompt that does not extend the kept tokens (a rewritten
context) is prefilled whole. Kept caches are bounded in bytes, least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class KeptCache:
    """One session's cache: the token ids whose keys and values it holds, and per layer (keys, values),
    each [heads, tokens, head_dim]."""

    token_ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


class SessionCaches:
    """Kept caches by session id, least recently used first out when over `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, KeptCache] = OrderedDict()
        self._bytes = 0
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to a kept cache (for tests and benchmarks)

    def take(self, session: str | None, prompt: Sequence[int]) -> KeptCache | None:
        """The session's cache if `prompt` extends its tokens by at least one token; removed either way."""
        kept = self._kept.pop(session, None) if session is not None else None
        if kept is None:
            return None
        self._bytes -= kept.nbytes
        n = len(kept.token_ids)
        if len(prompt) <= n or list(prompt[:n]) != kept.token_ids:
            return None
        self.reused_tokens += n
        return kept

    def put(self, session: str, kept: KeptCache) -> None:
        if kept.nbytes > self.max_bytes:
            return
        self._kept[session] = kept
        self._bytes += kept.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self._bytes -= dropped.nbytes

    def clear(self) -> None:
        self._kept.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)


def layout(prompts: Sequence[Sequence[int]], kept: Sequence[KeptCache | None], pad_id: int, device):
    """(input_ids, attention_mask, past) of one call: rows [pad][kept tokens][pad][new tokens], both
    [B, W + S] (W: the longest kept cache, S: the longest new part); past: per layer (keys, values)
    [B, heads, W, head_dim], each row's kept cache right-aligned in its first W columns."""
    kept_lengths = [len(k.token_ids) if k is not None else 0 for k in kept]
    width, suffix = max(kept_lengths), max(len(p) - n for p, n in zip(prompts, kept_lengths))
    input_ids = torch.full((len(prompts), width + suffix), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width + suffix), dtype=torch.long)
    for row, (prompt, n) in enumerate(zip(prompts, kept_lengths)):
        input_ids[row, width - n : width] = torch.as_tensor(list(prompt[:n]), dtype=torch.long)
        attention_mask[row, width - n : width] = 1
        new = list(prompt[n:])
        input_ids[row, width + suffix - len(new) :] = torch.as_tensor(new, dtype=torch.long)
        attention_mask[row, width + suffix - len(new) :] = 1
    template = next(k for k in kept if k is not None)
    past = []
    for layer, (keys, values) in enumerate(template.layers):
        batch_keys = keys.new_zeros((len(prompts), keys.shape[0], width, keys.shape[2]))
        batch_values = values.new_zeros((len(prompts), values.shape[0], width, values.shape[2]))
        for row, (k, n) in enumerate(zip(kept, kept_lengths)):
            if k is not None:
                batch_keys[row, :, width - n :] = k.layers[layer][0]
                batch_values[row, :, width - n :] = k.layers[layer][1]
        past.append((batch_keys, batch_values))
    return input_ids.to(device), attention_mask.to(device), past


def cut_rows(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], attention_mask: torch.Tensor,
             prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[KeptCache | None]:
    """Each row's cache after a call: its prompt's real positions, then its response but the last token.

    layers: the call's cache, per layer (keys, values) [B, heads, W_in + T - 1, head_dim];
    attention_mask: the call's input mask [B, W_in]. A row whose positions do not add up (a cache
    of another shape than expected) gets None: it is prefilled whole next time.
    """
    width = attention_mask.shape[1]
    length = layers[0][0].shape[2]
    mask = attention_mask.cpu()  # one transfer, not one per row
    kept: list[KeptCache | None] = []
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        real = torch.nonzero(mask[row], as_tuple=True)[0]
        positions = torch.cat([real, torch.arange(width, width + len(response) - 1)])
        if len(real) != len(prompt) or (len(positions) and int(positions[-1]) >= length):
            kept.append(None)
            continue
        positions = positions.to(layers[0][0].device)
        kept.append(KeptCache(list(prompt) + list(response[:-1]),  # advanced indexing copies: no view of the batch
                              [(k[row, :, positions], v[row, :, positions]) for k, v in layers]))
    return kept
