"""The in-process engine: transformers `generate` with a KV cache and left padding (docs/architecture.md §6).

Token ids in, token ids + log-probs out: log_softmax(logits / temperature) at the sampled token, before top-p
(greedy: temperature 1); vLLM by default reports unscaled ones (docs/architecture.md §10). An explicit
GenerationConfig replaces the model's own. Optional: per-session KV reuse, static cache. A seeded call samples
each prompt from its own CPU random stream; the global RNG is never touched.
Design notes: docs/architecture.md §11 (agent_core/rollout/hf_engine.py).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import torch
from transformers import (
    GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper,
)

from agent_core.config import HFEngineConfig
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import Generation, SamplingParams, check_request, seeds_of
from agent_core.rollout.kv_reuse import KeptCache, SessionCaches, cut_rows, layout

log = logging.getLogger(__name__)
CACHES = ("dynamic", "static")
STATIC_BUCKET = 256  # static cache lengths are rounded up to this: one compiled decode step per bucket


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

    def __init__(self, model, tokenizer, *, max_batch_size: int = 64, release: Callable[[], None] | None = None,
                 kv_reuse_bytes: int = 0, cache: str = "dynamic"):
        """release: called once by `close()`, for a module the engine borrowed (the trainer's resident
        policy, agent_core/training/resident.py) rather than loaded. kv_reuse_bytes: most bytes of
        sessions' caches kept between calls (0: none kept). cache: dynamic or static (module docstring)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if cache not in CACHES:
            raise ValueError(f"unknown cache {cache!r}; choose one of {', '.join(CACHES)}")
        self.cache = cache
        # a static cache is preallocated per call: kept caches cannot join it
        self.sessions = SessionCaches(kv_reuse_bytes) if kv_reuse_bytes > 0 and cache == "dynamic" else None
        self.routes_sessions = self.sessions is not None
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._release = release
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        self.pad_token_id = pad

    @classmethod
    def configured(cls, model, tokenizer, settings: HFEngineConfig, *, max_batch_size: int = 64,
                   release: Callable[[], None] | None = None) -> "HFEngine":
        """The engine as `rollout.hf` configures it (its cache and KV reuse; the dtype is the caller's:
        it decides which module is passed): the one construction the factory and the benchmarks share."""
        return cls(model, tokenizer, max_batch_size=max_batch_size, release=release, cache=settings.cache,
                   kv_reuse_bytes=int(settings.kv_reuse_gib * 2**30) if settings.kv_reuse else 0)

    def close(self) -> None:
        """Give a borrowed module back (nothing for one the engine loaded); the engine is not used after."""
        if self.sessions is not None:
            self.sessions.clear()
        release, self._release = self._release, None
        if release is not None:
            release()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 sessions: Sequence[str] | None = None) -> list[Generation]:
        """One continuation per prompt, in order (see the Engine protocol). sessions: the episode of
        each prompt, whose kept cache the call may continue (KV reuse; ignored without it)."""
        check_request(prompts, params)
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts; give one per prompt")
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
                chunk_sessions = None if sessions is None else sessions[start : start + len(chunk)]
                sampler = None
                if generators is not None:
                    rows = generators[start : start + len(chunk)]
                    sampler = _PerPromptSampler(rows, params.temperature, params.top_p)
                results.extend(self._generate_batch(chunk, config, params.temperature, stop_ids, sampler,
                                                    chunk_sessions))
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
        sessions: Sequence[str] | None = None,
    ) -> list[Generation]:
        keep = self.sessions is not None and sessions is not None
        kept = [self.sessions.take(s, p) for s, p in zip(sessions, prompts)] if keep else [None] * len(prompts)
        extra = {}
        if any(k is not None for k in kept):
            input_ids, attention_mask, past = layout(prompts, kept, self.pad_token_id, self.model.device)
            extra["past_key_values"] = _dynamic_cache(past)
        else:
            input_ids, attention_mask = _left_pad(prompts, self.pad_token_id, self.model.device)
            if self.cache == "static":
                extra = self._static_cache(input_ids.shape, config.max_new_tokens)
        processors = LogitsProcessorList([sampler] if sampler is not None else [])
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                  logits_processor=processors, **extra)
        # out.logits are the raw logits, taken before any logits processor (the sampler included)
        new_tokens = out.sequences[:, input_ids.shape[1] :]  # (B, T): T = steps taken by the longest
        logprobs = _sampled_logprobs(out.logits, new_tokens, temperature)  # (B, T)
        results = [_cut_at_stop(ids, lps, stop_ids) for ids, lps in zip(new_tokens.tolist(), logprobs.tolist())]
        if keep:
            self._keep(sessions, prompts, results, out, attention_mask)
        return results

    def _keep(self, sessions, prompts, results: list[Generation], out, attention_mask: torch.Tensor) -> None:
        """Each session's cache after the call, for its next turn (agent_core/rollout/kv_reuse.py)."""
        layers = _cache_layers(getattr(out, "past_key_values", None))
        if layers is None:  # a cache kind this engine cannot cut rows from: reuse stays off for the model
            log.warning("hf engine: %s returned no plain dynamic KV cache; KV reuse is off",
                        type(self.model).__name__)
            self.sessions, self.routes_sessions = None, False
            return
        rows = cut_rows(layers, attention_mask, prompts, [g.token_ids for g in results])
        for session, row in zip(sessions, rows):
            if row is not None:
                self.sessions.put(session, row)

    def _static_cache(self, shape: torch.Size, max_new_tokens: int) -> dict:
        """past_key_values: a StaticCache of the call's length rounded up to STATIC_BUCKET (one compiled
        decode step per bucket); {} with a warning, once, where the model has none (dynamic fallback)."""
        from transformers import StaticCache

        length = -(-(shape[1] + max_new_tokens) // STATIC_BUCKET) * STATIC_BUCKET
        try:
            return {"past_key_values": StaticCache(config=self.model.config, max_cache_len=length)}
        except Exception as error:  # noqa: BLE001  (any model without a static cache: fall back, say so)
            log.warning("hf engine: no static cache for %s (%s: %s); using the dynamic cache",
                        type(self.model).__name__, type(error).__name__, error)
            self.cache = "dynamic"
            return {}

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


def _dynamic_cache(past: list[tuple[torch.Tensor, torch.Tensor]]):
    """A transformers DynamicCache holding `past` (per layer keys, values [B, heads, W, head_dim])."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=past)


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per layer (keys, values) of a plain DynamicCache, else None (sliding-window, quantized, other kinds)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if type(cache) is not DynamicCache or not all(type(layer) is DynamicLayer for layer in cache.layers):
        return None
    return [(layer.keys, layer.values) for layer in cache.layers]


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
