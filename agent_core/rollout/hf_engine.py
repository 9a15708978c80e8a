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

A seeded call samples each prompt from its own random stream (`_PerPromptSampler`): prompt i's
tokens come from a generator seeded with its seed (`seeds_of`), drawn on the CPU, so they do not
depend on which prompts share the call or its `max_batch_size` chunk, and the global RNG is never
touched. An unseeded call samples with transformers' own multinomial from the global RNG.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from transformers import (
    GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper,
)

from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams, check_request, seeds_of


class HFEngine:
    """Engine backed by a transformers causal LM living in this process.

    Batches larger than `max_batch_size` are split into consecutive chunks; outputs keep input
    order. A seeded call (`seed` or `prompt_seeds`) samples prompt i from its own generator seeded
    `seed + i` (or `prompt_seeds[i]`), so it is reproducible, leaves the global RNG alone, and a
    prompt's sample does not depend on the other prompts in the call or on the chunking: the same
    prompt and seed give the same tokens alone or in any batch. One caveat, as for greedy
    decoding: a different left-padding width changes the logits by float noise (~1e-6), which can
    in principle flip a sample whose uniform draw falls at a boundary between two tokens' mass.
    An unseeded call samples from the global RNG, and its samples depend on the batch.
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int = 64, release: Callable[[], None] | None = None):
        """release: called once by `close()`, for a module the engine borrowed (the trainer's resident
        policy, agent_core/training/resident.py) rather than loaded."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._release = release
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        self.pad_token_id = pad

    def close(self) -> None:
        """Give a borrowed module back (nothing for one the engine loaded); the engine is not used after."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """One continuation per prompt, in order (see the Engine protocol)."""
        check_request(prompts, params)
        if not prompts:
            return []
        stop_ids = tuple(params.stop_token_ids) or eos_token_ids(self.tokenizer)
        seeds = seeds_of(params, len(prompts)) if params.temperature > 0 else None  # greedy needs no seeds
        # one generator per prompt for the whole call: a prompt's stream does not depend on its chunk
        generators = None if seeds is None else [torch.Generator().manual_seed(seed) for seed in seeds]
        config = self._generation_config(params, stop_ids, per_prompt_sampler=generators is not None)
        results: list[Generation] = []
        with self._generation_mode():
            for start in range(0, len(prompts), self.max_batch_size):
                chunk = prompts[start : start + self.max_batch_size]
                sampler = None
                if generators is not None:
                    rows = generators[start : start + len(chunk)]
                    sampler = _PerPromptSampler(rows, params.temperature, params.top_p)
                results.extend(self._generate_batch(chunk, config, params.temperature, stop_ids, sampler))
        return results

    def _generation_config(
        self, params: SamplingParams, stop_ids: tuple[int, ...], *, per_prompt_sampler: bool
    ) -> GenerationConfig:
        # With the per-prompt sampler, generate decodes greedily: the sampler (the only logits
        # processor) has already drawn each row's token and leaves it the only finite score.
        # Custom processors run before transformers' warpers, so it applies temperature and top-p itself.
        sampling = params.temperature > 0 and not per_prompt_sampler
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
        self,
        prompts: Sequence[Sequence[int]],
        config: GenerationConfig,
        temperature: float,
        stop_ids: tuple[int, ...],
        sampler: _PerPromptSampler | None,
    ) -> list[Generation]:
        input_ids, attention_mask = _left_pad(prompts, self.pad_token_id, self.model.device)
        processors = LogitsProcessorList([sampler] if sampler is not None else [])
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, logits_processor=processors
        )
        # out.logits are the raw logits, taken before any logits processor (the sampler included)
        new_tokens = out.sequences[:, input_ids.shape[1] :]  # (B, T): T = steps taken by the longest
        logprobs = _sampled_logprobs(out.logits, new_tokens, temperature)  # (B, T)
        return [_cut_at_stop(ids, lps, stop_ids) for ids, lps in zip(new_tokens.tolist(), logprobs.tolist())]

    @contextlib.contextmanager
    def _generation_mode(self):
        """eval(), no autograd and a neutral model generation config for the call; the mode of every
        submodule and the config restored afterwards (a borrowed module goes back to the trainer
        exactly as it came: a loaded critic or policy may mix train- and eval-mode submodules)."""
        modes = {name: sub.training for name, sub in self.model.named_modules()}
        model_config = self.model.generation_config
        self.model.eval()
        self.model.generation_config = GenerationConfig()
        try:
            with torch.inference_mode():
                yield
        finally:
            self.model.generation_config = model_config
            for name, sub in self.model.named_modules():
                sub.training = modes.get(name, sub.training)


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


class _PerPromptSampler(LogitsProcessor):
    """Draws each row's next token from that row's own generator; returns 0 at it and -inf elsewhere.

    The distribution is the one unseeded sampling uses: transformers' temperature and top-p
    warpers over the raw logits, softmax (in float64). The token is drawn by inverse CDF with one
    uniform per row and step from the row's CPU generator, so a row's tokens depend only on its
    own logits and seed, not on the other rows or the device. Rows that have already finished
    still draw (their tokens are replaced by padding), which keeps every stream in step.
    """

    def __init__(self, generators: Sequence[torch.Generator], temperature: float, top_p: float):
        self.generators = list(generators)
        warpers = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p))
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"{scores.shape[0]} rows to sample but {len(self.generators)} generators")
        probs = torch.softmax(self.warpers(input_ids, scores).double(), dim=-1)  # (B, V)
        uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators])
        cdf = probs.cumsum(dim=-1)
        targets = (uniforms.to(probs.device) * cdf[:, -1]).unsqueeze(-1)  # (B, 1), in [0, total mass)
        tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # first token whose cdf exceeds it
        # rounding can put a target at the total mass: fall back to the last token that has any
        last_with_mass = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        tokens = torch.minimum(tokens, last_with_mass)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens.unsqueeze(-1), 0.0)
