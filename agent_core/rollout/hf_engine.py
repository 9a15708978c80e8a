"""The in-process engine: transformers `generate` with a KV cache and left padding (docs/architecture.md §6).

Token ids in, token ids + log-probs out. Log-probs are computed from the raw logits that
`generate` returns (output_logits=True), as log_softmax(logits / temperature) at the sampled
token, i.e. the temperature-scaled distribution before top-p truncation. With top_p = 1 (the
default for RL) that is exactly the sampling distribution, which is what PPO ratios need. Greedy
decoding (temperature 0) records log-probs at temperature 1. vLLM by default reports log-probs of
the unscaled logits instead (docs/architecture.md §10); the two agree at temperature 1.

Generation is fully specified by an explicit GenerationConfig; the model's own generation config
is set aside during the call, so no checkpoint default (top_k=50, repetition penalty, min_p)
silently changes what is sampled.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from transformers import GenerationConfig

from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams, check_request


class HFEngine:
    """Engine backed by a transformers causal LM living in this process.

    Batches larger than `max_batch_size` are split into consecutive chunks; outputs keep input
    order. With `params.seed` set, a call is reproducible (the RNG is seeded for the call only and
    the global RNG state is restored afterwards); results still depend on how the prompts are
    batched, as in any batched sampler.
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int = 64):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        self.pad_token_id = pad

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """One continuation per prompt, in order (see the Engine protocol)."""
        check_request(prompts, params)
        if not prompts:
            return []
        stop_ids = tuple(params.stop_token_ids) or eos_token_ids(self.tokenizer)
        config = self._generation_config(params, stop_ids)
        results: list[Generation] = []
        with self._generation_mode(), _seeded(params.seed, self.model.device):
            for start in range(0, len(prompts), self.max_batch_size):
                chunk = prompts[start : start + self.max_batch_size]
                results.extend(self._generate_batch(chunk, config, params.temperature, stop_ids))
        return results

    def _generation_config(self, params: SamplingParams, stop_ids: tuple[int, ...]) -> GenerationConfig:
        sampling = params.temperature > 0
        # top_k=0 disables the top-k warper (None would mean transformers' default of 50); the
        # warpers exist only when sampling, and greedy decoding warns about them.
        options = dict(temperature=params.temperature, top_p=params.top_p, top_k=0) if sampling else {}
        return GenerationConfig(
            do_sample=sampling,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=self.pad_token_id,
            num_beams=1,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            **options,
        )

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], config: GenerationConfig, temperature: float, stop_ids: tuple[int, ...]
    ) -> list[Generation]:
        input_ids, attention_mask = _left_pad(prompts, self.pad_token_id, self.model.device)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        new_tokens = out.sequences[:, input_ids.shape[1] :]  # (B, T): T = steps taken by the longest
        logprobs = _sampled_logprobs(out.logits, new_tokens, temperature)  # (B, T)
        return [_cut_at_stop(ids, lps, stop_ids) for ids, lps in zip(new_tokens.tolist(), logprobs.tolist())]

    @contextlib.contextmanager
    def _generation_mode(self):
        """eval() and a neutral model generation config for the call; both restored afterwards."""
        was_training = self.model.training
        model_config = self.model.generation_config
        self.model.eval()
        self.model.generation_config = GenerationConfig()
        try:
            with torch.inference_mode():
                yield
        finally:
            self.model.generation_config = model_config
            self.model.train(was_training)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, L) with L the longest prompt; padding on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _sampled_logprobs(step_logits: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at the sampled tokens.

    step_logits: T tensors of shape (B, V), the raw logits of each generation step.
    tokens: (B, T) sampled ids. Returns (B, T) float32. One step at a time keeps memory at B x V.
    """
    scale = temperature if temperature > 0 else 1.0
    columns = []
    for step, logits in enumerate(step_logits):
        logp = torch.log_softmax(logits.float() / scale, dim=-1)
        columns.append(logp.gather(-1, tokens[:, step : step + 1]).squeeze(-1))
    return torch.stack(columns, dim=1).cpu()


def _cut_at_stop(ids: list[int], logprobs: list[float], stop_ids: tuple[int, ...]) -> Generation:
    """Keep tokens up to and including the first stop token; drop the padding generate adds after it."""
    stops = set(stop_ids)
    for position, token in enumerate(ids):
        if token in stops:
            return Generation(ids[: position + 1], logprobs[: position + 1], "stop")
    return Generation(ids, logprobs, "length")


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seed torch's RNG for the duration of the call only (generate samples from the global RNG)."""
    if seed is None:
        yield
        return
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
