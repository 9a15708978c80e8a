"""The Engine contract: token ids in, token ids + log-probs out (docs/architecture.md §6).

An action is never decoded and re-encoded: re-tokenizing generated text shifts token boundaries,
which breaks the recorded log-probs and the action mask. Engines therefore only see and return ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one action.

    max_new_tokens: budget of generated tokens per request.
    temperature: softmax temperature; 0 means greedy. Recorded log-probs are those of the
        distribution actually sampled from (logits / temperature), so PPO ratios are on-policy.
    top_p: nucleus sampling mass (1.0 = off).
    seed: prompt i of a call samples with seed `seed + i`, independently of the call's other
        prompts, so a seeded call is reproducible on the same engine and hardware. None: unseeded.
    prompt_seeds: when set, prompt i of the call samples with prompt_seeds[i] (one per prompt); it
        overrides `seed`. A caller that splits a call (a router sending parts to several replicas)
        passes each part the seeds of its prompts, so the parts sample what the whole call would.
    stop_token_ids: generation ends after emitting one of these (it stays in token_ids).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    prompt_seeds: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.prompt_seeds is not None:  # a list would make the params unhashable
            object.__setattr__(self, "prompt_seeds", tuple(int(s) for s in self.prompt_seeds))


@dataclass(frozen=True)
class Generation:
    """One sampled continuation. len(token_ids) == len(logprobs) >= 1.

    finish_reason: "stop" when it ended on a stop token, "length" when it hit max_new_tokens.
    policy_version / served_by / retries: set by engines that know them (a replica router,
    agent_core/cluster): the weights version that generated it, the replica, and how many
    replicas failed this request before; None / 0 otherwise (the loop's own version is recorded).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int | None = None
    served_by: str | None = None
    retries: int = 0


class Engine(Protocol):
    """Generates continuations for a batch of tokenized prompts, in order.

    A seeded call samples prompt i with seed `seed + i` (or `prompt_seeds[i]`; see `seeds_of`),
    independently of the other prompts in the call: the same prompt and seed give the same
    sample whichever prompts share the call, so a call split across replicas samples what it
    would have sampled whole.

    An engine may also define ``max_concurrent_calls: int`` (read with `concurrent_calls`): how
    many `generate` calls may be in flight at once from different threads. In-process engines
    compute one batch at a time (1, the default); a server engine (vLLM) batches continuously
    across calls, so the agent loop sends each ready episode's request without waiting for the
    batch before it to finish.
    """

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        ...


def check_request(prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
    """Reject what no engine can serve: an empty prompt, a zero budget, a negative temperature,
    top_p outside (0, 1], prompt_seeds that are not one per prompt."""
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
    seeds_of(params, len(prompts))


def seeds_of(params: SamplingParams, count: int) -> list[int] | None:
    """The seed of each of a call's `count` prompts: `prompt_seeds` when set, else `seed + i`; None when unseeded.

    Raises ValueError when `prompt_seeds` does not hold exactly one seed per prompt.
    """
    if params.prompt_seeds is not None:
        if len(params.prompt_seeds) != count:
            raise ValueError(f"prompt_seeds holds {len(params.prompt_seeds)} seeds for {count} prompts; "
                             "it needs exactly one seed per prompt")
        return list(params.prompt_seeds)
    if params.seed is None:
        return None
    return [params.seed + i for i in range(count)]


def concurrent_calls(engine: object) -> int:
    """How many `generate` calls `engine` accepts at once (1 unless it says otherwise)."""
    return max(1, int(getattr(engine, "max_concurrent_calls", 1)))
