"""Token log-probs of a causal LM, and batched no-grad scoring of token sequences.

Alignment everywhere: position t holds the value for token t itself (its log-prob given tokens
< t); position 0 has no context and holds 0. `score_logprobs` / `score_in_micro_batches` are the
no-grad, eval-mode, token-budgeted scorers the advantages stage uses for reference log-probs and
critic values; the trainer uses `sequence_logprobs` with gradients.

Logits only where they are needed: given `positions` (the tokens whose log-prob enters a loss),
`sequence_logprobs` runs the model's backbone once and its LM head only on the hidden states that
predict those tokens, so no [B, L, V] logits exist (TRL keeps only completion logits the same
way). For SmolLM2 (49k vocabulary) the head is ~20% of a token's forward FLOPs and its fp32
logits 192 KiB per token per copy. This needs a model whose logits are exactly
head(backbone(...)) (`split_lm_head`: known plain-head architectures); others get full logits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from agent_core.algos.losses import entropy_from_logits
from agent_core.training.batches import PaddedBatch, TrainSequence, pad_sequences, token_budget_groups
from agent_core.training.memory import (  # noqa: F401  (vocab_capped_tokens, MAX_LOGIT_ELEMENTS: re-exported)
    AUTO, MAX_LOGIT_ELEMENTS, Auto, resolve_micro_batch_tokens, vocab_capped_tokens,
)
from agent_core.training.oom import TokenBudget, run_with_splits
from agent_core.training.precision import autocast, resolve_precision
from agent_core.training.prepared import split_rows

# No graph is kept while scoring, so a micro-batch may hold more tokens than a training one (memory.py's MAX_TOKENS).
SCORING_MAX_TOKENS = 65536


def model_vocab_size(model: torch.nn.Module) -> int:
    return int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)


# Architectures whose CausalLM logits are lm_head(base_model(...).last_hidden_state), nothing after
# (no soft-capping or logit scaling), so scoring a subset of positions gives the same numbers.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3", "olmo", "olmo2"})


def split_lm_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(backbone, LM head) of a causal LM with a plain head, else None (score with full logits)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    backbone, head = getattr(model, "base_model", None), model.get_output_embeddings()
    if backbone is None or backbone is model or head is None:
        return None
    return backbone, head


def _checked_temperature(temperature: float) -> float:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature


def _scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits as float32 and divided by the temperature (no copy where neither is needed)."""
    scores = logits if logits.dtype == torch.float32 else logits.float()
    return scores / temperature if temperature != 1.0 else scores


def model_mask(attention_mask: torch.Tensor, right_padded: bool) -> torch.Tensor | None:
    """The mask to give the model: none for a right-padded batch. Causal attention never lets a real token
    see the padding after it, so the real positions' outputs are the same, and without a mask the model
    neither checks the mask on the host (transformers' SDPA mask skip: a sync) nor builds a 4-D mask, and
    runs its causal attention kernel."""
    return None if right_padded else attention_mask


def _shifted_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    temperature: float, right_padded: bool = False) -> torch.Tensor:
    _checked_temperature(temperature)
    mask = model_mask(attention_mask, right_padded)
    logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    return _scores(logits, temperature)


def _with_first_position(per_token: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    first = per_token.new_zeros(per_token.shape[0], 1)
    return torch.cat([first, per_token], dim=1) * attention_mask.to(torch.float32)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy_grad: bool = True,
    positions: torch.Tensor | None = None,
    position_count: int | None = None,
    right_padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of a causal LM, both float32 [B, L].

    input_ids, attention_mask: [B, L]. Position t holds log p(input_ids[t] | input_ids[<t]) under
    softmax(logits / temperature), and the entropy of that distribution; position 0 (no context)
    and padding positions hold 0. entropy_grad=False computes the entropy without autograd
    (row by row, bounding memory) when it is only a metric.
    positions: optional bool [B, L], the tokens whose values are needed (a loss mask). With a
    plain-head model (``split_lm_head``) only they get logits and every other position holds 0;
    their values equal the full computation's (same gradients too). None: every position.
    position_count: how many tokens `positions` selects (positions[:, 1:] on real tokens), when the
    caller knows it on the host: the selection then needs no host synchronisation.
    right_padded: every row's padding comes after its tokens (``model_mask``: the model gets no mask).
    Memory: log p is logit[target] - logsumexp(logits), so no [B, L, V] log-softmax is built; the
    only full-size copies are the temperature division / float32 upcast (skipped when not needed)
    and the softmax inside the entropy.
    """
    split = split_lm_head(model) if positions is not None else None
    if split is not None:
        return _selected_logprobs(*split, input_ids, attention_mask, positions, temperature, entropy_grad,
                                  position_count, right_padded)
    scores = _shifted_scores(model, input_ids, attention_mask, temperature, right_padded)
    token_logprobs = scores.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    if entropy_grad:
        entropy = entropy_from_logits(scores)
    else:
        with torch.no_grad():
            entropy = torch.cat([entropy_from_logits(row[None]) for row in scores.detach()], dim=0)
    return _with_first_position(token_logprobs, attention_mask), _with_first_position(entropy, attention_mask)


def _selected_logprobs(backbone: torch.nn.Module, head: torch.nn.Module, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor, positions: torch.Tensor, temperature: float,
                       entropy_grad: bool, count: int | None = None,
                       right_padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logprobs` with the LM head run only on the hidden states that predict `positions`."""
    _checked_temperature(temperature)
    mask = model_mask(attention_mask, right_padded)
    hidden = backbone(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
    targets = (positions[:, 1:] > 0) & (attention_mask[:, 1:] > 0)  # token t is predicted by hidden state t - 1
    flat = _selected(targets.reshape(-1), count)  # [N] row-major indices into [B, L - 1]
    selected = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, flat)
    scores = _scores(head(selected), temperature)  # [N, V], N = selected tokens
    wanted = input_ids[:, 1:].reshape(-1).index_select(0, flat)
    picked = scores.gather(-1, wanted.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    if entropy_grad:
        entropy = entropy_from_logits(scores)
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(scores.detach())
    return _placed(picked, flat, targets, attention_mask), _placed(entropy, flat, targets, attention_mask)


def _selected(mask: torch.Tensor, count: int | None) -> torch.Tensor:
    """Indices of the true entries of a 1-D mask, in order; with their `count` known, without a host sync
    (`torch.nonzero_static`; plain `nonzero` where a device has no static version)."""
    if count is not None:
        try:
            return torch.nonzero_static(mask, size=count, fill_value=0).squeeze(-1)
        except (NotImplementedError, RuntimeError):
            pass
    return torch.nonzero(mask).squeeze(-1)


def _placed(values: torch.Tensor, flat: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[N] values of the selected tokens (at `flat`, row-major indices) -> [B, L]; 0 elsewhere."""
    placed = values.new_zeros(targets.numel()).index_put((flat,), values).view(targets.shape)
    return _with_first_position(placed, attention_mask)


def score_in_micro_batches(
    sequences: Sequence[Sequence[int]], pad_id: int, max_tokens: int | Auto,
    score: Callable[[PaddedBatch], torch.Tensor], module: torch.nn.Module,
    starts: Sequence[int] | None = None, precision: str = "fp32",
) -> list[list[float]]:
    """No-grad, eval-mode per-token scores [B, L] -> one list per sequence (same length as it).

    Sequences are grouped into right-padded micro-batches of <= max_tokens padded tokens ("auto":
    ``scoring_micro_batch_tokens``); `score` gets each as a PaddedBatch whose response_start holds
    `starts` (the first position a caller needs; default: 1), under the trainer's `precision` (its
    bf16 autocast, so scores are what the trainer computes, at its speed). A micro-batch that runs
    out of device memory is split in two and retried (``oom.run_with_splits``). The module's
    train/eval mode is restored afterwards.
    """
    device = next(module.parameters()).device
    if max_tokens == AUTO:
        max_tokens = scoring_micro_batch_tokens(module, AUTO, precision)
    out: list[list[float]] = [[] for _ in sequences]
    batches = []
    for group in token_budget_groups([len(s) for s in sequences], max_tokens):
        rows = [TrainSequence(list(sequences[i]), [0] * len(sequences[i]), [0.0] * len(sequences[i]),
                              [0.0] * len(sequences[i]), response_start=min(
                                  len(sequences[i]), max(1, 1 if starts is None else starts[i])))
                for i in group]
        batches.append((pad_sequences(rows, tuple(group), pad_id).to(device),))
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), autocast(device, precision):
            scored = run_with_splits(batches, lambda batch: (batch.indices, score(batch).float().cpu()),
                                     TokenBudget(max_tokens), split_rows)
            for indices, scores in scored:
                for row, index in enumerate(indices):
                    out[index] = scores[row, : len(sequences[index])].tolist()
    finally:
        module.train(was_training)
    return out


def scoring_micro_batch_tokens(module: torch.nn.Module, max_tokens: int | Auto, precision: str = "fp32",
                               loss_fraction: float = 1.0) -> int:
    """Padded tokens per scoring micro-batch: `max_tokens` when set; "auto" is sized like training's, from
    the device's free memory and the precision on CUDA (no graph kept, up to SCORING_MAX_TOKENS), 8,192
    capped by the logits off CUDA (``memory.resolve_micro_batch_tokens``)."""
    device = next(module.parameters()).device
    return resolve_micro_batch_tokens(module, max_tokens, AUTO, training=False, loss_fraction=loss_fraction,
                                      precision=resolve_precision(precision, device), maximum=SCORING_MAX_TOKENS)


def score_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]], pad_id: int, max_tokens: int | Auto,
                   temperature: float, starts: Sequence[int] | None = None, precision: str = "fp32") -> list[list[float]]:
    """Per-token log-probs of each token sequence under `model` (position 0: 0.0), batched, no grad.

    starts: per sequence, the first position whose log-prob is wanted (e.g. a response's first
    token); earlier positions hold 0.0 and, with a plain-head model, get no logits at all.
    max_tokens: padded tokens per micro-batch, or "auto" (``scoring_micro_batch_tokens``: 8,192 on the
    CPU, the device's free memory on CUDA); off CUDA it is capped at 2**26 logits. precision: the
    trainer's (fp32, bf16, auto), so reference and old log-probs are computed as training computes them.
    """
    def score(batch: PaddedBatch) -> torch.Tensor:
        if starts is None:
            ids, mask = batch.input_ids, batch.attention_mask
            scores = _shifted_scores(model, ids, mask, temperature, right_padded=True)
            return _with_first_position(scores.gather(-1, ids[:, 1:, None]).squeeze(-1) - scores.logsumexp(-1), mask)
        columns = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        wanted = columns[None, :] >= batch.response_start[:, None]
        logprobs, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature,
                                        entropy_grad=False, positions=wanted, right_padded=True)
        return logprobs * wanted

    fraction = 1.0 if starts is None else _scored_fraction(sequences, starts)
    max_tokens = scoring_micro_batch_tokens(model, max_tokens, precision, loss_fraction=fraction)
    return score_in_micro_batches(sequences, pad_id, max_tokens, score, model, starts, precision)


def _scored_fraction(sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> float:
    """The largest share of one sequence's positions that get logits (from its start on)."""
    return max(((len(q) - min(start, len(q))) / max(1, len(q)) for q, start in zip(sequences, starts)), default=1.0)
