"""Context management: how an episode's next context is built from its turns (docs/architecture.md §2).

All token ids; the agent loop records the ids returned here as the step's `prompt_ids`, so the policy is
trained on exactly what it saw. Modes: "append" (default: head + every turn, each context extends the last)
and "last_k" (head + the last `keep_last_turns` turns). Differs from Agent-R1, whose context is always
append-everything: the window and the `max_observation_tokens` cut are extras its MDP formulation allows.
Design notes: docs/architecture.md §11 (agent_core/rollout/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CONTEXT_MODES: tuple[str, ...] = ("append", "last_k")

TRUNCATION_MARKER = " ...[truncated]"


@dataclass(frozen=True)
class ContextPolicy:
    """mode: "append" or "last_k"; keep_last_turns: turns kept by "last_k" (>= 1);
    max_observation_tokens: cut each observation's text to this many tokens (None = no cut)."""

    mode: str = "append"
    keep_last_turns: int = 2
    max_observation_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in CONTEXT_MODES:
            raise ValueError(f"unknown context mode {self.mode!r}; valid modes: {', '.join(CONTEXT_MODES)}")
        if self.keep_last_turns < 1:
            raise ValueError(f"keep_last_turns must be >= 1, got {self.keep_last_turns}")
        if self.max_observation_tokens is not None and self.max_observation_tokens < 1:
            raise ValueError(f"max_observation_tokens must be >= 1 or None, got {self.max_observation_tokens}")


@dataclass
class EpisodeContext:
    """The token pieces of one episode; `ids()` is the context the next LLM call receives."""

    head: list[int]
    turns: list[list[int]] = field(default_factory=list)

    def add_turn(self, action_ids: list[int], observation_ids: list[int]) -> None:
        self.turns.append([*action_ids, *observation_ids])

    def ids(self, policy: ContextPolicy) -> list[int]:
        kept = self.turns if policy.mode == "append" else self.turns[-policy.keep_last_turns:]
        out = list(self.head)
        for turn in kept:
            out.extend(turn)
        return out


def extends(context: list[int], previous: list[int]) -> bool:
    """True when `context` starts with `previous` (the steps can then share one sequence)."""
    return len(context) >= len(previous) and context[: len(previous)] == previous


def truncate_text(tokenizer, text: str, max_tokens: int | None) -> tuple[str, int]:
    """`text` cut to its first `max_tokens` tokens plus a visible marker; returns (text, tokens cut).

    An observation is env text, not policy output, so decoding its kept tokens back to text is
    safe: the loop renders the returned text and records the ids the engine then receives.
    """
    if max_tokens is None or not text:
        return text, 0
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text, 0
    kept = tokenizer.decode(ids[:max_tokens], skip_special_tokens=False)
    return kept + TRUNCATION_MARKER, len(ids) - max_tokens
