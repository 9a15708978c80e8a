"""Example: an environment without tools, in one file. See docs/guides/write-an-env.md.

The agent guesses a secret number in 1..`high`; the env answers "higher" or "lower". Any text env
fits the same protocol: `reset(prompt)` opens the conversation, `step(action_text)` answers.

Use it in a run:  agentr1 train --set plugins=[examples.guess_number_env] --set rollout.env=guess_number
"""

import random
import re

from agent_core.envs.base import EnvStep
from agent_core.envs.registry import ENVS
from agent_core.types import ChatMessage, Prompt

_NUMBER = re.compile(r"-?\d+")


class GuessNumberEnv:
    observation_role = "user"  # the chat role the env's answers are rendered as

    def __init__(self, high: int = 16, seed: int | None = None, step_penalty: float = 0.05):
        if high < 2:
            raise ValueError(f"guess_number: high must be >= 2, got {high}")
        self.high, self.step_penalty = high, step_penalty
        self.rng = random.Random(seed)
        self.secret = 0

    def reset(self, prompt: Prompt) -> tuple[ChatMessage, ...]:
        self.secret = self.rng.randint(1, self.high)
        rules = f"I am thinking of a number from 1 to {self.high}. Reply with one number per turn."
        return (ChatMessage("system", rules), *prompt.messages)

    def step(self, action_text: str) -> EnvStep:
        match = _NUMBER.search(action_text)
        if match is None:  # a bad action is data: say so, penalise, go on
            return EnvStep(observation="Reply with a number.", reward=-self.step_penalty, done=False,
                           parse_error="no number in the reply", info={"format_ok": False})
        guess = int(match.group())
        if guess == self.secret:
            # The outcome reward is usually labelled later by a scorer; an env may also give it here.
            return EnvStep(observation="", reward=1.0, done=True, termination="answered",
                           info={"answer": str(guess), "format_ok": True})
        hint = "higher" if guess < self.secret else "lower"
        return EnvStep(observation=hint, reward=-self.step_penalty, done=False, info={"guess": guess, "hint": hint})


@ENVS.register("guess_number")
def make_guess_number(resources, *, high: int = 16, seed: int | None = None, step_penalty: float = 0.05) -> GuessNumberEnv:
    """Factories get the rollout's shared resources (unused here) and the prompt's env kwargs."""
    return GuessNumberEnv(high=high, seed=seed, step_penalty=step_penalty)
